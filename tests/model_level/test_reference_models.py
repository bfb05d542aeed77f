"""Model level: every reference model, optimized, still gives the same answers.

Each model of fuser.models is optimized (torch backend on the CPU, compiled Triton kernels under -m gpu)
and compared with a float64 run of the original: the whole output within the tolerance table, and what a
user looks at (top-1 labels, boxes) unchanged. The fused chains must be exactly the ones the architecture
contains (the model lists their head modules), and no eval-mode BatchNorm may survive.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from accuracy import assert_close, reference64, rel_error
from torch import nn

import fuser
from fuser import models

# (model, batch, input size): odd sizes where the architecture allows (YOLO needs multiples of 32).
CASES = [
    ("yolov8n", 2, (96, 64)),
    ("efficientnet_b0", 1, (49, 43)),  # float64 depthwise convs are slow on a CPU
    ("resnet50", 2, (67, 61)),
    ("vit_tiny", 2, None),
    ("bert_tiny", 3, 37),
]
# Per model: the convs that stay unfused, each a lone conv without bias that nothing fused reads or feeds
KEPT_CONVS = {"yolov8n": [["model.22.dfl.conv"]]}


def remaining_batchnorms(module: nn.Module) -> list[str]:
    """Eval-mode BatchNorm modules still called, and F.batch_norm calls still in any graph."""
    found = []
    for name, m in module.named_modules():
        if isinstance(m, torch.fx.GraphModule):
            found += [f"{name}:{n.name}" for n in m.graph.nodes if n.op == "call_function" and n.target is F.batch_norm]
            targets = {str(n.target) for n in m.graph.nodes if n.op == "call_module"}
            found += [f"{name}.{t}" for t in targets if isinstance(m.get_submodule(t), nn.BatchNorm2d)]
    return found


def check_user_visible(name: str, out: torch.Tensor, ref: torch.Tensor) -> None:
    if name.startswith("yolo"):
        # boxes (xywh, first 4 rows) of the anchors the model is most confident about
        scores = ref[:, 4:].amax(1)
        top = scores.topk(50, dim=1).indices
        boxes = lambda t: torch.stack([t[b, :4, top[b]] for b in range(t.shape[0])])
        assert_close(boxes(out), boxes(ref), "ieee", f"{name} boxes")
    elif out.dim() == 2:
        # top-1 labels, wherever the reference's top-2 margin exceeds the numerical error
        top2 = ref.topk(2, dim=1).values
        decided = (top2[:, 0] - top2[:, 1]) > 1e-4 * ref.abs().amax()
        assert torch.equal(out.argmax(1)[decided], ref.argmax(1)[decided])


@pytest.mark.parametrize(("name", "batch", "size"), CASES, ids=[c[0] for c in CASES])
def test_reference_model_torch_backend(name, batch, size):
    model = models.build(name)
    x = models.example_input(name, batch=batch, size=size, seed=1)
    opt = fuser.optimize(model, (x,), backend="torch")
    report = opt.fusion_report
    assert len(report.fused) == model.expected_fusions, str(report)
    assert sorted(e.modules[0] for e in report.fused) == sorted(model.expected_chain_heads)
    # the only conv left is YOLO's DFL conv: no bias, nothing beside it to fuse (the report says so)
    assert [e.modules for e in report.rejected] == KEPT_CONVS.get(name, []), str(report)
    assert all("no bias" in e.reason for e in report.rejected), str(report)
    assert not remaining_batchnorms(opt)
    with torch.no_grad():
        out = opt(x)
    ref = reference64(model, x)
    assert_close(out, ref, "ieee", name)
    check_user_visible(name, out, ref)


def test_detector_is_captured_around_its_untraceable_head():
    report = fuser.explain(models.build("yolov8n"), models.example_input("yolov8n", size=64))
    untraced = {u.type_name for u in report.untraced}
    assert "Detect" in untraced
    assert any(e.graph.startswith("model.22.") for e in report.fused), "the head's conv blocks must be fused"


def test_interpret_backend_on_a_small_resnet():
    model = models.build("resnet26", width=8)
    x = models.example_input("resnet26", batch=1, size=(35, 33), seed=2)
    opt = fuser.optimize(model, (x,), backend="interpret", precision="ieee")  # the kernels' arithmetic, exact
    assert len(opt.fusion_report.fused) == model.expected_fusions
    with torch.no_grad():
        assert rel_error(opt(x), reference64(model, x)) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["tf32", "bf16"])
@pytest.mark.parametrize(("name", "batch", "size"), CASES, ids=[c[0] for c in CASES])
def test_reference_model_triton_backend(name, batch, size, precision):
    model = models.build(name).cuda()
    x = models.example_input(name, batch=batch, size=size, seed=1).cuda()
    opt = fuser.optimize(model, (x,), backend="triton", precision=precision)
    assert len(opt.fusion_report.fused) == model.expected_fusions
    with torch.no_grad():
        out = opt(x)
    ref = reference64(model.cpu(), x.cpu())
    # model level: errors of a few dozen layers add up; the per-layer bound times a small depth factor
    bound = {"tf32": 1e-2, "bf16": 5e-2}[precision]
    assert rel_error(out, ref) < bound, f"{name} {precision}: {rel_error(out, ref):.2e}"
