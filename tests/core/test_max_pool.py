"""Max pools as fuser's NHWC kernel: the kernel (interpreter) equals ``F.max_pool2d`` bit for bit on odd
shapes and windows; the pass rewrites module and functional pools it can compute and leaves the rest
(indices, ceil mode, dilation) alone; the result exports to standard ONNX and compiles to one frame."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from accuracy import assert_close, reference64
from export_checks import compile_once, exported_standard, run_onnxruntime
from torch import nn

import fuser
from fuser.kernels.max_pool import max_pool2d_plan
from fuser.onnx.exporter import export_onnx
from fuser.rewrite.max_pool import FusedMaxPool2d

# (shape, kernel_size, stride, padding): ResNet's stem pool, VGG's 2x2, a stride-1 window, uneven windows.
CASES = [
    ((2, 37, 23, 21), 3, 2, 1),
    ((1, 64, 17, 19), 2, 2, 0),
    ((3, 19, 9, 11), 3, 1, 1),
    ((2, 53, 13, 10), (3, 2), (2, 1), (1, 0)),
    ((1, 5, 7, 7), 5, 3, 2),
]


def _nhwc(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    # Distinct values with a negative offset: a window that read padding as 0 would show.
    x = torch.randn(shape, device=device) - 3.0
    return x.to(dtype).to(memory_format=torch.channels_last)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize(("shape", "k", "s", "p"), CASES, ids=str)
def test_kernel_equals_torch_bit_for_bit(shape, k, s, p, dtype: torch.dtype) -> None:
    x = _nhwc(shape, dtype)
    out = max_pool2d_plan(x, k, s, p, interpret=True)(x)
    want = F.max_pool2d(x, k, s, p)
    assert out.shape == want.shape and out.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(out, want)


def test_kernel_refuses_what_it_does_not_compute_by_name() -> None:
    with pytest.raises(ValueError, match="not channels_last"):
        max_pool2d_plan(torch.randn(1, 3, 8, 8), 3, 2, 1, interpret=True)
    with pytest.raises(ValueError, match=r"padding \(2, 2\) over half the window"):
        max_pool2d_plan(_nhwc((1, 3, 8, 8)), 3, 2, 2, interpret=True)
    with pytest.raises(ValueError, match="does not fit a 2x2 input"):
        max_pool2d_plan(_nhwc((1, 3, 2, 2)), 5, 1, 0, interpret=True)


class Pools(nn.Module):
    """A stem, pools the kernel computes (module and functional), and three it does not."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 19, 3, padding=1)
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.ceil = nn.MaxPool2d(2, 2, ceil_mode=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = F.relu(self.conv(x)) - 1.0
        kept = (self.ceil(y), F.max_pool2d(y, 3, 1, 1, dilation=2), F.max_pool2d(y, 2, return_indices=True)[1])
        return (self.pool(y), F.max_pool2d(y, 2), torch.max_pool2d(y, (3, 2), (1, 2), (1, 0)), *kept)


@pytest.mark.parametrize("backend", ["torch", "interpret"])
def test_pass_rewrites_what_the_kernel_computes_and_stays_right(backend: str) -> None:
    model = Pools().eval()
    x = torch.randn(2, 3, 13, 11).to(memory_format=torch.channels_last)
    fast = fuser.optimize(model, (x,), precision="ieee", backend=backend)
    rewritten = [r for r in fast.fusion_report.rewrites if r.kind == "max_pool"]
    assert len(rewritten) == 3, str(fast.fusion_report)
    assert sum(isinstance(m, FusedMaxPool2d) for m in fast.modules()) == 3
    with torch.no_grad():
        got, want = fast(x), reference64(model, x)
    for i, (g, r) in enumerate(zip(got, want, strict=True)):
        assert g.shape == r.shape, f"output {i}"
        if r.is_floating_point():
            assert_close(g, r, "ieee", f"output {i}")
        else:
            assert torch.equal(g, r), f"output {i}: indices"


def test_the_interpreted_kernel_runs_on_nhwc_and_torch_on_nchw() -> None:
    module = FusedMaxPool2d((3, 3), (2, 2), (1, 1), backend="interpret")
    x = torch.randn(1, 21, 15, 13)
    assert module._interpreted(x) is None
    assert module._interpreted(x.to(memory_format=torch.channels_last)) is True
    for t in (x, x.to(memory_format=torch.channels_last)):
        assert torch.equal(module(t), F.max_pool2d(t, 3, 2, 1))


def test_exports_standard_onnx_and_compiles_to_one_frame(tmp_path: Path) -> None:
    class Stem(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 19, 7, 2, 3, bias=False)
            self.bn = nn.BatchNorm2d(19)
            self.pool = nn.MaxPool2d(3, 2, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.pool(F.relu(self.bn(self.conv(x))))

    model, x = Stem().eval(), torch.randn(2, 3, 29, 31)
    fast = fuser.optimize(model, (x,), precision="ieee", backend="torch")
    assert any(r.kind == "max_pool" for r in fast.fusion_report.rewrites), str(fast.fusion_report)
    path = export_onnx(fast, (x,), tmp_path / "stem.onnx")
    assert "MaxPool" in {n.op_type for n in exported_standard(path).graph.node}
    x3 = torch.randn(3, 3, 29, 31)
    (got,) = run_onnxruntime(path, x3)
    assert_close(got, reference64(model, x3), "ieee", "onnxruntime")
    assert_close(compile_once(fast, x), reference64(model, x), "ieee")


GPU_CASES = [*CASES, ((32, 64, 112, 112), 3, 2, 1), ((1, 64, 112, 112), 3, 2, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("shape", "k", "s", "p"), GPU_CASES, ids=str)
def test_gpu_kernel_equals_torch_bit_for_bit(shape, k, s, p, dtype: torch.dtype) -> None:
    x = _nhwc(shape, dtype, "cuda")
    run = max_pool2d_plan(x, k, s, p)
    assert torch.equal(run(x), F.max_pool2d(x, k, s, p))


def test_plans_are_kept_per_signature_and_never_saved() -> None:
    import io

    module = FusedMaxPool2d((3, 3), (2, 2), (1, 1), backend="interpret")
    x = _nhwc((1, 21, 15, 13))
    want = F.max_pool2d(x, 3, 2, 1)
    assert torch.equal(module(x), want) and torch.equal(module(x), want) and len(module._plans) == 1
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert len(loaded._plans) == 0 and torch.equal(loaded(x), want)
    old = FusedMaxPool2d.__new__(FusedMaxPool2d)  # a module saved when its plans were a plain dict
    old.__setstate__({**{k: v for k, v in module.__dict__.items() if k != "_plans"}, "_plans": {}})
    assert torch.equal(old(x), want)
