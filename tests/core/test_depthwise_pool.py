"""Squeeze-excitation's pool summed by the depthwise conv: the kernel (interpreter) writes the conv's output
and its mean over (H, W) against float64 on odd shapes (13x11 images, 37 channels, batch 3, stride 2, 3x3 and
5x5), with one or several pixel tiles per image, bit for bit run to run; the pass fuses every SE pool of an
MBConv model (torchvision's SE block, a mean without keepdim, the bundled EfficientNet), leaves a mean of a
non-depthwise conv alone, keeps call k's outputs after call k+1, exports standard ONNX and compiles to one
frame."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from accuracy import assert_close, randomize_batchnorm, reference64
from export_checks import compile_once, onnx_matches_float64
from torch import nn

import fuser
from fuser.activations import Activation
from fuser.diagnose import layer_errors
from fuser.kernels import conv2d_act, pack_conv_weight
from fuser.kernels.channel_mean import add_splits
from fuser.kernels.depthwise import depthwise_candidates
from fuser.kernels.epilogue import Epilogue
from fuser.kernels.tile_config import TileConfig
from fuser.models.efficientnet import efficientnet_b0
from fuser.rewrite.depthwise_pool import PooledDepthwise

# (kernel, stride): 13x11 images give 13x11 or 7x6 outputs, one 143-row or 42-row pixel range per image
LAYERS = [(3, 1), (3, 2), (5, 1), (5, 2)]
# the interpreter's default tile (128 rows: two tiles per image at stride 1, one at stride 2) and a GPU
# candidate with 16-row tiles (several per image, the last one partly idle)
TILES = [None, TileConfig(16, 64, 1, 1, 4, 1)]
SILU = Epilogue(Activation.SILU)


def _depthwise(n: int, c: int, k: int, stride: int, dtype: torch.dtype, device: str = "cpu") -> tuple:
    x = (torch.randn(n, c, 13, 11, device=device) + 0.3).to(dtype).to(memory_format=torch.channels_last)
    w = (torch.randn(c, 1, k, k, device=device) / k).to(dtype)
    b = torch.randn(c, device=device)
    ref = F.silu(F.conv2d(x.double(), w.double(), b.double(), stride, k // 2, 1, c))
    return x, w, b, ref


def _run(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, stride: int, tile: TileConfig | None, **kw) -> tuple:
    c, k = w.shape[0], w.shape[2]
    pool = torch.empty(x.shape[0], c, dtype=x.dtype, device=x.device)
    packed = pack_conv_weight(w, "ieee", groups=c)
    y = conv2d_act(x, packed, b, stride=stride, padding=k // 2, epilogue=SILU, tile=tile, pool=pool, **kw)
    return y, pool


@pytest.mark.parametrize("tile", TILES, ids=["default-tile", "16x64"])
@pytest.mark.parametrize(("k", "stride"), LAYERS, ids=lambda v: str(v))
def test_kernel_writes_the_output_and_its_mean(k: int, stride: int, tile: TileConfig | None) -> None:
    x, w, b, ref = _depthwise(3, 37, k, stride, torch.float32)
    y, pool = _run(x, w, b, stride, tile, interpret=True)
    assert_close(y, ref, "ieee", "conv output")
    assert pool.shape == (3, 37)
    assert_close(pool, ref.mean((2, 3)), "ieee", "mean")
    again = _run(x, w, b, stride, tile, interpret=True)
    assert torch.equal(again[0], y) and torch.equal(again[1], pool), "not deterministic"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_mean_of_16_bit_outputs_sums_in_float32(dtype: torch.dtype) -> None:
    x, w, b, ref = _depthwise(3, 21, 5, 2, dtype)
    y, pool = _run(x, w, b, 2, TILES[1], interpret=True)
    assert pool.dtype == dtype
    assert_close(y, ref, "bf16", "conv output")
    assert_close(pool, ref.mean((2, 3)), "bf16", "mean")
    # one rounding to the dtype: the sums did not run in 16 bits
    stored = y.double().mean((2, 3))
    assert ((pool.double() - stored).abs() <= torch.finfo(dtype).eps * stored.abs() + 1e-6).all()


@pytest.mark.parametrize("splits", [1, 5, 71], ids=lambda s: f"{s}-splits")
def test_add_splits_sums_every_split_in_a_fixed_order(splits: int) -> None:
    """The pool's second step over more splits than one step reads (a 112x112 layer has hundreds)."""
    part = torch.randn(3, splits, 37) + 0.5
    out = torch.empty(3, 37)
    add_splits(part, out, 999, interpret=True)
    assert_close(out, part.double().sum(1) / 999, "ieee")
    again = torch.empty(3, 37)
    add_splits(part, again, 999, interpret=True)
    assert torch.equal(again, out)


