"""A conv with no BatchNorm or activation after it (the YOLO detect head's last 1x1 convs, a ViT / Swin patch
embedding, a folded export's downsample add) is fused alone: ``conv2d`` and ``conv2d -> + residual`` build a
FusedConv2d with the bias (and the residual) in the epilogue, on the kernel fuser.kernels.conv_choice picks, as
every chain does. Where fusing would gain nothing (no bias and nothing beside it that a fused conv takes,
float64 weights, a BatchNorm after it that could not be folded) the conv stays, and the report says why.
Against float64 on odd shapes, in Triton's interpreter and on the torch reference; ONNX export and
torch.compile composition."""

from __future__ import annotations

import copy
from pathlib import Path

import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from accuracy import assert_close, reference64
from test_compile import compile_and_count
from torch import nn

import fuser
from fuser.kernels.conv_choice import conv_kernel
from fuser.lower.fused_modules import FusedConv2d

BACKENDS = ["interpret", "torch"]


class Lone(nn.Module):
    def __init__(self, c_in: int, c_out: int, k: int, stride: int, padding: int, groups: int, bias: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, k, stride, padding, groups=groups, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class LoneAdd(Lone):
    """conv(x) + r: the residual add, no activation (the downsample add of an already-folded ResNet)."""

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return r + self.conv(x)


# (c_in, c_out, kernel, stride, padding, groups, input H, W): channel counts that are not multiples of 8
GEOMETRIES = {
    "3x3_s2": (5, 19, 3, 2, 1, 1, 13, 11),
    "1x1_gemm": (19, 13, 1, 1, 0, 1, 9, 7),
    "grouped": (15, 21, 3, 1, 1, 3, 11, 9),
    "depthwise_s2": (19, 19, 3, 2, 1, 19, 13, 11),
    "patch_embed_4x4_s4": (3, 37, 4, 4, 0, 1, 21, 19),
}


def _build(cls: type[Lone], geometry: tuple, bias: bool) -> Lone:
    c_in, c_out, k, stride, padding, groups, _, _ = geometry
    model = cls(c_in, c_out, k, stride, padding, groups, bias).eval()
    with torch.no_grad():
        if bias:
            model.conv.bias.normal_(0, 0.5)  # well off zero: a bias the epilogue drops fails the comparison
    return model


def _input(geometry: tuple, batch: int = 2) -> torch.Tensor:
    c_in, *_, h, w = geometry
    return torch.randn(batch, c_in, h, w)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_a_lone_conv_with_bias_is_fused_on_the_kernel_the_chains_use(name: str, backend: str) -> None:
    geometry = GEOMETRIES[name]
    model, x = _build(Lone, geometry, bias=True), _input(geometry)
    fast = fuser.optimize(model, (x,), precision="ieee", backend=backend)
    report = fast.fusion_report
    (entry,) = report.fused
    assert (entry.pattern, entry.ops, entry.modules) == ("conv", ["conv2d"], ["conv"]), str(report)
    assert not report.rejected and "conv" in str(report)
    c_in, c_out, k, stride, padding, groups, _, _ = geometry
    kernel = conv_kernel(c_in, c_out, groups, (k, k), (stride, stride), padding)
    assert entry.kernel == kernel.value, str(report)
    assert sum(isinstance(m, FusedConv2d) for m in fast.modules()) == 1
    with torch.no_grad():
        assert_close(fast(x), reference64(model, x), "ieee", f"{name} {backend}")
        x2 = _input(geometry, batch=3)  # another batch than the example
        assert_close(fast(x2), reference64(model, x2), "ieee", f"{name} {backend}, batch 3")
    assert not any(isinstance(m, FusedConv2d) for m in model.modules()), "the user's model is untouched"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("name", ["3x3_s2", "grouped", "1x1_gemm"])
def test_conv_then_residual_add_is_one_fused_conv(name: str, bias: bool, backend: str) -> None:
    geometry = GEOMETRIES[name]
    model, x = _build(LoneAdd, geometry, bias), _input(geometry)
    with torch.no_grad():
        r = torch.randn_like(model.conv(x)) * 2
    fast = fuser.optimize(model, (x, r), precision="ieee", backend=backend)
    (entry,) = fast.fusion_report.fused
    assert (entry.pattern, entry.ops, entry.residual) == ("conv", ["conv2d", "add"], True), str(fast.fusion_report)
    assert entry.activation is None and not fast.fusion_report.rejected
    # The report and the module say what the epilogue applies: no bias where the conv has none.
    expected = "bias -> +residual" if bias else "+residual"
    assert fast.fusion_report.to_dict()["fused"][0]["epilogue"] == expected
    (fused,) = [m for m in fast.modules() if isinstance(m, FusedConv2d)]
    assert f"epilogue='{expected}'" in repr(fused)
    with torch.no_grad():
        assert_close(fast(x, r), reference64(model, x, r), "ieee", f"{name} {backend}")


class IntoCat(nn.Module):
    """Two bias-free lone convs whose outputs are concatenated: fused so that they store into the cat buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(5, 11, 3, 2, 1, bias=False)
        self.b = nn.Conv2d(5, 7, 1, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.a(x), self.b(x)], 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bias_free_lone_convs_feeding_a_cat_store_into_its_buffer(backend: str) -> None:
    model, x = IntoCat().eval(), torch.randn(2, 5, 13, 11)
    fast = fuser.optimize(model, (x,), precision="ieee", backend=backend)
    report = fast.fusion_report
    assert [(e.pattern, e.modules) for e in report.fused] == [("conv", ["a"]), ("conv", ["b"])], str(report)
    assert [e["epilogue"] for e in report.to_dict()["fused"]] == ["none", "none"]  # bias-free, nothing after
    (cat,) = [r for r in report.rewrites if r.kind == "cat_buffer"]
    assert "0 part(s) copied in" in cat.detail and cat.eliminated == ["cat"], str(report)
    with torch.no_grad():
        assert_close(fast(x), reference64(model, x), "ieee", backend)


class Nothing(nn.Module):
    """A bias-free lone conv with nothing beside it to fuse."""

    def __init__(self) -> None:
        super().__init__()
        self.plain = nn.Conv2d(5, 9, 3, padding=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.plain(x)


def test_a_bias_free_lone_conv_with_nothing_beside_it_stays_and_says_why() -> None:
    model, x = Nothing().eval(), torch.randn(2, 5, 9, 7)
    fast = fuser.optimize(model, (x,), precision="ieee", backend="interpret")
    report = fast.fusion_report
    assert not report.fused
    (entry,) = report.rejected
    assert entry.ops == ["conv2d"] and "no bias" in entry.reason and "stays a PyTorch conv" in entry.reason
    assert not any(isinstance(m, FusedConv2d) for m in fast.modules())
    with torch.no_grad():
        assert_close(fast(x), reference64(model, x), "ieee")


def test_a_float64_lone_conv_stays_and_says_why() -> None:
    geometry = GEOMETRIES["3x3_s2"]
    model, x = _build(Lone, geometry, bias=True).double(), _input(geometry).double()
    fast = fuser.optimize(model, (x,), backend="torch")
    (entry,) = fast.fusion_report.rejected
    assert "torch.float64 weights" in entry.reason and not fast.fusion_report.fused
    with torch.no_grad():
        assert torch.equal(fast(x), model(x))


class BeforeTrainingBn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(5, 9, 3)  # with bias: alone it would fuse
        self.register_buffer("m", torch.randn(9))
        self.register_buffer("v", torch.rand(9) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(self.conv(x), self.m, self.v, training=True)


def test_a_conv_before_a_batchnorm_that_cannot_fold_stays_with_it() -> None:
    model, x = BeforeTrainingBn(), torch.randn(3, 5, 9, 7)
    fast = fuser.optimize(model, backend="torch")  # no example inputs: a training BN would update its stats
    assert not fast.fusion_report.fused
    (entry,) = fast.fusion_report.rejected
    assert entry.ops == ["conv2d", "batch_norm"] and "training=True" in entry.reason, str(fast.fusion_report)
    with torch.no_grad():  # batch statistics, as in eager (each copy updates its own running statistics)
        assert_close(fast(x), copy.deepcopy(model)(x), "ieee")


class Head(nn.Module):
    """A detect-head-like tail: two branches each ending in a lone 1x1 conv with bias, concatenated, and a
    folded downsample add."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(5, 19, 3, 2, 1)
        self.box, self.cls = nn.Conv2d(19, 13, 1), nn.Conv2d(19, 7, 1)
        self.down = nn.Conv2d(5, 20, 1, 2)
        self.proj = nn.Conv2d(19, 20, 3, 1, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = F.silu(self.stem(x))
        return torch.cat([self.box(y), self.cls(y)], 1), self.proj(y) + self.down(x)


def test_onnx_export_of_lone_convs_is_standard_and_matches_onnxruntime(tmp_path: Path) -> None:
    model, x = Head().eval(), torch.randn(2, 5, 13, 11)
    fast = fuser.optimize(model, (x,), precision="ieee", backend="interpret")
    ops = sorted(" -> ".join(e.ops) for e in fast.fusion_report.fused)
    assert ops == ["conv2d", "conv2d", "conv2d", "conv2d -> add", "conv2d -> silu"], str(fast.fusion_report)
    path = fuser.export_onnx(fast, (x,), tmp_path / "head.onnx")
    graph = onnx.load(str(path)).graph
    assert all(n.domain in ("", "ai.onnx") for n in graph.node), [n.domain for n in graph.node]
    kinds = [n.op_type for n in graph.node]
    assert kinds.count("Conv") == 5 and kinds.count("Concat") == 1 and kinds.count("Add") == 1, kinds
    session = ort.InferenceSession(str(path))
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    for out, ref in zip(got, reference64(model, x), strict=True):
        assert_close(torch.from_numpy(out), ref, "ieee", "onnxruntime")


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_compile_of_lone_convs_is_one_frame_without_breaks(backend: str) -> None:
    model, x = Head().eval(), torch.randn(2, 5, 13, 11)
    fast = fuser.optimize(model, (x,), precision="ieee", backend=backend)
    with torch.no_grad():
        eager = fast(x)
    out, counter, breaks = compile_and_count(fast, x)
    assert counter.frame_count == 1 and not breaks, breaks
    fused_ops = [n for g in counter.graphs for n in g.graph.nodes if str(n.target).startswith("fuser.")]
    assert len(fused_ops) == 5
    for a, b in zip(out, eager, strict=True):
        assert_close(a, b, "ieee", f"compiled vs eager on {backend}")
