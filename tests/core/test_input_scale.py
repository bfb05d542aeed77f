"""The channel-scale prologue: ``conv(x * s)`` (s [N, C, 1, 1], squeeze-excitation) as one fused conv.

Kernels (Triton interpreter): every kernel with the operand prologue against float64, per-image and broadcast
scales, odd channel counts, batch 2-3. Graph pass: it folds ``x * s`` / ``s * x`` into the conv that reads
it, names the fusion in the report, leaves the near misses (a product with other users, a full-size multiply,
no example inputs) unfused and correct, exports standard ONNX that matches onnxruntime, and composes with
torch.compile; a model-level test on the bundled EfficientNet.
"""

from __future__ import annotations

import copy
import operator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from accuracy import assert_close, randomize_batchnorm, reference64
from export_checks import compile_once, exported_standard, run_onnxruntime
from torch import nn

import fuser
from fuser.kernels import conv2d_act, gemm_act, pack_conv_weight, pack_gemm_weight
from fuser.kernels.tile_config import TileConfig
from fuser.lower.fused_modules import FusedConv2d
from fuser.models.efficientnet import efficientnet_b0
from fuser.onnx.exporter import export_onnx

# (C_in, C_out, kernel, stride, padding, groups): the 1x1 GEMM, the implicit GEMM over channel blocks and
# over flat K and over filter rows (strided), a grouped one, the depthwise kernel
CONVS = {
    "gemm_1x1": (19, 13, 1, 1, 0, 1),
    "implicit_3x3": (21, 11, 3, 1, 1, 1),
    "implicit_flat_k": (5, 9, 3, 2, 1, 1),  # filter rows of 15 weights: flat K
    "implicit_rows": (7, 9, 3, 2, 1, 1),  # rows of 21: one K step per filter row
    "grouped": (18, 12, 3, 1, 1, 3),
    "depthwise": (19, 19, 3, 1, 1, 19),
}


def _scale(batch: int, channels: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.rand(batch, channels, 1, 1) + 0.25).to(dtype)  # not all near 1: a missing multiply shows