def test_kernel_refuses_a_pool_it_cannot_write_by_name() -> None:
    x = torch.randn(3, 12, 9, 7).to(memory_format=torch.channels_last)
    grouped = pack_conv_weight(torch.randn(12, 4, 3, 3), "ieee", groups=3)
    with pytest.raises(ValueError, match="depthwise kernel only, not the direct conv"):
        conv2d_act(x, grouped, padding=1, interpret=True, pool=torch.empty(3, 12))
    depthwise = pack_conv_weight(torch.randn(12, 1, 3, 3), "ieee", groups=12)
    with pytest.raises(ValueError, match=r"pool must be a \[3, 12\] tensor of torch.float32"):
        conv2d_act(x, depthwise, padding=1, interpret=True, pool=torch.empty(3, 12, 1, 1))
    with pytest.raises(ValueError, match="pool must be contiguous"):
        conv2d_act(x, depthwise, padding=1, interpret=True, pool=torch.empty(12, 3).t())


class TorchvisionSE(nn.Module):
    """torchvision.ops.SqueezeExcitation: an AdaptiveAvgPool2d module, two 1x1 convs, SiLU and sigmoid."""

    def __init__(self, channels: int, squeeze: int) -> None:
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, channels, 1)
        self.activation, self.scale_activation = nn.SiLU(), nn.Sigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x)))))


