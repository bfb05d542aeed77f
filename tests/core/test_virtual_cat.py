"""``conv(cat([upsample_nearest(a, 2), b], 1))`` with nothing materialized: the implicit-GEMM gather reads
both sources. Kernel (interpreter) against float64 on odd shapes; the pass on a YOLO-neck-like model (report,
near misses reported and right, ONNX export matching onnxruntime, torch.compile)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from accuracy import assert_close, randomize_batchnorm, reference64
from export_checks import compile_once, exported_standard, run_onnxruntime
from torch import nn

import fuser
from fuser.kernels import conv2d_act, pack_conv_weight
from fuser.kernels.tile_config import TileConfig
from fuser.onnx.exporter import export_onnx

# (C_a, C_b, kernel, stride, padding, C_out): 1x1 (C2f's cv1), 3x3 padded (37 channels, which the routing alone
# sends to flat K: a virtual input keeps channel blocks), strided, C_a a multiple of 16 only
CASES = [(32, 19, 1, 1, 0, 13), (16, 21, 3, 1, 1, 11), (48, 5, 3, 2, 1, 7), (32, 3, 1, 1, 0, 9)]


def _ref(a, b, w, bias, stride, pad, scale=None):
    x = torch.cat([F.interpolate(a.double(), scale_factor=2, mode="nearest"), b.double()], 1)
    if scale is not None:
        x = x * scale.double()
    return F.conv2d(x, w.double(), bias.double(), stride, pad)


@pytest.mark.parametrize("tile", [None, TileConfig(32, 16, 16, 1, 4, 1, split_k=2)], ids=["default", "split_k"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernel_reads_the_virtual_concatenation(case: tuple[int, ...], tile: TileConfig | None) -> None:
    c_a, c_b, k, stride, pad, c_out = case
    n = 3 if k == 1 else 2
    a = torch.randn(n, c_a, 5, 7).to(memory_format=torch.channels_last)
    b = torch.randn(n, c_b, 10, 14)  # NCHW: another layout than a's
    w, bias = torch.randn(c_out, c_a + c_b, k, k), torch.randn(c_out)
    out = conv2d_act(a, pack_conv_weight(w, "ieee"), bias, stride=stride, padding=pad, interpret=True,
                     cat_with=b, upsample=2, tile=tile)  # fmt: skip
    assert_close(out, _ref(a, b, w, bias, stride, pad), "ieee", str(case))


def test_kernel_virtual_concatenation_with_a_channel_scale() -> None:
    a, b = torch.randn(2, 16, 4, 3), torch.randn(2, 7, 8, 6)
    w, bias, s = torch.randn(5, 23, 1, 1), torch.randn(5), torch.rand(2, 23, 1, 1) + 0.25
    out = conv2d_act(a, pack_conv_weight(w, "ieee"), bias, interpret=True, cat_with=b, upsample=2, input_scale=s)
    assert_close(out, _ref(a, b, w, bias, 1, 0, s), "ieee")


def test_kernel_refuses_what_it_cannot_read_by_name() -> None:
    w = pack_conv_weight(torch.randn(5, 27, 1, 1), "ieee")
    with pytest.raises(ValueError, match=r"multiple of 16.*got 20"):
        conv2d_act(torch.randn(1, 20, 4, 4), w, interpret=True, cat_with=torch.randn(1, 7, 8, 8), upsample=2)
    w = pack_conv_weight(torch.randn(5, 23, 1, 1), "ieee")
    with pytest.raises(ValueError, match=r"does not concatenate.*needs N, H, W = \(1, 8, 8\)"):
        conv2d_act(torch.randn(1, 16, 4, 4), w, interpret=True, cat_with=torch.randn(1, 7, 8, 9), upsample=2)
    with pytest.raises(ValueError, match="virtual concatenation only"):
        conv2d_act(torch.randn(1, 23, 4, 4), w, interpret=True, upsample=2)


class Neck(nn.Module):
    """YOLOv8's neck step: upsample a deep feature, concatenate a skip, a 1x1 conv-BN-SiLU (C2f's cv1)."""

    def __init__(self, c_a: int = 32, c_b: int = 19, up: str = "module", order: str = "up_first") -> None:
        super().__init__()
        self.deep = nn.Conv2d(5, c_a, 3, 2, 1)
        self.up = nn.Upsample(None, 2, "nearest")
        self.cv1 = nn.Conv2d(c_a + c_b, 13, 1, bias=False)
        self.bn = nn.BatchNorm2d(13)
        self.skip = nn.Conv2d(5, c_b, 1)
        self.form, self.order = up, order

    def upsample(self, x: torch.Tensor) -> torch.Tensor:
        if self.form == "module":
            return self.up(x)
        if self.form == "bilinear":
            return F.interpolate(x, scale_factor=2, mode="bilinear")
        return F.interpolate(x, scale_factor=2.0, mode="nearest")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, skip = self.upsample(F.relu(self.deep(x))), self.skip(x)
        parts = [up, skip] if self.order == "up_first" else [skip, up]
        return F.silu(self.bn(self.cv1(torch.cat(parts, 1))))


def _kinds(fast: nn.Module, kind: str) -> list:
    return [r for r in fast.fusion_report.rewrites if r.kind == kind]


def _nodes(fast: nn.Module, target: object) -> int:
    graphs = [m.graph for m in fast.modules() if isinstance(m, torch.fx.GraphModule)]
    return sum(1 for g in graphs for n in g.nodes if n.target is target)


@pytest.mark.parametrize("backend", ["torch", "interpret"])
@pytest.mark.parametrize("up", ["module", "interpolate"])
def test_neck_reads_upsample_and_skip_directly(backend: str, up: str) -> None:
    model, x = randomize_batchnorm(Neck(up=up)).eval(), torch.randn(3, 5, 14, 10)
    fast = fuser.optimize(model, (x,), precision="ieee", backend=backend)
    (rewrite,) = _kinds(fast, "virtual_cat")
    assert len(rewrite.eliminated) == 2 and "virtual_cat" in str(fast.fusion_report), str(fast.fusion_report)
    assert _nodes(fast, torch.cat) == 0 and _nodes(fast, F.interpolate) == 0
    with torch.no_grad():
        assert_close(fast(x), reference64(model, x), "ieee", backend)
        x2 = torch.randn(2, 5, 10, 6)
        assert_close(fast(x2), reference64(model, x2), "ieee", f"{backend}, second shape")


def test_the_report_names_the_kernel_a_virtual_concatenation_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """cv1 is a 1x1 conv, which the routing sends to the plain GEMM; reading a virtual concatenation it runs the
    implicit GEMM's channel blocks instead, and its chain's line in the report says so."""
    from fuser.kernels import launch
    from fuser.kernels.conv_choice import ConvKernel

    launched: list[tuple[str, dict]] = []
    real = launch.run_interpreted
    monkeypatch.setattr(
        launch,
        "run_interpreted",
        lambda k, grid, *a, **kw: (launched.append((k.fn.__name__, kw)), real(k, grid, *a, **kw)),
    )
    model, x = randomize_batchnorm(Neck()).eval(), torch.randn(2, 5, 14, 10)
    fast = fuser.optimize(model, (x,), precision="ieee", backend="interpret")
    (cv1,) = [e for e in fast.fusion_report.entries if e.fused and e.modules[0] == "cv1"]
    assert cv1.kernel == ConvKernel.IMPLICIT_GEMM.value, str(fast.fusion_report)
    with torch.no_grad():
        fast(x)
    virtual = [(name, kw["K_ORDER"]) for name, kw in launched if kw.get("VIRTUAL_CAT")]
    assert virtual == [(ConvKernel.IMPLICIT_GEMM.triton_function, 0)], launched
    (skip,) = [e for e in fast.fusion_report.entries if e.fused and e.modules[0] == "skip"]  # not moved
    assert skip.kernel == ConvKernel.GEMM_1X1.value


class NeckShared(Neck):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        up = self.up(F.relu(self.deep(x)))
        return F.silu(self.bn(self.cv1(torch.cat([up, self.skip(x)], 1)))), up.mean()


@pytest.mark.parametrize("backend", ["torch", "interpret"])
def test_near_misses_stay_and_say_why(backend: str) -> None:
    x = torch.randn(2, 5, 14, 10)
    cases = [
        (Neck(c_a=24), "24 channels, not a multiple of 16"),
        (Neck(up="bilinear"), "not nearest"),
        (NeckShared(), "other users"),
        (Neck(order="skip_first"), None),  # no upsample first: not this pass's, nothing to say
    ]
    for model, why in cases:
        model = randomize_batchnorm(model).eval()
        fast = fuser.optimize(model, (x,), precision="ieee", backend=backend)
        report = str(fast.fusion_report)
        assert not _kinds(fast, "virtual_cat"), report
        kept = _kinds(fast, "virtual_cat_kept")
        if why is None:
            assert not kept, report
        else:
            assert len(kept) == 1 and why in kept[0].detail and not kept[0].eliminated, report
        with torch.no_grad():
            got, want = fast(x), reference64(model, x)
        for g, r in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,),
                        strict=True):  # fmt: skip
            assert_close(g, r, "ieee", type(model).__name__)


def test_onnx_export_has_resize_concat_conv_and_matches_onnxruntime(tmp_path: Path) -> None:
    model, x = randomize_batchnorm(Neck()).eval(), torch.randn(2, 5, 14, 10)
    fast = fuser.optimize(model, (x,), precision="ieee", backend="torch")
    assert _kinds(fast, "virtual_cat")
    path = export_onnx(fast, (x,), tmp_path / "neck.onnx")
    ops = [n.op_type for n in exported_standard(path).graph.node]
    assert {"Resize", "Concat", "Conv"} <= set(ops), ops
    x3 = torch.randn(3, 5, 14, 10)
    (got,) = run_onnxruntime(path, x3)
    assert_close(got, reference64(model, x3), "ieee", "onnxruntime")


def test_torch_compile_one_frame() -> None:
    model, x = randomize_batchnorm(Neck()).eval(), torch.randn(2, 5, 14, 10)
    fast = fuser.optimize(model, (x,), precision="ieee", backend="torch")
    out = compile_once(fast, x)
    assert_close(out, reference64(model, x), "ieee")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", [(64, 128, 1, 1, 0, 64), (128, 64, 3, 1, 1, 96), (32, 19, 1, 1, 0, 13)], ids=str)
def test_gpu_kernel_reads_the_virtual_concatenation(case: tuple[int, ...], dtype: torch.dtype) -> None:
    c_a, c_b, k, stride, pad, c_out = case
    a = torch.randn(1, c_a, 20, 20, device="cuda").to(dtype).to(memory_format=torch.channels_last)
    b = torch.randn(1, c_b, 40, 40, device="cuda").to(dtype).to(memory_format=torch.channels_last)
    w, bias = torch.randn(c_out, c_a + c_b, k, k, device="cuda"), torch.randn(c_out, device="cuda")
    out = conv2d_act(a, pack_conv_weight(w.to(dtype), "tf32"), bias, stride=stride, padding=pad, cat_with=b,
                     upsample=2)  # fmt: skip
    assert_close(out, _ref(a, b, w.to(dtype), bias, stride, pad), "tf32" if dtype == torch.float32 else "bf16")


class NeckC2f(Neck):
    """The neck step into a whole C2f: cv1 (the virtual input) is chunked into C2f's own concatenation."""

    def __init__(self) -> None:
        super().__init__(c_b=19)
        self.cv1 = nn.Conv2d(51, 14, 1, bias=False)
        self.bn = nn.BatchNorm2d(14)
        self.m = nn.Conv2d(7, 7, 3, padding=1)
        self.cv2 = nn.Conv2d(21, 11, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, skip = self.up(F.relu(self.deep(x))), self.skip(x)
        pieces = F.silu(self.bn(self.cv1(torch.cat([up, skip], 1)))).chunk(2, 1)
        return F.silu(self.cv2(torch.cat([pieces[0], pieces[1], F.silu(self.m(pieces[1]))], 1)))


def test_a_virtual_input_conv_still_stores_into_the_next_concatenation() -> None:
    model, x = randomize_batchnorm(NeckC2f()).eval(), torch.randn(2, 5, 14, 10)
    fast = fuser.optimize(model, (x,), precision="ieee", backend="interpret")
    report = str(fast.fusion_report)
    assert _kinds(fast, "virtual_cat") and _kinds(fast, "cat_buffer"), report
    assert "fused_cv1" in _kinds(fast, "cat_buffer")[0].detail, report
    with torch.no_grad():
        assert_close(fast(x), reference64(model, x), "ieee")
        assert_close(fast(x), reference64(model, x), "ieee", "second call")


def test_opcheck_of_the_op_with_a_virtual_input() -> None:
    from fuser.lower.fused_modules import FusedConv2d

    fast = fuser.optimize(randomize_batchnorm(Neck()).eval(), (torch.randn(2, 5, 14, 10),), backend="torch")
    conv = next(m for m in fast.modules() if isinstance(m, FusedConv2d) and m.weight.shape[1] == 51)
    a, b = torch.randn(2, 32, 4, 3), torch.randn(2, 19, 8, 6)
    args = (a, conv.weight, conv.bias, None, conv.packed, *conv._op_args, None, b, 2)
    torch.library.opcheck(torch.ops.fuser.conv2d_act.default, args, test_utils=("test_schema", "test_faketensor"))
    out = torch.ops.fuser.conv2d_act(*args)
    assert out.shape == (2, 13, 8, 6)


class NeckC3(Neck):
    """YOLOv5's C3 after the neck step: two 1x1 convs read the same concatenation."""

    def __init__(self) -> None:
        super().__init__()
        self.cv2 = nn.Conv2d(51, 9, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(9)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cat = torch.cat([self.up(F.relu(self.deep(x))), self.skip(x)], 1)
        return torch.cat([F.silu(self.bn(self.cv1(cat))), F.silu(self.bn2(self.cv2(cat)))], 1)


@pytest.mark.parametrize("backend", ["torch", "interpret"])
def test_two_convs_read_one_virtual_concatenation(backend: str) -> None:
    model, x = randomize_batchnorm(NeckC3()).eval(), torch.randn(2, 5, 14, 10)
    fast = fuser.optimize(model, (x,), precision="ieee", backend=backend)
    assert len(_kinds(fast, "virtual_cat")) == 1 and not _kinds(fast, "virtual_cat_kept"), str(fast.fusion_report)
    assert _nodes(fast, F.interpolate) == 0
    nodes = next(m for m in fast.modules() if isinstance(m, torch.fx.GraphModule)).graph.nodes
    assert sum(n.kwargs.get("upsample") == 2 for n in nodes) == 2, "both convs read the virtual input"
    with torch.no_grad():
        assert_close(fast(x), reference64(model, x), "ieee", backend)


def test_layer_errors_rerun_the_virtual_input() -> None:
    """The per-layer float64 re-runs (fuser.verify, fuser.diagnose) give a virtual-input conv its cat_with."""
    from fuser.diagnose import layer_errors

    model, x = randomize_batchnorm(NeckC3()).eval(), torch.randn(2, 5, 14, 10)
    fast = fuser.optimize(model, (x,), precision="ieee", backend="interpret")
    errors = layer_errors(fast, x)
    # deep, skip (a lone conv with bias), cv1, cv2
    assert len(errors) == 4 and all(e.rel_error < 1e-5 for e in errors), errors
    result = fuser.verify(model, fast, (x,))
    assert result.ok and len(result.layers) == 4 and all(c.own_error < 1e-5 for c in result.layers), str(result)
