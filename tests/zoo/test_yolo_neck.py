"""ultralytics' detectors from their yaml: the backbone and neck are one graph, so nothing between the convs
of the neck is materialized (the upsample + Concat a conv reads is a virtual input, every other Concat and
C2f / C3k2 cat a buffer the producers store into), against float64 eager ultralytics.

capture traces ``DetectionModel.forward`` with the Detect head as a leaf (it compares shapes) and C2f's
``list(chunk(2, 1))`` as two pieces (fuser.capture.tracing). What a forward still runs besides fuser's
kernels is counted by kind with the kernel launches stubbed out (no arithmetic, so it takes a second): a
rewrite that stops firing adds a cat, a copy or an upsample there and fails the count.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest
import torch
from accuracy import assert_close, rel_error
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from zoo_models import ZOO

pytest.importorskip("ultralytics", reason="needs ultralytics: `make test` installs it (Makefile, extra 'zoo')")

from ultralytics.nn import tasks
from ultralytics.nn.tasks import yaml_model_load

import fuser
import fuser.kernels.launch
from fuser.models.common import randomize_batchnorm

# Per model: the neck's upsample -> Concat -> conv steps read as virtual inputs, the cats that get a buffer
# (every C2f / C3k2 / C2PSA / C3 cat and the neck's Concats of a conv output with an earlier level), and what a
# forward runs outside fuser's kernels (nothing in YOLOv8 and YOLOv5: the head's last 1x1 convs are lone convs
# with their bias in the epilogue, and the fused detect tail reads their outputs without a cat; YOLO11's
# attention block: its matmuls, its softmax, a reshape of a split and the split half copied into its cat buffer).
EXPECTED: dict[str, dict[str, Any]] = {
    "yolov8n": {
        "virtual_cat": ["model.11", "model.14"],
        "cat_buffer": [f"model.{i}" for i in (2, 4, 6, 8, 12, 15, 17, 18, 20, 21)],
        "outside": {},
    },
    "yolo11n": {
        "virtual_cat": ["model.12", "model.15"],
        "cat_buffer": [f"model.{i}" for i in (2, 4, 6, 8, 10, 13, 16, 18, 19, 21, 22)]
        + ["model.6.m.0", "model.8.m.0", "model.22.m.0"],
        "outside": {"bmm": 2, "mul": 1, "_softmax": 1, "clone": 1, "copy_": 1},
    },
    # C3: both of its 1x1 convs read the neck's upsample + Concat as a virtual input
    "yolov5nu": {
        "virtual_cat": ["model.12", "model.16"],
        "cat_buffer": [f"model.{i}" for i in (2, 4, 6, 8, 13, 17, 19, 20, 22, 23)],
        "outside": {},
    },
}
# allocations, and a view that aten does not mark as one
_NO_WORK = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "_unsafe_view"}


def _zoo(name: str) -> Any:
    return next(z for z in ZOO if z.name == name)


class _OpsRun(TorchDispatchMode):
    """Counts the aten ops that do work (no views, no allocations) by kind."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func.overloadpacket.__name__
        if not func.is_view and name not in _NO_WORK:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def _leaves(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_backbone_and_neck_are_one_graph_and_match_float64(name: str) -> None:
    zoo = _zoo(name)
    model, x = zoo.build(), zoo.example_input()
    state = copy.deepcopy(model.state_dict())
    with torch.no_grad():
        eager = model(x)
    fast = fuser.optimize(model, (x,), backend="torch", precision="ieee")
    report = fast.fusion_report
    head = f"model.{len(model.model) - 1}"
    assert [(u.path, u.type_name) for u in report.untraced] == [(head, "Detect")], str(report)
    for kind in ("virtual_cat", "cat_buffer"):
        found = sorted(r.location for r in report.rewrites if r.kind == kind)
        assert found == sorted(EXPECTED[name][kind]), f"{kind}: {found}\n{report}"
    assert [r.location for r in report.rewrites if r.kind == "detect_head"] == [head]
    # each branch's last 1x1 conv (bias, nothing after it) is fused alone; the bias-free DFL conv stays
    lone = sorted(e.modules[0] for e in report.fused if e.ops == ["conv2d"])
    assert lone == sorted(f"{head}.cv{b}.{i}.2" for b in (2, 3) for i in range(3)), str(report)
    assert [e.modules for e in report.rejected] == [[f"{head}.dfl.conv"]], str(report)
    with torch.no_grad():
        out = fast(x)
        ref = copy.deepcopy(model).double()(x.double())
    got, want, own = _leaves(out), _leaves(ref), _leaves(eager)
    assert len(got) == len(want) == 6
    for i, (a, b, e) in enumerate(zip(got, want, own, strict=True)):
        # within the table, or twice float32 eager's own error where float32 itself is further from float64
        bound = max(1e-5, 2 * rel_error(e, b))
        assert rel_error(a, b) < bound, f"output {i} {tuple(a.shape)}: {rel_error(a, b):.2e} >= {bound:.1e}"
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items()), "the user's model changed"
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(_leaves(model(x)), own, strict=True))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_no_cat_copy_or_upsample_runs_besides_the_kernels(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    zoo = _zoo(name)
    model, x = zoo.build(), zoo.example_input()
    fast = fuser.optimize(model, (x,), backend="interpret", precision="ieee")
    launches: Counter[str] = Counter()
    monkeypatch.setattr(fuser.kernels.launch, "run_interpreted", lambda k, *a, **kw: launches.update([k.fn.__name__]))
    with torch.no_grad():
        fast(x)  # the launch plans are made on a first call
        launches.clear()
        with _OpsRun() as run:
            fast(x)
    assert dict(run.ops) == EXPECTED[name]["outside"], dict(run.ops)
    assert launches["_detect_head_kernel"] == 1 and launches["_max_pool_pyramid_kernel"] == 1, dict(launches)


def _narrow_yolov8n() -> torch.nn.Module:
    """yolov8n's layers at an eighth of the width (16 to 64 channels in the neck) and 3 classes: the same
    graph, at an interpreter cost a test can pay."""
    cfg = yaml_model_load("yolov8n.yaml")
    cfg["scales"], cfg["nc"] = {"n": [0.33, 0.125, 1024]}, 3
    torch.manual_seed(0)
    model = tasks.DetectionModel(cfg, verbose=False)
    return randomize_batchnorm(model, torch.Generator().manual_seed(1)).eval()


@pytest.mark.slow
def test_kernels_store_into_the_neck_buffers_and_keep_earlier_outputs() -> None:
    """The Triton kernels (in the interpreter): the slot views that the neck's convs write (and that the
    next upsample reads as a virtual input, and the head reads) give float64's answer, and a second call
    leaves the first call's outputs as they were."""
    model = _narrow_yolov8n()
    g = torch.Generator().manual_seed(5)
    x1, x2 = torch.randn(1, 3, 64, 96, generator=g), torch.randn(1, 3, 64, 96, generator=g)
    fast = fuser.optimize(model, (x1,), backend="interpret", precision="ieee")
    kinds = Counter(r.kind for r in fast.fusion_report.rewrites)
    assert kinds["virtual_cat"] == 2 and kinds["cat_buffer"] == 10 and kinds["detect_head"] == 1, kinds
    with torch.no_grad():
        first = fast(x1)
        kept = [t.clone() for t in _leaves(first)]
        second = fast(x2)
        refs = [copy.deepcopy(model).double()(x.double()) for x in (x1, x2)]
    for i, (a, b) in enumerate(zip(_leaves(first), kept, strict=True)):
        assert torch.equal(a, b), f"output {i} of the first call changed in the second"
    for out, ref in zip((first, second), refs, strict=True):
        for i, (a, b) in enumerate(zip(_leaves(out), _leaves(ref), strict=True)):
            assert_close(a, b, "ieee", f"output {i} {tuple(a.shape)}")
