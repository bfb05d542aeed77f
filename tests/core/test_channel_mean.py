"""Global average pools as one Triton NHWC reduction: the kernel (interpreter) against float64 and bit for
bit run to run, whatever the pixel split; the pass rewrites every spelling of the pool, leaves other means
alone, and the result exports to standard ONNX and compiles to one frame."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from accuracy import assert_close, reference64
from export_checks import compile_once, exported_standard, run_onnxruntime
from torch import nn

import fuser
from fuser.kernels.channel_mean import channel_mean_plan, splits_for
from fuser.onnx.exporter import export_onnx
from fuser.rewrite.channel_mean import FusedChannelMean, MeanForm

SHAPES = [(3, 19, 9, 11), (1, 37, 23, 21), (2, 70, 5, 3), (2, 5, 1, 1)]


@pytest.mark.parametrize("channels_last", [True, False], ids=["nhwc", "nchw"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_mean_matches_float64_for_every_split(shape: tuple[int, ...], channels_last: bool) -> None:
    x = torch.randn(shape) + 0.5  # a non-zero mean: a missing or doubled pixel shows
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    ref = x.double().mean((2, 3), keepdim=True)
    for splits in (None, 1, 2, 5):
        run = channel_mean_plan(x, interpret=True, splits=splits)
        out = run(x)
        assert out.shape == ref.shape and out.dtype == x.dtype
        assert_close(out, ref, "ieee", f"splits={splits}")
        assert torch.equal(run(x), out), "not deterministic"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_mean_of_16_bit_inputs_sums_in_float32(dtype: torch.dtype) -> None:
    x = (torch.randn(2, 19, 13, 11) + 1).to(dtype).to(memory_format=torch.channels_last)
    out = channel_mean_plan(x, interpret=True, splits=2)(x)
    assert out.dtype == dtype
    assert_close(out, x.double().mean((2, 3), keepdim=True), "bf16")


def test_split_count_fills_the_gpu_at_batch_1_and_not_beyond_the_pixels() -> None:
    assert splits_for(1, 2, 112 * 112, 32) > 1
    assert splits_for(1, 2, 7 * 7, 32) == 1
    assert splits_for(64, 20, 56 * 56, 32) == 1


def test_kernel_refuses_bad_inputs_by_name() -> None:
    with pytest.raises(ValueError, match=r"4-D \[N, C, H, W\].*\(19, 9, 11\)"):
        channel_mean_plan(torch.randn(19, 9, 11), interpret=True)
    with pytest.raises(TypeError, match=r"float32, float16 or bfloat16, got torch\.int64"):
        channel_mean_plan(torch.ones(1, 3, 4, 4, dtype=torch.long), interpret=True)
    with pytest.raises(ValueError, match="interpret=False runs on cuda tensors"):
        channel_mean_plan(torch.randn(1, 3, 4, 4))


class Pools(nn.Module):
    """Every spelling of the spatial mean, and two means that are something else."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(5, 19, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d((1, 1))
        self.pool2 = nn.AdaptiveAvgPool2d(2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = F.relu(self.conv(x))
        spatial = (
            y.mean((2, 3), keepdim=True),
            torch.mean(y, dim=[-2, -1]),
            F.adaptive_avg_pool2d(y, 1),
            self.pool(y),
        )
        others = (y.mean((1, 2)), self.pool2(y), y.mean((2, 3), dtype=torch.float64))
        return spatial + others


@pytest.mark.parametrize("backend", ["torch", "interpret"])
def test_every_spatial_mean_is_rewritten_and_right(backend: str) -> None:
    model, x = Pools().eval(), torch.randn(3, 5, 11, 9)
    fast = fuser.optimize(model, (x,), precision="ieee", backend=backend)
    rewritten = [r for r in fast.fusion_report.rewrites if r.kind == "channel_mean"]
    assert len(rewritten) == 4, str(fast.fusion_report)
    assert sum(isinstance(m, FusedChannelMean) for m in fast.modules()) == 4
    assert "channel_mean" in str(fast.fusion_report)
    with torch.no_grad():
        got, want = fast(x), reference64(model, x)
    for i, (g, r) in enumerate(zip(got, want, strict=True)):
        assert g.shape == r.shape, f"output {i}: {tuple(g.shape)} vs {tuple(r.shape)}"
        assert_close(g, r, "ieee", f"output {i}")
    assert got[-1].dtype == torch.float64


def test_without_shapes_a_negative_dim_mean_is_left_alone() -> None:
    """``x.mean((-2, -1))`` is a spatial mean only of a 4-D tensor: without example inputs it stays."""

    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.mean((-2, -1)) + x.mean((2, 3))

    fast = fuser.optimize(M(), backend="interpret")
    assert [r.detail for r in fast.fusion_report.rewrites].count(
        "mean over H, W: one NHWC reduction kernel (split over pixels)"
    ) == 1
    x = torch.randn(2, 7, 5, 3)
    with torch.no_grad():
        assert_close(fast(x), reference64(M(), x), "ieee")


def test_exports_standard_onnx_and_compiles_to_one_frame(tmp_path: Path) -> None:
    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(5, 19, 3, padding=1)
            self.fc = nn.Linear(19, 7)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(F.adaptive_avg_pool2d(F.silu(self.conv(x)), 1).flatten(1))

    model, x = Head().eval(), torch.randn(2, 5, 9, 11)
    fast = fuser.optimize(model, (x,), precision="ieee", backend="torch")
    assert any(r.kind == "channel_mean" for r in fast.fusion_report.rewrites)
    path = export_onnx(fast, (x,), tmp_path / "head.onnx")
    exported_standard(path)
    x3 = torch.randn(3, 5, 9, 11)
    (got,) = run_onnxruntime(path, x3)
    assert_close(got, reference64(model, x3), "ieee", "onnxruntime")

    out = compile_once(fast, x)
    assert_close(out, reference64(model, x), "ieee")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 32, 112, 112), (1, 96, 56, 56), (1, 1152, 7, 7), (3, 19, 13, 11)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_mean_matches_float64_and_is_deterministic(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = (torch.randn(shape, device="cuda") + 0.5).to(dtype).to(memory_format=torch.channels_last)
    run = channel_mean_plan(x)
    out = run(x)
    assert_close(out, x.double().mean((2, 3), keepdim=True), "ieee" if dtype == torch.float32 else "bf16")
    assert all(torch.equal(run(x), out) for _ in range(5))


@pytest.mark.gpu
def test_gpu_module_runs_the_kernel_on_nhwc_and_torch_on_nchw() -> None:
    module = FusedChannelMean(MeanForm((2, 3), True))
    x = torch.randn(1, 40, 28, 28, device="cuda")
    for t in (x, x.to(memory_format=torch.channels_last)):
        assert_close(module(t), t.double().mean((2, 3), keepdim=True), "ieee")
    assert module._interpreted(x) is None and module._interpreted(x.to(memory_format=torch.channels_last)) is False
