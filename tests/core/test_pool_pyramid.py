"""Pool pyramids (SPPF, SPP): the kernel in the interpreter against torch, the graph pass and its guards,
the report, repeated calls, ONNX export; the compiled kernel on a GPU."""

from __future__ import annotations

import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from accuracy import assert_close, randomize_batchnorm, reference64
from jit_binds import count_jit_binds
from torch import nn

import fuser
from fuser.kernels.pool import max_pool_pyramid
from fuser.rewrite.pool_pyramid import FusedPoolPyramid

SPPF_RADII = (0, 2, 4, 6)


def chained_pools(x: torch.Tensor, k: int = 5, n: int = 3) -> torch.Tensor:
    """What SPPF computes, in eager torch."""
    y = [x]
    for _ in range(n):
        y.append(F.max_pool2d(y[-1], k, 1, k // 2))
    return torch.cat(y, 1)


def windows(x: torch.Tensor, radii: tuple[int, ...]) -> torch.Tensor:
    return torch.cat([x if r == 0 else F.max_pool2d(x, 2 * r + 1, 1, r) for r in radii], 1)


@pytest.mark.parametrize("channels_last", [True, False], ids=["nhwc", "nchw"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    ("shape", "radii"), [((2, 7, 9, 11), SPPF_RADII), ((1, 19, 5, 13), (3, 0, 1)), ((3, 5, 6, 3), (1, 2))]
)
def test_kernel_matches_torch(shape, radii, dtype: torch.dtype, channels_last: bool) -> None:
    x = torch.randn(shape, dtype=dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    out = max_pool_pyramid(x, radii, interpret=True)
    assert torch.equal(out, windows(x, radii)), "a max is exact: every element must equal torch's"
    assert out.is_contiguous(memory_format=torch.channels_last) == channels_last


def test_windows_compose_like_chained_pools() -> None:
    """The identity the whole fusion rests on: pool5(pool5(x)) == pool9(x) with -inf padding, at borders too."""
    x = torch.randn(2, 3, 7, 9)
    assert torch.equal(chained_pools(x), windows(x, SPPF_RADII))


def test_kernel_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match=r"\[N, C, H, W\]"):
        max_pool_pyramid(torch.randn(3, 5, 5), SPPF_RADII, interpret=True)
    with pytest.raises(ValueError, match="radii"):
        max_pool_pyramid(torch.randn(1, 3, 5, 5), (0, 1, 2, 3, 4), interpret=True)
    with pytest.raises(TypeError, match="float32"):
        max_pool_pyramid(torch.randn(1, 3, 5, 5).double(), SPPF_RADII, interpret=True)


class SPPF(nn.Module):
    """ultralytics' SPPF: one pool module called three times (with 1x1 convs around it)."""

    def __init__(self, c: int = 11) -> None:
        super().__init__()
        self.cv1 = nn.Sequential(nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c), nn.SiLU())
        self.m = nn.MaxPool2d(5, 1, 2)
        self.cv2 = nn.Conv2d(4 * c, 7, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = [self.cv1(x)]
        y.extend(self.m(y[-1]) for _ in range(3))
        return self.cv2(torch.cat(y, 1))


class SPP(nn.Module):
    """YOLOv5's SPP: three parallel pools of 5, 9 and 13, functional form."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x] + [F.max_pool2d(x, k, stride=1, padding=k // 2) for k in (5, 9, 13)], dim=1) * 2


class Pools(nn.Module):
    """cat of pools of x with one parameter of the pools or the cat changed (a near miss) or not."""

    def __init__(self, **pool: object) -> None:
        super().__init__()
        self.pool = {"kernel_size": 5, "stride": 1, "padding": 2, **pool}
        self.dim = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = F.max_pool2d(x, **self.pool)
        if p.shape[-2:] != x.shape[-2:]:
            p = F.interpolate(p, size=x.shape[-2:])
        return torch.cat([x, p], self.dim)


def _pyramids(fast: fuser.OptimizedModule) -> list:
    return [r for r in fast.fusion_report.rewrites if r.kind == "pool_pyramid"]


@pytest.mark.parametrize("backend", ["torch", "interpret"])
@pytest.mark.parametrize("model_type", [SPPF, SPP])
def test_pyramids_fuse_and_match_float64(model_type: type[nn.Module], backend: str) -> None:
    model = randomize_batchnorm(model_type()).eval() if model_type is SPPF else model_type()
    x = torch.randn(2, 11, 13, 9)
    fast = fuser.optimize(model, (x,), backend=backend, precision="ieee")
    assert len(_pyramids(fast)) == 1
    assert not [m for m in fast.modules() if isinstance(m, nn.MaxPool2d)], "the pool modules are gone"
    assert sum(isinstance(m, FusedPoolPyramid) for m in fast.modules()) == 1
    with torch.no_grad():
        assert_close(fast(x), reference64(model, x), "ieee", f"{model_type.__name__} on {backend}")


@pytest.mark.parametrize(
    "near_miss",
    [
        {"stride": 2},
        {"padding": 1},
        {"kernel_size": 4, "padding": 2},
        {"dilation": 2},
        {"ceil_mode": True, "stride": 2},
    ],
    ids=["stride2", "padding1", "even_k", "dilation2", "ceil"],
)
def test_near_misses_stay_as_they_are(near_miss: dict) -> None:
    model = Pools(**near_miss)
    x = torch.randn(1, 5, 11, 13)
    fast = fuser.optimize(model, (x,), backend="torch")
    assert not _pyramids(fast)
    with torch.no_grad():
        assert torch.equal(fast(x), model(x))


def test_pools_of_different_inputs_stay() -> None:
    class TwoBases(nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.cat([x, F.max_pool2d(y, 5, 1, 2)], 1)

    x, y = torch.randn(1, 3, 9, 9), torch.randn(1, 3, 9, 9)
    fast = fuser.optimize(TwoBases(), (x, y), backend="torch")
    assert not _pyramids(fast)


def test_a_pool_read_elsewhere_is_kept() -> None:
    """The pyramid replaces the cat; a pool that something else also reads still runs for that reader."""

    class Shared(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            p = F.max_pool2d(x, 5, 1, 2)
            return torch.cat([x, p], 1), p.sigmoid()

    x = torch.randn(1, 3, 9, 7)
    model = Shared()
    fast = fuser.optimize(model, (x,), backend="interpret")
    assert _pyramids(fast)[0].eliminated == ["cat"]
    with torch.no_grad():
        for out, ref in zip(fast(x), model(x), strict=True):
            assert torch.equal(out, ref)


def test_report_and_explain_name_the_pyramid() -> None:
    x = torch.randn(1, 11, 9, 9)
    report = fuser.explain(SPPF().eval(), (x,))
    (rewrite,) = report.rewrites
    assert rewrite.detail == "cat(x, maxpool5, maxpool9, maxpool13)"
    assert set(rewrite.eliminated) == {"cat", "m", "m_1", "m_2"}
    assert "Also fused" in str(report)
    assert report.to_dict()["rewrites"][0]["kind"] == "pool_pyramid"


def test_an_earlier_output_is_not_overwritten_by_a_later_call() -> None:
    module = FusedPoolPyramid(SPPF_RADII, 1, backend="interpret")
    x1, x2 = torch.randn(1, 3, 7, 7), torch.randn(1, 3, 7, 7)
    y1 = module(x1)
    kept = y1.clone()
    module(x2)
    assert torch.equal(y1, kept)


def test_a_misaligned_input_gets_its_own_plan() -> None:
    """A plan's later launches call the kernel compiled for its first input, whose 16-byte alignment the
    compiler may have assumed: an input of the same shape and strides at an odd offset needs its own plan."""
    module = FusedPoolPyramid(SPPF_RADII, 1, backend="interpret")
    storage = torch.randn(1 + 2 * 5 * 9 * 11)
    aligned = storage[: 2 * 5 * 9 * 11].view(2, 5, 9, 11)
    misaligned = storage[1:].view(2, 5, 9, 11)
    assert aligned.stride() == misaligned.stride() and misaligned.data_ptr() % 16 != 0
    assert torch.equal(module(aligned), windows(aligned, SPPF_RADII))
    assert torch.equal(module(misaligned), windows(misaligned, SPPF_RADII))
    assert len(module._plans) == 2


def test_onnx_export_is_standard_and_matches_onnxruntime(tmp_path) -> None:
    model = randomize_batchnorm(SPPF()).eval()
    x = torch.randn(2, 11, 13, 9)
    fast = fuser.optimize(model, (x,), backend="torch")
    path = fuser.export_onnx(fast, (x,), tmp_path / "sppf.onnx")
    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert {"MaxPool", "Concat"} <= ops
    session = ort.InferenceSession(str(path))
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    assert_close(torch.from_numpy(out), reference64(model, x), "ieee", "onnxruntime on the exported pyramid")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 128, 20, 20), (3, 19, 13, 11), (32, 256, 20, 20)])
def test_compiled_kernel_matches_torch(shape, dtype: torch.dtype) -> None:
    x = torch.randn(shape, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
    out = max_pool_pyramid(x, SPPF_RADII)
    assert torch.equal(out, chained_pools(x))
    assert out.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.gpu
def test_direct_launch_matches_jit_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """After a plan's first call the pyramid launches its compiled kernel directly (kernels/launch.py,
    LaunchOptions): later calls must not bind their arguments again and must give the first call's result."""
    from fuser.kernels import launch as launch_module
    from fuser.kernels.pool import max_pool_pyramid_plan

    binds = count_jit_binds(monkeypatch)
    x = torch.randn(3, 19, 13, 11, device="cuda").contiguous(memory_format=torch.channels_last)
    plan = max_pool_pyramid_plan(x, SPPF_RADII)
    first = plan(x)
    assert binds, "the first call of a plan goes through JITFunction.run"
    binds.clear()
    direct = [plan(x) for _ in range(3)]
    assert not binds, f"later calls bound their arguments again: {binds}"
    monkeypatch.setattr(launch_module, "DIRECT_LAUNCH", False)
    jit = plan(x)
    torch.cuda.synchronize()
    for out in [*direct, jit]:
        assert torch.equal(out, first)
    assert torch.equal(first, chained_pools(x))


@pytest.mark.parametrize("channels_last", [True, False], ids=["nhwc", "nchw"])
def test_the_custom_ops_fake_output_is_laid_out_as_the_kernels(channels_last: bool) -> None:
    """Inductor plans the consumers of ``fuser::max_pool_pyramid`` by its fake output: shape and strides must
    be what the kernel returns, or they read it wrongly."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(2, 7, 9, 11)
    x = x.contiguous(memory_format=torch.channels_last) if channels_last else x
    real = torch.ops.fuser.max_pool_pyramid(x, list(SPPF_RADII))
    with FakeTensorMode() as mode:
        fake = torch.ops.fuser.max_pool_pyramid(mode.from_tensor(x), list(SPPF_RADII))
    assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype)
    assert_close(real, windows(x.double(), SPPF_RADII), "ieee", "the custom op")


def test_under_torch_compile_the_pyramid_is_one_opaque_op() -> None:
    """torch.compile(fuser.optimize(SPPF)): one frame, no break, the pyramid one ``fuser::max_pool_pyramid`` node
    (the kernel, not three pools Inductor would lower one by one), the same result as the eager module."""
    from test_compile import compile_and_count

    model = randomize_batchnorm(SPPF()).eval()
    x = torch.randn(2, 11, 13, 9)
    fast = fuser.optimize(model, (x,), backend="interpret", precision="ieee")
    out, counter, breaks = compile_and_count(fast, x, calls=2)
    assert counter.frame_count == 1 and not breaks, breaks
    targets = [str(n.target) for g in counter.graphs for n in g.graph.nodes]
    assert targets.count("fuser.max_pool_pyramid") == 1, targets
    assert not [t for t in targets if "max_pool2d" in t], targets
    assert_close(out, reference64(model, x), "ieee", "compiled SPPF")