@pytest.mark.parametrize("per_image", [True, False], ids=["s_NC11", "s_1C11"])
@pytest.mark.parametrize("name", list(CONVS))
def test_kernels_scale_the_operand_as_they_load_it(name: str, per_image: bool) -> None:
    c_in, c_out, k, stride, pad, groups = CONVS[name]
    n = 3
    x = torch.randn(n, c_in, 11, 9).to(memory_format=torch.channels_last)
    w, b = torch.randn(c_out, c_in // groups, k, k), torch.randn(c_out)
    s = _scale(n if per_image else 1, c_in)
    ref = F.conv2d(x.double() * s.double(), w.double(), b.double(), stride, pad, 1, groups)
    packed = pack_conv_weight(w, "ieee", groups=groups)
    out = conv2d_act(x, packed, b, stride=stride, padding=pad, interpret=True, input_scale=s)
    assert_close(out, ref, "ieee", name)
    unscaled = conv2d_act(x, packed, b, stride=stride, padding=pad, interpret=True)
    assert (out - unscaled).abs().max() > 1e-2  # the same plan cache, another plan: the scale is not dropped


def test_split_k_and_nchw_input_keep_the_scale() -> None:
    n, c_in, c_out = 2, 45, 13
    x = torch.randn(n, c_in, 5, 7)  # NCHW: channels 35 apart
    w, s = torch.randn(c_out, c_in, 1, 1), _scale(n, c_in)
    ref = F.conv2d(x.double() * s.double(), w.double())
    for tile in (TileConfig(32, 32, 16, 1, 4, 1, split_k=3), None):
        out = conv2d_act(x, pack_conv_weight(w, "ieee"), interpret=True, input_scale=s, tile=tile)
        assert_close(out, ref, "ieee", f"tile {tile}")


def test_gemm_act_takes_a_per_batch_k_scale() -> None:
    a, w = torch.randn(3, 5, 19), torch.randn(7, 19)
    s = torch.rand(3, 19) + 0.25
    out = gemm_act(a, pack_gemm_weight(w, "ieee"), interpret=True, input_scale=s)
    assert_close(out, (a.double() * s.double()[:, None]) @ w.double().T, "ieee")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_scale_rounds_like_the_product_in_the_model_dtype(dtype: torch.dtype) -> None:
    x = torch.randn(2, 19, 7, 7).to(dtype)
    w, s = torch.randn(11, 19, 1, 1).to(dtype), _scale(2, 19, dtype)
    ref = F.conv2d((x * s).double(), w.double())  # x * s in the model's dtype, as the eager model rounds it
    assert_close(conv2d_act(x, pack_conv_weight(w, "ieee"), interpret=True, input_scale=s), ref, "bf16")


def test_bad_scales_are_refused_by_name() -> None:
    x, w = torch.randn(2, 19, 7, 7), pack_conv_weight(torch.randn(11, 19, 1, 1), "ieee")
    with pytest.raises(ValueError, match=r"input_scale must have shape \[2 or 1, 19, 1, 1\].*\(2, 19, 7, 7\)"):
        conv2d_act(x, w, interpret=True, input_scale=torch.rand(2, 19, 7, 7))
    with pytest.raises(ValueError, match=r"input_scale is torch\.float64 but x is torch\.float32"):
        conv2d_act(x, w, interpret=True, input_scale=torch.rand(2, 19, 1, 1, dtype=torch.float64))
    rgb = pack_conv_weight(torch.randn(8, 3, 3, 3), "ieee")
    with pytest.raises(ValueError, match="not supported by the direct conv kernel"):
        conv2d_act(torch.randn(1, 3, 9, 9), rgb, interpret=True, input_scale=torch.rand(1, 3, 1, 1))


# ---------------------------------------------------------------------------------------------------------
# The graph pass


class SE(nn.Module):
    """conv-BN-SiLU -> squeeze-excitation -> ``x * s`` -> a projection conv (1x1 or 3x3) with BN."""

    def __init__(self, c: int = 19, squeeze: int = 5, project_k: int = 1, order: str = "xs") -> None:
        super().__init__()
        self.conv = nn.Conv2d(6, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)
        self.fc1, self.fc2 = nn.Conv2d(c, squeeze, 1), nn.Conv2d(squeeze, c, 1)
        self.project = nn.Conv2d(c, 13, project_k, padding=project_k // 2, bias=False)
        self.bn2 = nn.BatchNorm2d(13)
        self.order = order

    def excite(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.fc2(F.silu(self.fc1(F.adaptive_avg_pool2d(x, 1)))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.silu(self.bn(self.conv(x)))
        s = self.excite(x)
        y = x * s if self.order == "xs" else s * x
        return self.bn2(self.project(y))


def _se(**kwargs) -> nn.Module:
    return randomize_batchnorm(SE(**kwargs)).eval()


def _muls(fast: nn.Module) -> int:
    """Multiplies of two tensors left in the optimized module's graphs."""
    graphs = [m.graph for m in fast.modules() if isinstance(m, torch.fx.GraphModule)]
    return sum(1 for g in graphs for n in g.nodes if n.target in (operator.mul, torch.mul, "mul"))


def _kinds(fast: nn.Module, kind: str) -> list:
    return [r for r in fast.fusion_report.rewrites if r.kind == kind]


@pytest.mark.parametrize("backend", ["torch", "interpret"])
@pytest.mark.parametrize(("project_k", "order"), [(1, "xs"), (1, "sx"), (3, "xs")])
def test_the_multiply_is_folded_into_the_projection_conv(backend: str, project_k: int, order: str) -> None:
    model = _se(project_k=project_k, order=order)
    x = torch.randn(3, 6, 11, 13)
    fast = fuser.optimize(model, (x,), precision="ieee", backend=backend)
    (folded,) = _kinds(fast, "input_scale")
    assert "conv(x * s)" in folded.detail and len(folded.eliminated) == 1, str(fast.fusion_report)
    assert "input_scale" in str(fast.fusion_report) and "Also fused" in str(fast.fusion_report)
    assert _muls(fast) == 0, "the product is still computed"
    with torch.no_grad():
        assert_close(fast(x), reference64(model, x), "ieee", backend)
        x2 = torch.randn(2, 6, 9, 7)  # another batch and size than the example: the same module serves it
        assert_close(fast(x2), reference64(model, x2), "ieee", f"{backend}, second shape")
    assert not any(isinstance(m, FusedConv2d) for m in model.modules())  # the user's model is not modified


class BroadcastScale(nn.Module):
    """``x * p`` with a learned ``p`` of shape [1, C, 1, 1] (one factor per channel for every image)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(5, 19, 3, padding=1)
        self.p = nn.Parameter(torch.rand(1, 19, 1, 1) + 0.25)
        self.project = nn.Conv2d(19, 11, 1, bias=False)
        self.bn = nn.BatchNorm2d(11)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.project(F.relu(self.conv(x)) * self.p))


@pytest.mark.parametrize("backend", ["torch", "interpret"])
def test_a_broadcast_scale_1c11_is_folded_and_right(backend: str) -> None:
    model, x = randomize_batchnorm(BroadcastScale()).eval(), torch.randn(3, 5, 9, 11)
    fast = fuser.optimize(model, (x,), precision="ieee", backend=backend)
    assert len(_kinds(fast, "input_scale")) == 1, str(fast.fusion_report)
    with torch.no_grad():
        assert_close(fast(x), reference64(model, x), "ieee", backend)


class ProductUsedTwice(SE):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.silu(self.bn(self.conv(x)))
        y = x * self.excite(x)
        return self.bn2(self.project(y)), y.mean()


class ScaleUsedTwice(SE):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.silu(self.bn(self.conv(x)))
        s = self.excite(x)
        return self.bn2(self.project(x * s)), s.flatten(1)


class FullSizeProduct(SE):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.silu(self.bn(self.conv(x)))
        return self.bn2(self.project(x * torch.sigmoid(x)[:, :, :, :]))  # gate of x's full size


@pytest.mark.parametrize("backend", ["torch", "interpret"])
def test_near_misses_stay_unfused_and_right(backend: str) -> None:
    x = torch.randn(2, 6, 9, 11)
    for cls, folded, kept in ((ProductUsedTwice, 0, "other users"), (ScaleUsedTwice, 1, None),
                              (FullSizeProduct, 0, "not a per-(image, channel) scale")):  # fmt: skip
        model = randomize_batchnorm(cls()).eval()
        fast = fuser.optimize(model, (x,), precision="ieee", backend=backend)
        report = str(fast.fusion_report)
        assert len(_kinds(fast, "input_scale")) == folded, f"{cls.__name__}:\n{report}"
        if kept is not None:
            (near,) = _kinds(fast, "input_scale_kept")
            assert kept in near.detail and not near.eliminated, f"{cls.__name__}:\n{report}"
        with torch.no_grad():
            got, want = fast(x), reference64(model, x)
        for g, r in zip(got, want, strict=True):
            assert_close(g, r, "ieee", cls.__name__)


def test_without_example_inputs_the_multiply_stays_and_says_why() -> None:
    model = _se()
    fast = fuser.optimize(model, precision="ieee", backend="torch")
    assert not _kinds(fast, "input_scale")
    (near,) = _kinds(fast, "input_scale_kept")
    assert "shapes are unknown" in near.detail
    x = torch.randn(2, 6, 9, 11)
    with torch.no_grad():
        assert_close(fast(x), reference64(model, x), "ieee")


def test_a_scale_at_another_runtime_shape_falls_back_to_the_reference() -> None:
    """The module was built for an [N, C, 1, 1] scale; called directly with a full-size one, it multiplies
    first (the reference) rather than reading the wrong factors."""
    model, x = _se(), torch.randn(2, 6, 9, 11)
    fast = fuser.optimize(model, (x,), precision="ieee", backend="interpret")
    conv = next(m for m in fast.modules() if isinstance(m, FusedConv2d) and m.weight.shape[0] == 13)
    h = torch.randn(2, 19, 9, 11)
    full = torch.rand(2, 19, 9, 11)
    with torch.no_grad():
        got = conv(h, input_scale=full)
        want = conv2d_ref(conv, h * full)
    assert_close(got, want, "ieee")


def conv2d_ref(conv: FusedConv2d, x: torch.Tensor) -> torch.Tensor:
    w = conv.weight.double()
    b = None if conv.bias is None else conv.bias.double()
    return F.conv2d(x.double(), w, b, conv.stride, conv.padding[::2], conv.dilation, conv.groups)


def test_onnx_export_is_mul_and_conv_and_matches_onnxruntime(tmp_path: Path) -> None:
    model, x = _se(), torch.randn(2, 6, 9, 11)
    fast = fuser.optimize(model, (x,), precision="ieee", backend="torch")
    assert _kinds(fast, "input_scale")
    path = export_onnx(fast, (x,), tmp_path / "se.onnx")
    ops = [n.op_type for n in exported_standard(path).graph.node]
    assert "Mul" in ops and "Conv" in ops, ops
    x3 = torch.randn(3, 6, 9, 11)
    (got,) = run_onnxruntime(path, x3)
    assert_close(got, reference64(model, x3), "ieee", "onnxruntime")


def test_torch_compile_sees_one_opaque_op_with_the_scale() -> None:
    model, x = _se(), torch.randn(2, 6, 9, 11)
    fast = fuser.optimize(model, (x,), precision="ieee", backend="torch")
    out = compile_once(fast, x)
    assert_close(out, reference64(model, x), "ieee")


def test_opcheck_of_the_op_with_a_scale() -> None:
    fast = fuser.optimize(_se(), (torch.randn(2, 6, 9, 11),), precision="ieee", backend="torch")
    conv = next(m for m in fast.modules() if isinstance(m, FusedConv2d) and m.weight.shape[0] == 13)
    h, s = torch.randn(2, 19, 9, 11), torch.rand(2, 19, 1, 1)
    args = (h, conv.weight, conv.bias, None, conv.packed, *conv._op_args, s)
    torch.library.opcheck(torch.ops.fuser.conv2d_act.default, args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("backend", ["torch", "interpret"])
def test_efficientnet_every_se_scale_is_folded(backend: str) -> None:
    model = efficientnet_b0(width_mult=0.25, depth_mult=0.25, num_classes=11, calibration_size=48)
    x = torch.randn(2, 3, 35, 33)
    fast = fuser.optimize(copy.deepcopy(model), (x,), precision="ieee", backend=backend)
    blocks = sum(1 for name, _ in model.named_modules() if name.endswith(".se"))
    assert len(_kinds(fast, "input_scale")) == blocks > 0, str(fast.fusion_report)
    assert not _kinds(fast, "input_scale_kept")
    assert len(_kinds(fast, "channel_mean")) == blocks + 1  # every SE pool and the head's
    with torch.no_grad():
        out, ref = fast(x), reference64(model, x)
    assert_close(out, ref, "ieee", backend)
    assert torch.equal(out.argmax(1), ref.argmax(1))


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["auto", "pointer"])
@pytest.mark.parametrize("name", list(CONVS))
def test_gpu_kernels_scale_the_operand(name: str, path: str) -> None:
    c_in, c_out, k, stride, pad, groups = CONVS[name]
    c_in, c_out = 4 * c_in, 4 * c_out  # 16-byte rows: the descriptor path too
    groups = c_in if name == "depthwise" else groups
    x = torch.randn(3, c_in, 13, 11, device="cuda").to(memory_format=torch.channels_last)
    w, b = torch.randn(c_out, c_in // groups, k, k, device="cuda"), torch.randn(c_out, device="cuda")
    s = _scale(3, c_in).cuda()
    ref = F.conv2d(x.double() * s.double(), w.double(), b.double(), stride, pad, 1, groups)
    out = conv2d_act(x, pack_conv_weight(w, "tf32", groups=groups), b, stride=stride, padding=pad,
                     input_scale=s, path=path)  # fmt: skip
    assert_close(out, ref, "tf32", f"{name} {path}")


@pytest.mark.gpu
def test_gpu_efficientnet_folds_every_se_scale() -> None:
    model = efficientnet_b0(width_mult=0.5, depth_mult=0.5, num_classes=11, calibration_size=64).cuda()
    x = torch.randn(2, 3, 67, 65, device="cuda")
    fast = fuser.optimize(copy.deepcopy(model), (x,), precision="tf32")
    assert _kinds(fast, "input_scale") and not _kinds(fast, "input_scale_kept"), str(fast.fusion_report)
    with torch.no_grad():
        for _ in range(2):  # the second call replays the CUDA graph
            out = fast(x)
    assert_close(out, reference64(model, x), "tf32")
