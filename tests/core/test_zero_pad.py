"""A zero padding before a fused conv becomes the conv's own padding (fuser.rewrite.zero_pad).

The forms are those of real models: ``F.pad`` of TensorFlow's "same" padding (timm's Conv2dSame, transformers'
tf_padding) and ``nn.ZeroPad2d`` before a stride-2 depthwise conv (transformers' EfficientNet); the ONNX form
(a Conv with ``auto_pad`` SAME_UPPER) is in tests/onnx/test_onnx_fusion.py. Each is checked against a float64
run of the original, on the torch reference and on the Triton kernels in the interpreter, which then read the
pad's zeros as padding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from accuracy import assert_close, reference64
from torch import nn
from toy_models import seeded

import fuser


class PadConvBnAct(nn.Module):
    """``pad`` then conv (no padding of its own) -> BN -> SiLU; ``pad`` a module or the arguments of F.pad."""

    def __init__(self, pad: nn.Module | tuple, c_in: int = 5, c_out: int = 7, k: int = 3, stride: int = 2,
                 groups: int = 1) -> None:  # fmt: skip
        super().__init__()
        self.pad = pad
        self.conv = nn.Conv2d(c_in, c_out, k, stride, padding=0, groups=groups, bias=False)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pad(x) if isinstance(self.pad, nn.Module) else F.pad(x, *self.pad)
        return F.silu(self.bn(self.conv(x)))


FOLDED = {
    "same-s2": lambda: PadConvBnAct(([0, 1, 0, 1],)),
    "same-s2-odd": lambda: PadConvBnAct(([1, 1, 0, 1], "constant", 0.0)),
    "zeropad-depthwise": lambda: PadConvBnAct(nn.ZeroPad2d((0, 1, 1, 0)), 6, 6, groups=6),
    "constantpad0": lambda: PadConvBnAct(nn.ConstantPad2d((2, 1, 1, 2), 0.0), stride=1),
    "width-only": lambda: PadConvBnAct(([2, 0],), stride=1),
}


@pytest.mark.parametrize("backend", ["torch", "interpret"])
@pytest.mark.parametrize("case", list(FOLDED))
def test_zero_pad_before_a_fused_conv_is_its_padding(case: str, backend: str):
    model = seeded(FOLDED[case]())
    x = torch.randn(2, model.conv.in_channels, 13, 11)
    opt = fuser.optimize(model, (x,), backend=backend, precision="ieee")
    report = opt.fusion_report
    assert [e.ops for e in report.fused] == [["conv2d", "batch_norm", "silu"]], str(report)
    assert [r.kind for r in report.rewrites if r.kind == "zero_pad"] == ["zero_pad"], str(report)
    graph = opt.module if isinstance(opt.module, torch.fx.GraphModule) else opt.module.fused_graph
    ops = [n for n in graph.graph.nodes if n.op in ("call_function", "call_module")]
    assert len(ops) == 1, graph.code  # the fused conv alone
    with torch.no_grad():
        assert_close(opt(x), reference64(model, x), "ieee", case)


# the compiled kernels read the folded, often asymmetric padding as their own: on the GPU they take other paths
# than the interpreter (TMA boxes, the depthwise kernel's tiles), so the cases run there too, and one with
# channels and an image wide enough for the tensor-core tiles
GPU_CASES = {**FOLDED, "same-s2-wide": lambda: PadConvBnAct(([0, 1, 1, 0],), c_in=48, c_out=72)}


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["ieee", "tf32"])
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_zero_pad_folded_into_the_compiled_kernels(case: str, precision: str):
    model = seeded(GPU_CASES[case]()).cuda()
    x = torch.randn(3, model.conv.in_channels, 45, 37, device="cuda")
    opt = fuser.optimize(model, (x,), backend="triton", precision=precision, cuda_graphs=False)
    assert [r.kind for r in opt.fusion_report.rewrites if r.kind == "zero_pad"] == ["zero_pad"]
    with torch.no_grad():
        assert_close(opt(x), reference64(model, x), precision, f"{case} {precision}")


KEPT = {
    "reflect": lambda: PadConvBnAct(([1, 1, 1, 1], "reflect")),
    "value-1": lambda: PadConvBnAct(([1, 1, 1, 1], "constant", 1.0)),
    "crop": lambda: PadConvBnAct(([-1, 0, 0, 0],)),
    "channels": lambda: PadConvBnAct(([1, 1, 1, 1, 0, 1],), c_in=4, c_out=7),
    "constantpad-2": lambda: PadConvBnAct(nn.ConstantPad2d(1, 2.0)),
}


@pytest.mark.parametrize("case", list(KEPT))
def test_other_pads_stay(case: str):
    model = seeded(KEPT[case]())
    c_in = model.conv.in_channels - (1 if case == "channels" else 0)
    x = torch.randn(2, c_in, 13, 11)
    opt = fuser.optimize(model, (x,), backend="torch", precision="ieee")
    assert len(opt.fusion_report.fused) == 1
    assert not [r for r in opt.fusion_report.rewrites if r.kind == "zero_pad"], str(opt.fusion_report)
    with torch.no_grad():
        assert_close(opt(x), reference64(model, x), "ieee", case)


class PaddedTwice(nn.Module):
    """The same pad's output read by a conv and by an add: the pad is computed anyway."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(5, 5, 3, 1, padding=0, bias=False)
        self.bn = nn.BatchNorm2d(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = F.pad(x, [1, 1, 1, 1])
        return F.relu(self.bn(self.conv(p))) + p[:, :, 1:-1, 1:-1]


def test_a_pad_read_twice_stays():
    model = seeded(PaddedTwice())
    x = torch.randn(2, 5, 13, 11)
    opt = fuser.optimize(model, (x,), backend="torch", precision="ieee")
    assert len(opt.fusion_report.fused) == 1
    assert not [r for r in opt.fusion_report.rewrites if r.kind == "zero_pad"]
    with torch.no_grad():
        assert_close(opt(x), reference64(model, x), "ieee")