class LinearSE(nn.Module):
    """An SE block that pools without keepdim and excites through linears (timm-like)."""

    def __init__(self, channels: int, squeeze: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(channels, squeeze), nn.Linear(squeeze, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.sigmoid(self.fc2(F.silu(self.fc1(x.mean((2, 3))))))
        return x * s[:, :, None, None]


def _conv_bn(c_in: int, c_out: int, k: int = 1, stride: int = 1, groups: int = 1, act: bool = True) -> nn.Sequential:
    layers = [nn.Conv2d(c_in, c_out, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(c_out)]
    return nn.Sequential(*layers, *([nn.SiLU()] if act else []))


class MBConvNet(nn.Module):
    """Two MBConv blocks (expand, depthwise 5x5 stride 2 / 3x3, SE, project) and a head whose pool reads a
    grouped, non-depthwise conv: three spatial means, two of them of a depthwise conv's output."""

    def __init__(self) -> None:
        super().__init__()
        self.block1 = nn.Sequential(
            _conv_bn(5, 37), _conv_bn(37, 37, 5, 2, groups=37), TorchvisionSE(37, 7), _conv_bn(37, 19, act=False)
        )
        self.block2 = nn.Sequential(
            _conv_bn(19, 45), _conv_bn(45, 45, 3, groups=45), LinearSE(45, 11), _conv_bn(45, 19, act=False)
        )
        self.head = _conv_bn(19, 21, 3, groups=1)
        self.fc = nn.Linear(21, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block1(x)
        y = y + self.block2(y)
        return self.fc(F.adaptive_avg_pool2d(self.head(y), 1).flatten(1))


def _model() -> MBConvNet:
    torch.manual_seed(0)
    return randomize_batchnorm(MBConvNet()).eval()


def _pooled(fast: nn.Module) -> list:
    return [r for r in fast.fusion_report.rewrites if r.kind == "depthwise_pool"]


@pytest.mark.parametrize("backend", ["torch", "interpret"])
def test_every_se_pool_of_a_depthwise_conv_is_fused_and_right(backend: str) -> None:
    model, x = _model(), torch.randn(3, 5, 27, 21)
    fast = fuser.optimize(model, (x,), precision="ieee", backend=backend)
    fused = _pooled(fast)
    assert len(fused) == 2 and sum(isinstance(m, PooledDepthwise) for m in fast.modules()) == 2, fast.fusion_report
    assert all(r.eliminated for r in fused) and "depthwise_pool" in str(fast.fusion_report)
    assert {r.location for r in fused} == {"block1.2.avgpool", "block2.2"}, [r.location for r in fused]
    with torch.no_grad():
        first = fast(x)
        kept = first.clone()
        second = fast(torch.randn(3, 5, 27, 21))
    assert_close(first, reference64(model, x), "ieee", backend)
    assert torch.equal(first, kept), "call k's output changed by call k+1"
    assert not torch.equal(second, first)


def test_verify_and_diagnose_still_compare_the_paired_depthwise_convs() -> None:
    model, x = _model(), torch.randn(3, 5, 27, 21)
    fast = fuser.optimize(model, (x,), precision="ieee", backend="interpret")
    result = fuser.verify(model, fast, (x,))
    assert result.ok and not result.notes, str(result)
    names = [c.name for c in result.layers]
    assert len(names) == len(fast.fusion_report.fused) and sum(n.endswith(".conv") for n in names) == 2, names
    assert all(c.rel_error < 1e-5 for c in result.layers), str(result)
    errors = layer_errors(fast, x)
    assert sum(e.name.endswith(".conv") for e in errors) == 2 and all(e.rel_error < 1e-5 for e in errors)


def test_efficientnet_every_se_pool_is_summed_by_its_depthwise_conv() -> None:
    model = efficientnet_b0(width_mult=0.25, depth_mult=0.25, num_classes=11, calibration_size=48)
    x = torch.randn(3, 3, 35, 33)
    fast = fuser.optimize(copy.deepcopy(model), (x,), precision="ieee", backend="interpret")
    blocks = sum(1 for name, _ in model.named_modules() if name.endswith(".se"))
    assert len(_pooled(fast)) == blocks > 0, str(fast.fusion_report)
    with torch.no_grad():
        out, ref = fast(x), reference64(model, x)
    assert_close(out, ref, "ieee")
    assert torch.equal(out.argmax(1), ref.argmax(1))


def test_a_mean_of_a_depthwise_conv_with_other_inputs_or_of_another_conv_stays() -> None:
    class Means(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dw = nn.Conv2d(6, 6, 3, padding=1, groups=6)
            self.full = nn.Conv2d(6, 6, 3, padding=1)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            a = self.dw(x) + x  # the residual add in the epilogue: the conv takes a second input
            return a.mean((2, 3)), self.full(x).mean((2, 3), keepdim=True)

    model, x = Means().eval(), torch.randn(2, 6, 9, 7)
    fast = fuser.optimize(model, (x,), precision="ieee", backend="interpret")
    assert not _pooled(fast), str(fast.fusion_report)
    with torch.no_grad():
        for got, want in zip(fast(x), reference64(model, x), strict=True):
            assert_close(got, want, "ieee")


def test_exports_standard_onnx_and_compiles_to_one_frame(tmp_path: Path) -> None:
    model, x = _model(), torch.randn(2, 5, 27, 21)
    fast = fuser.optimize(model, (x,), precision="ieee", backend="torch")
    assert len(_pooled(fast)) == 2
    ops = onnx_matches_float64(fast, model, x, torch.randn(3, 5, 27, 21), tmp_path / "mbconv.onnx")
    assert "ReduceMean" in ops or "GlobalAveragePool" in ops, ops
    assert_close(compile_once(fast, x), reference64(model, x), "ieee", "torch.compile")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("k", "stride"), LAYERS, ids=lambda v: str(v))
def test_gpu_kernel_writes_the_output_and_its_mean_for_every_tile(k: int, stride: int, dtype: torch.dtype) -> None:
    x, w, b, ref = _depthwise(3, 37, k, stride, dtype, "cuda")
    tolerance = "ieee" if dtype == torch.float32 else "bf16"
    for tile in depthwise_candidates(37, ref.shape[0] * ref.shape[2] * ref.shape[3]):
        y, pool = _run(x, w, b, stride, tile)
        assert_close(y, ref, tolerance, f"conv output, {tile}")
        assert_close(pool, ref.mean((2, 3)), tolerance, f"mean, {tile}")
        assert all(torch.equal(_run(x, w, b, stride, tile)[1], pool) for _ in range(3)), "not deterministic"


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 96, 112, 112, 3, 2), (32, 240, 28, 28, 5, 1), (32, 1152, 7, 7, 5, 1)], ids=str)
def test_gpu_kernel_on_efficientnet_layers(shape: tuple[int, ...]) -> None:
    n, c, h, w_, k, stride = shape
    x = torch.randn(n, c, h, w_, device="cuda").half().to(memory_format=torch.channels_last)
    w, b = (torch.randn(c, 1, k, k, device="cuda") / k).half(), torch.randn(c, device="cuda")
    ref = F.silu(F.conv2d(x.double(), w.double(), b.double(), stride, k // 2, 1, c))
    y, pool = _run(x, w, b, stride, None)
    assert_close(y, ref, "bf16", "conv output")
    assert_close(pool, ref.mean((2, 3)), "bf16", "mean")


@pytest.mark.gpu
def test_gpu_model_fuses_the_pools_and_matches_float64() -> None:
    model, x = _model(), torch.randn(3, 5, 27, 21)
    fast = fuser.optimize(copy.deepcopy(model).cuda(), (x.cuda(),), precision="ieee")
    assert len(_pooled(fast)) == 2
    with torch.no_grad():
        first = fast(x.cuda())
        kept = first.clone()
        fast(torch.randn(3, 5, 27, 21, device="cuda"))
    assert_close(first, reference64(model, x), "ieee")
    assert torch.equal(first, kept), "call k's output changed by call k+1"
