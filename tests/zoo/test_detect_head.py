"""ultralytics' Detect with its inference tail fused (fuser.rewrite.detect_head), against float64 eager ultralytics.

The whole output is compared: the decoded ``[N, 4 + nc, A]`` and the raw prediction dict ultralytics returns
beside it in eval (boxes, scores, feats). The head alone runs the kernel in Triton's interpreter; whole models
from their yaml run the torch backend at odd input sizes. Heads that override the tail (Segment, Pose,
v10Detect) and a hand-made near miss stay unfused and correct; the user's model is untouched."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from accuracy import rel_error
from torch import nn
from torch.utils._pytree import tree_flatten

pytest.importorskip("ultralytics", reason="needs ultralytics: `make test` installs it (Makefile, extra 'zoo')")

from ultralytics.nn import tasks
from ultralytics.nn.modules.head import Detect
from ultralytics.utils.tal import dist2bbox

import fuser
from fuser.models.common import randomize_batchnorm
from fuser.rewrite.detect_head import FusedDetectForward


class Head(nn.Module):
    """Detect alone, on feature maps passed as separate inputs (as the model's routing passes a list)."""

    def __init__(self, nc: int, ch: tuple[int, ...], strides: tuple[float, ...], head: type = Detect) -> None:
        super().__init__()
        self.head = head(nc=nc, ch=ch)
        self.head.stride = torch.tensor(strides)

    def forward(self, *feats: torch.Tensor) -> object:
        return self.head(list(feats))


class XyxyDetect(Detect):
    """A near miss: Detect with its own box decoding (always xyxy)."""

    def decode_bboxes(
        self, bboxes: torch.Tensor, anchors: torch.Tensor, angle: torch.Tensor | None = None
    ) -> torch.Tensor:
        return dist2bbox(bboxes, anchors, xywh=False, dim=1)


def build(model: nn.Module) -> nn.Module:
    """``model`` in eval with its weights moved off their initial constants and random BN statistics."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # biases and weights off their initial constants
    return randomize_batchnorm(model, torch.Generator().manual_seed(1)).eval()


def features(batch: int, ch: tuple[int, ...], size: tuple[int, int]) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(2)
    return tuple(
        torch.randn(batch, c, size[0] // s, size[1] // s, generator=g) for c, s in zip(ch, (8, 16, 32), strict=True)
    )


def leaves(value: object) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def assert_matches(model: nn.Module, optimized: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
    """Every output tensor within 1e-5 of float64 eager ultralytics (or twice float32 eager's own error)."""
    with torch.no_grad():
        out = optimized(*inputs)
        ref = copy.deepcopy(model).double()(*(t.double() for t in inputs))
        eager = model(*inputs)
    got, want, own = leaves(out), leaves(ref), leaves(eager)
    assert len(got) == len(want) and type(out) is type(ref), "the output's structure must be ultralytics'"
    for i, (a, b, e) in enumerate(zip(got, want, own, strict=True)):
        bound = max(1e-5, 2 * rel_error(e, b))
        assert a.shape == b.shape and a.dtype == e.dtype, f"output {i}: {a.shape} {a.dtype} vs {b.shape}"
        assert rel_error(a, b) < bound, f"output {i} {tuple(a.shape)}: error {rel_error(a, b):.2e} >= {bound:.0e}"


def fused_tail(optimized: nn.Module) -> nn.Module:
    heads = [m for m in optimized.modules() if isinstance(m.__dict__.get("forward"), FusedDetectForward)]
    assert len(heads) == 1, "the Detect head must run the fused forward"
    return getattr(heads[0], heads[0].forward.tail)


@pytest.mark.parametrize(
    ("nc", "size", "flags"), [(7, (64, 96), False), (13, (96, 64), True)], ids=["nc7", "nc13-xyxy-export"]
)
def test_head_alone_runs_the_kernel(nc: int, size: tuple[int, int], flags: bool) -> None:
    """The kernel's path: the default, and with xyxy boxes and export mode (the decoded output alone)."""
    ch = (11, 19, 23)
    model = build(Head(nc, ch, (8.0, 16.0, 32.0)))
    inputs = features(2, ch, size)
    optimized = fuser.optimize(model, inputs, precision="ieee", backend="interpret")
    if flags:
        model.head.xyxy = model.head.export = optimized.module.head.xyxy = optimized.module.head.export = True
    assert_matches(model, optimized, inputs)
    plans = list(fused_tail(optimized)._plans.values())
    assert plans and all(p is not None for p in plans), "the kernel (not the reference) must have run"
    rewrites = [r for r in optimized.fusion_report.rewrites if r.kind == "detect_head"]
    assert [r.location for r in rewrites] == ["head"] and "dfl" in rewrites[0].eliminated
    assert "detect_head" in str(optimized.fusion_report)


def test_head_flags_and_new_shapes() -> None:
    """export (y alone), xyxy, a new input size (anchors remade by make_anchors), dynamic: as ultralytics
    (the fused forward's logic, on the reference; the kernel's flags are checked above)."""
    ch = (11, 19, 23)
    model = build(Head(5, ch, (8.0, 16.0, 32.0)))
    optimized = fuser.optimize(model, features(1, ch, (32, 64)), precision="ieee", backend="torch")
    head = optimized.module.head
    assert_matches(model, optimized, features(1, ch, (64, 32)))
    first = head.anchors
    assert_matches(model, optimized, features(1, ch, (32, 64)))
    assert not torch.equal(head.anchors, first), "a new input size makes new anchors"
    for flag in ("export", "xyxy", "dynamic"):
        setattr(model.head, flag, True)
        setattr(head, flag, True)
        assert_matches(model, optimized, features(2, ch, (32, 64)))
        setattr(model.head, flag, False)
        setattr(head, flag, False)


def test_user_model_untouched_and_saved_module_loads() -> None:
    ch = (11, 19, 23)
    model = build(Head(3, ch, (8.0, 16.0, 32.0)))
    inputs = features(1, ch, (32, 64))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    optimized = fuser.optimize(model, inputs, precision="ieee", backend="interpret")
    assert "forward" not in model.head.__dict__ and not hasattr(model.head, "fused_head")
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    buffer = io.BytesIO()
    torch.save(optimized, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert_matches(model, loaded, inputs)
    with torch.no_grad():
        again = optimized(*inputs)
        first = [t.clone() for t in leaves(again)]
        optimized(*features(1, ch, (64, 32)))
    assert all(torch.equal(a, b) for a, b in zip(leaves(again), first, strict=True)), "call k changed by call k+1"


@pytest.mark.filterwarnings("ignore:Converting a tensor to a Python boolean:torch.jit.TracerWarning")
def test_compiles_to_one_frame_and_exports_to_onnx(tmp_path) -> None:
    """torch.compile: no more frames or graph breaks than the original (once its anchors exist: the first
    call's make_anchors breaks the original's graph too); ONNX (export mode) runs in onnxruntime. The
    exporter's tracer warns about the anchor cache's shape check, as it does on ultralytics' own Detect."""
    import onnxruntime
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    ch = (11, 19, 23)
    model = build(Head(5, ch, (8.0, 16.0, 32.0)))
    inputs = features(1, ch, (32, 64))
    optimized = fuser.optimize(model, inputs, precision="ieee", backend="torch")
    with torch.no_grad():
        optimized(*inputs)
    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(optimized, backend=counter)
    for _ in range(3):
        assert_matches(model, compiled, inputs)
    assert counter.frame_count == 1 and not counters["graph_break"], dict(counters["graph_break"])

    model.head.export = optimized.module.head.export = True
    path = fuser.export_onnx(optimized, inputs, tmp_path / "head.onnx")
    session = onnxruntime.InferenceSession(str(path))
    names = [i.name for i in session.get_inputs()]
    (out,) = session.run(None, {n: t.numpy() for n, t in zip(names, inputs, strict=True)})
    with torch.no_grad():
        ref = copy.deepcopy(model).double()(*(t.double() for t in inputs))
    assert rel_error(torch.from_numpy(out), ref) < 1e-5


def test_near_miss_stays_unfused() -> None:
    ch = (11, 19, 23)
    model = build(Head(7, ch, (8.0, 16.0, 32.0), head=XyxyDetect))
    inputs = features(1, ch, (64, 96))
    optimized = fuser.optimize(model, inputs, precision="ieee", backend="interpret")
    assert "forward" not in optimized.module.head.__dict__
    skipped = optimized.fusion_report.skipped
    assert [(s.kind, s.location) for s in skipped] == [("detect_head", "head")]
    assert "XyxyDetect overrides Detect.decode_bboxes" in skipped[0].reason
    assert optimized.fusion_report.to_dict()["skipped"] == [
        {"kind": "detect_head", "location": "head", "reason": skipped[0].reason}
    ]
    assert "Left as they are:\n  detect_head head: XyxyDetect overrides" in str(optimized.fusion_report)
    assert not [r for r in optimized.fusion_report.rewrites if r.kind == "detect_head"]
    assert_matches(model, optimized, inputs)


def test_other_ultralytics_release_stays_unfused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused forward mirrors 8.4's Detect: under another release the head runs as it is."""
    import ultralytics

    monkeypatch.setattr(ultralytics, "__version__", "8.3.99")
    ch = (11, 19, 23)
    model = build(Head(7, ch, (8.0, 16.0, 32.0)))
    inputs = features(1, ch, (32, 64))
    optimized = fuser.optimize(model, inputs, precision="ieee", backend="torch")
    assert "forward" not in optimized.module.head.__dict__
    assert "ultralytics 8.3.99" in optimized.fusion_report.skipped[0].reason
    assert_matches(model, optimized, inputs)


@pytest.mark.parametrize(("cfg", "nc", "shape"), [("yolov8n.yaml", 13, (2, 3, 320, 416)),
                                                  ("yolo11n.yaml", 7, (1, 3, 352, 288))])  # fmt: skip
def test_whole_model(cfg: str, nc: int, shape: tuple[int, ...]) -> None:
    model = build(tasks.DetectionModel(cfg, nc=nc, verbose=False))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(4))
    optimized = fuser.optimize(model, (x,), precision="ieee", backend="torch")
    fused_tail(optimized)
    assert [r.location for r in optimized.fusion_report.rewrites if r.kind == "detect_head"] == ["model.22"
        if cfg.startswith("yolov8") else "model.23"]  # fmt: skip
    assert_matches(model, optimized, (x,))


@pytest.mark.parametrize(
    ("cfg", "model_class", "reason"),
    [
        ("yolov8n-seg.yaml", tasks.SegmentationModel, "Segment overrides Detect.forward"),
        ("yolov8n-pose.yaml", tasks.PoseModel, "Pose overrides Detect.forward_head"),
        ("yolov10n.yaml", tasks.DetectionModel, "end-to-end (one-to-one) head"),
    ],
)
def test_heads_that_override_the_tail_stay_correct(cfg: str, model_class: type, reason: str) -> None:
    model = build(model_class(cfg, nc=7, verbose=False))
    x = torch.randn(1, 3, 64, 96, generator=torch.Generator().manual_seed(4))
    optimized = fuser.optimize(model, (x,), precision="ieee", backend="torch")
    assert not [m for m in optimized.modules() if isinstance(m.__dict__.get("forward"), FusedDetectForward)]
    skipped = optimized.fusion_report.skipped
    assert len(skipped) == 1 and reason in skipped[0].reason, skipped
    assert "Left as they are" in str(optimized.fusion_report)
    assert_matches(model, optimized, (x,))


@pytest.mark.gpu
def test_whole_model_on_gpu() -> None:
    """YOLOv8n at 640x640 and at an odd size on the compiled kernels (CUDA graphs on), against float64."""
    for shape in ((1, 3, 640, 640), (2, 3, 352, 288)):
        model = build(tasks.DetectionModel("yolov8n.yaml", nc=13, verbose=False)).cuda()
        x = torch.randn(shape, generator=torch.Generator().manual_seed(4)).cuda()
        optimized = fuser.optimize(model, (x,), precision="ieee")
        plans = fused_tail(optimized)._plans
        for _ in range(3):  # warm-up calls, then the CUDA graph's replays
            assert_matches(model, optimized, (x,))
        assert plans and all(p is not None for p in plans.values()), "the kernel (not the reference) must have run"
