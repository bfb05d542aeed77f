"""BatchNorms after a concatenation or a pool, folded into the layer after them (fuser.rewrite.batchnorm_prologue).

Kernels (Triton interpreter): the affine + activation operand prologue ``act(x * s + t)`` in every kernel that has
the operand prologue (the 1x1 GEMM, the implicit GEMM over channel blocks, flat K and filter rows, grouped, depthwise),
against float64, odd channel counts, padding whose zeros must stay zeros after the activation, split-K, 16-bit
inputs, and the refusals. Graph pass: a DenseNet-like model (cat -> BN -> ReLU -> 1x1 or padded 3x3 conv, a
transition, a last BN -> ReLU -> pool that stays), LeViT's mean -> BatchNorm1d -> Linear, the near misses with
their reasons, the custom op against the eager shortcut, ONNX export run in onnxruntime, save and load, and
casts of the optimized module.
"""

from __future__ import annotations

import copy
import io
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from accuracy import assert_close, randomize_batchnorm, reference64
from export_checks import compile_once, exported_standard, run_onnxruntime
from torch import nn

import fuser
from fuser.activations import Activation, apply_activation_torch
from fuser.kernels import conv2d_act, gemm_act, pack_conv_weight, pack_gemm_weight
from fuser.kernels.tile_config import TileConfig
from fuser.lower.fused_modules import FusedConv2d, FusedLinear
from fuser.onnx.exporter import export_onnx
from fuser.report import BATCH_NORM_FOLDS

# (C_in, C_out, kernel, stride, padding, groups): the 1x1 GEMM, the implicit GEMM over channel blocks and over
# flat K and over filter rows (strided), a grouped conv, the depthwise kernel
CONVS = {
    "gemm_1x1": (37, 53, 1, 1, 0, 1),
    "implicit_3x3": (37, 11, 3, 1, 1, 1),
    "implicit_flat_k": (5, 9, 3, 2, 1, 1),  # filter rows of 15 weights: flat K
    "implicit_rows": (7, 9, 3, 2, 1, 1),  # rows of 21: one K step per filter row
    "grouped": (18, 12, 3, 1, 2, 3),
    "depthwise": (19, 19, 3, 1, 1, 19),
    "depthwise_vectorized": (32, 32, 3, 2, 1, 32),  # channel runs loaded 4 or 8 at a time
}
ACTS = [Activation.RELU, Activation.SILU, Activation.NONE]


def _affine(channels: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[C, 2]``: scales not near 1 and shifts mostly positive, so that act(t) on the padding is not 0."""
    s = torch.rand(channels) + 0.5
    t = torch.randn(channels) * 0.5 + 0.75
    return torch.stack([s, t], 1).to(dtype)


def _prologue64(x: torch.Tensor, affine: torch.Tensor, act: Activation) -> torch.Tensor:
    s, t = (affine[:, i].double().reshape(1, -1, 1, 1) for i in (0, 1))
    return apply_activation_torch(x.double() * s + t, act)


@pytest.mark.parametrize("act", ACTS, ids=lambda a: a.name.lower())
@pytest.mark.parametrize("name", list(CONVS))
def test_kernels_apply_the_affine_prologue_as_they_load_the_operand(name: str, act: Activation) -> None:
    c_in, c_out, k, stride, pad, groups = CONVS[name]
    x = torch.randn(2, c_in, 11, 9).to(memory_format=torch.channels_last)
    w, b = torch.randn(c_out, c_in // groups, k, k), torch.randn(c_out)
    affine = _affine(c_in)
    ref = F.conv2d(_prologue64(x, affine, act), w.double(), b.double(), stride, pad, 1, groups)
    packed = pack_conv_weight(w, "ieee", groups=groups)
    out = conv2d_act(x, packed, b, stride=stride, padding=pad, interpret=True, input_affine=affine, input_act=act)
    assert_close(out, ref, "ieee", name)
    plain = conv2d_act(x, packed, b, stride=stride, padding=pad, interpret=True)
    assert (out - plain).abs().max() > 1e-2  # the same plan cache, another plan: the prologue is not dropped


def test_padding_stays_zero_after_the_activation() -> None:
    """conv(pad(relu(x * s + t))), not conv(relu(pad(x) * s + t)): with shifts > 0 the two differ at the border."""
    x = torch.randn(2, 21, 7, 5).to(memory_format=torch.channels_last)
    w, affine = torch.randn(13, 21, 3, 3), _affine(21)
    affine[:, 1] = torch.rand(21) + 1.0
    good = F.conv2d(_prologue64(x, affine, Activation.RELU), w.double(), padding=2)
    wrong = F.conv2d(_prologue64(F.pad(x, (2, 2, 2, 2)), affine, Activation.RELU), w.double())
    out = conv2d_act(x, pack_conv_weight(w, "ieee"), padding=2, interpret=True, input_affine=affine, input_act=1)
    assert_close(out, good, "ieee")
    assert (out.double() - wrong).abs().max() > 1.0


def test_split_k_and_nchw_input_keep_the_prologue() -> None:
    x = torch.randn(2, 45, 5, 7)  # NCHW: channels 35 apart
    w, affine = torch.randn(13, 45, 1, 1), _affine(45)
    ref = F.conv2d(_prologue64(x, affine, Activation.SILU), w.double())
    for tile in (TileConfig(32, 32, 16, 1, 4, 1, split_k=3), None):
        out = conv2d_act(x, pack_conv_weight(w, "ieee"), interpret=True, input_affine=affine, input_act=4, tile=tile)
        assert_close(out, ref, "ieee", f"tile {tile}")


def test_gemm_act_takes_an_affine_prologue_over_k() -> None:
    a, w = torch.randn(3, 5, 19), torch.randn(7, 19)
    affine = _affine(19)
    out = gemm_act(a, pack_gemm_weight(w, "ieee"), interpret=True, input_affine=affine, input_act=1)
    ref = torch.relu(a.double() * affine[:, 0].double() + affine[:, 1].double()) @ w.double().T
    assert_close(out, ref, "ieee")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_input_rounds_the_activated_value_to_its_dtype(dtype: torch.dtype) -> None:
    x = torch.randn(2, 19, 7, 7).to(dtype)
    w, affine = torch.randn(11, 19, 3, 3).to(dtype), _affine(19)
    ref = F.conv2d(_prologue64(x, affine, Activation.RELU).to(dtype).double(), w.double(), padding=1)
    out = conv2d_act(x, pack_conv_weight(w, "ieee"), padding=1, interpret=True, input_affine=affine, input_act=1)
    assert_close(out, ref, "bf16")


def test_bad_affines_are_refused_by_name() -> None:
    x, w = torch.randn(2, 19, 7, 7), pack_conv_weight(torch.randn(11, 19, 1, 1), "ieee")
    with pytest.raises(ValueError, match=r"input_affine must have shape \[19, 2\].*\(19, 3\)"):
        conv2d_act(x, w, interpret=True, input_affine=torch.rand(19, 3), input_act=1)
    with pytest.raises(ValueError, match="contiguous float32"):
        conv2d_act(x, w, interpret=True, input_affine=_affine(19, torch.float64), input_act=1)
    with pytest.raises(ValueError, match="without a parameter"):
        conv2d_act(x, w, interpret=True, input_affine=_affine(19), input_act=int(Activation.LEAKY_RELU))
    with pytest.raises(ValueError, match="input_scale and input_affine"):
        conv2d_act(x, w, interpret=True, input_affine=_affine(19), input_scale=torch.rand(2, 19, 1, 1))
    rgb = pack_conv_weight(torch.randn(8, 3, 3, 3), "ieee")
    with pytest.raises(ValueError, match="input_affine is not supported by the direct conv kernel"):
        conv2d_act(torch.randn(1, 3, 9, 9), rgb, interpret=True, input_affine=_affine(3), input_act=1)


# ---------------------------------------------------------------------------------------------------------
# The graph pass


class DenseLayer(nn.Module):
    """torchvision's dense layer: cat -> BN -> ReLU -> conv (1x1, or 3x3 padded) -> BN -> ReLU -> 3x3 conv."""

    def __init__(self, c_in: int, growth: int, k: int) -> None:
        super().__init__()
        self.norm1, self.relu1 = nn.BatchNorm2d(c_in), nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(c_in, 2 * growth, k, padding=k // 2, bias=False)
        self.norm2, self.relu2 = nn.BatchNorm2d(2 * growth), nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(2 * growth, growth, 3, padding=1, bias=False)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        x = self.conv1(self.relu1(self.norm1(torch.cat(features, 1))))
        return self.conv2(self.relu2(self.norm2(x)))


class TinyDenseNet(nn.Module):
    """Two dense layers, a transition (BN -> ReLU -> 1x1 conv -> avg pool), a last BN -> ReLU -> pool -> linear."""

    def __init__(self, k: int = 1, c: int = 37, growth: int = 13, classes: int = 7) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.layer1, self.layer2 = DenseLayer(c, growth, k), DenseLayer(c + growth, growth, k)
        self.transition = nn.Sequential(
            nn.BatchNorm2d(c + 2 * growth), nn.ReLU(), nn.Conv2d(c + 2 * growth, 29, 1, bias=False), nn.AvgPool2d(2)
        )
        self.norm5 = nn.BatchNorm2d(29)
        self.classifier = nn.Linear(29, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [self.stem(x)]
        features.append(self.layer1(features))
        features.append(self.layer2(features))
        x = self.transition(torch.cat(features, 1))
        x = F.adaptive_avg_pool2d(F.relu(self.norm5(x)), 1)
        return self.classifier(torch.flatten(x, 1))


def _model(cls: type[nn.Module] = TinyDenseNet, **kwargs) -> nn.Module:
    return randomize_batchnorm(cls(**kwargs)).eval()


def _kinds(fast: nn.Module, kind: str) -> list:
    return [r for r in fast.fusion_report.rewrites if r.kind == kind]


def _batch_norms_left(fast: nn.Module) -> int:
    """BatchNorms the optimized module's graphs still run: F.batch_norm calls and BatchNorm module calls."""
    count = 0
    for gm in (m for m in fast.modules() if isinstance(m, torch.fx.GraphModule)):
        modules = dict(gm.named_modules())
        for n in gm.graph.nodes:
            called = modules.get(str(n.target)) if n.op == "call_module" else None
            count += n.target is F.batch_norm or isinstance(called, nn.modules.batchnorm._BatchNorm)
    return count


@pytest.mark.parametrize("backend", ["torch", "interpret"])
@pytest.mark.parametrize("k", [1, 3], ids=["1x1", "3x3_padded"])
def test_densenet_batch_norms_after_a_cat_go_into_the_convs(backend: str, k: int) -> None:
    model = _model(k=k)
    state = copy.deepcopy(model.state_dict())
    x = torch.randn(2, 3, 11, 9)
    fast = fuser.optimize(model, (x,), precision="ieee", backend=backend)
    report = str(fast.fusion_report)
    folded = _kinds(fast, "batch_norm_prologue")
    assert sorted(r.location for r in folded) == ["layer1.norm1", "layer2.norm1", "transition.0"], report
    assert all("relu" in r.detail and len(r.eliminated) == 2 for r in folded), report
    # the transition's bias-free conv is fused alone by the matcher because a BatchNorm prologue can go into it
    fused = [(e.pattern, *e.modules) for e in fast.fusion_report.fused]
    assert ("conv", "transition.2") in fused, report
    # the dense layers' last convs and the stem feed the concatenations, which their cat buffers take
    assert {("conv", m) for m in ("stem", "layer1.conv2", "layer2.conv2")} <= set(fused), report
    assert len(_kinds(fast, "cat_buffer")) == 3, report
    (kept,) = _kinds(fast, "batch_norm_kept")
    assert kept.location == "norm5" and "fused_channel_mean" in kept.detail and not kept.eliminated, report
    (rejected,) = fast.fusion_report.rejected  # the lone BN the matcher named: norm5 only, with both reasons
    assert rejected.modules == ["norm5"] and "kept" in rejected.reason, report
    assert _batch_norms_left(fast) == 1
    prologues = [m for m in fast.modules() if isinstance(m, FusedConv2d) and m.input_affine is not None]
    assert len(prologues) == 3 and all(m.input_act == int(Activation.RELU) for m in prologues)
    with torch.no_grad():
        assert_close(fast(x), reference64(model, x), "ieee", backend)
        x2 = torch.randn(3, 3, 9, 13)  # another batch and size than the example
        assert_close(fast(x2), reference64(model, x2), "ieee", f"{backend}, second shape")
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())  # the user's model is untouched
    assert not any(isinstance(m, FusedConv2d) for m in model.modules())


class LevitHead(nn.Module):
    """timm LeViT's head: mean over tokens -> BatchNorm1d -> Dropout (eval) -> Linear, and a second head."""

    def __init__(self, c: int = 37, classes: int = 11) -> None:
        super().__init__()
        self.proj = nn.Linear(19, c)
        self.bn, self.drop, self.fc = nn.BatchNorm1d(c), nn.Dropout(0.3), nn.Linear(c, classes)
        self.bn_dist, self.fc_dist = nn.BatchNorm1d(c), nn.Linear(c, classes, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.proj(x)).mean(1)
        return self.fc(self.drop(self.bn(x))) + self.fc_dist(self.bn_dist(x))


@pytest.mark.parametrize("backend", ["torch", "interpret"])
def test_levit_batchnorm1d_before_the_linear_goes_into_its_weights(backend: str) -> None:
    model = _model(LevitHead)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(3, 5, 19)
    fast = fuser.optimize(model, (x,), precision="ieee", backend=backend)
    folded = _kinds(fast, "batch_norm_into_weights")
    assert sorted(r.location for r in folded) == ["bn", "bn_dist"], str(fast.fusion_report)
    assert not _kinds(fast, "batch_norm_kept") and not fast.fusion_report.rejected
    assert _batch_norms_left(fast) == 0
    with torch.no_grad():
        assert_close(fast(x), reference64(model, x), "ieee", backend)
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    heads = [m for m in fast.modules() if isinstance(m, FusedLinear) and m.weight.shape[0] == 11]
    assert len(heads) == 2 and all(not torch.equal(m.weight, model.fc.weight) for m in heads)


class BnConv(nn.Module):
    """BN straight into a conv (no activation): unpadded ungrouped -> its weights; padded -> the prologue."""

    def __init__(self, padding: int) -> None:
        super().__init__()
        self.conv0 = nn.Conv2d(5, 23, 3)
        self.bn, self.conv = nn.BatchNorm2d(23), nn.Conv2d(23, 17, 3, padding=padding, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.bn(torch.tanh(self.conv0(x))))


@pytest.mark.parametrize(("padding", "kind"), [(0, "batch_norm_into_weights"), (1, "batch_norm_prologue")])
def test_a_batchnorm_read_by_a_conv_folds_into_weights_or_prologue(padding: int, kind: str) -> None:
    model, x = _model(BnConv, padding=padding), torch.randn(2, 5, 13, 11)
    for backend in ("torch", "interpret"):
        fast = fuser.optimize(model, (x,), precision="ieee", backend=backend)
        assert [r.location for r in _kinds(fast, kind)] == ["bn"], str(fast.fusion_report)
        assert _batch_norms_left(fast) == 0
        with torch.no_grad():
            assert_close(fast(x), reference64(model, x), "ieee", backend)


class SharedCat(nn.Module):
    """One concatenation read by two BN -> ReLU -> conv branches (each BN has one user): both fold."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 21, 3, padding=1), nn.Conv2d(3, 16, 1)
        self.bn1, self.conv1 = nn.BatchNorm2d(37), nn.Conv2d(37, 11, 1)
        self.bn2, self.conv2 = nn.BatchNorm2d(37), nn.Conv2d(37, 13, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = torch.cat([self.a(x), self.b(x)], 1)
        return torch.cat([self.conv1(F.relu(self.bn1(c))), self.conv2(F.silu(self.bn2(c)))], 1)


def test_one_concat_read_by_two_batchnorm_branches() -> None:
    model, x = _model(SharedCat), torch.randn(2, 3, 9, 7)
    fast = fuser.optimize(model, (x,), precision="ieee", backend="interpret")
    assert sorted(r.location for r in _kinds(fast, "batch_norm_prologue")) == ["bn1", "bn2"]
    with torch.no_grad():
        assert_close(fast(x), reference64(model, x), "ieee")


class TwoUsers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn, self.conv = nn.Conv2d(3, 19, 3), nn.BatchNorm2d(19), nn.Conv2d(19, 11, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.bn(torch.sigmoid(self.a(x)))
        return self.conv(F.relu(y)), y.mean()


class LeakyBefore(TwoUsers):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.leaky_relu(self.bn(torch.sigmoid(self.a(x))), 0.2))


class RgbConv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn, self.conv = nn.BatchNorm2d(3), nn.Conv2d(3, 11, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.relu(self.bn(x)))


class ActBeforeLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn, self.fc = nn.BatchNorm1d(19), nn.Linear(19, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.relu(self.bn(x)))


@pytest.mark.parametrize(
    ("cls", "shape", "reason"),
    [
        (TwoUsers, (2, 3, 9, 7), "has 2 users"),
        (LeakyBefore, (2, 3, 9, 7), "leaky_relu has a parameter"),
        (RgbConv, (2, 3, 9, 7), "runs on the direct conv, which has no operand prologue"),
        (ActBeforeLinear, (5, 19), "a GEMM has no affine prologue"),
    ],
    ids=["two_users", "leaky_relu", "rgb_direct_conv", "act_before_linear"],
)
def test_near_misses_stay_with_their_reason_and_are_right(cls: type[nn.Module], shape: tuple, reason: str) -> None:
    model, x = _model(cls), torch.randn(*shape)
    fast = fuser.optimize(model, (x,), precision="ieee", backend="interpret")
    assert not any(_kinds(fast, kind) for kind in BATCH_NORM_FOLDS), str(fast.fusion_report)
    (kept,) = _kinds(fast, "batch_norm_kept")
    assert reason in kept.detail and kept.location == "bn", kept.detail
    with torch.no_grad():
        got, want = fast(x), reference64(model, x)
    as_tuple = lambda t: t if isinstance(t, tuple) else (t,)
    for g, r in zip(as_tuple(got), as_tuple(want), strict=True):
        assert_close(g, r, "ieee", cls.__name__)


def _prologue_conv(fast: nn.Module) -> FusedConv2d:
    return next(m for m in fast.modules() if isinstance(m, FusedConv2d) and m.input_affine is not None)


def test_custom_op_gives_what_the_eager_shortcut_gives() -> None:
    model, x = _model(k=3), torch.randn(2, 3, 11, 9)
    fast = fuser.optimize(model, (x,), precision="ieee", backend="interpret")
    with torch.no_grad():
        eager = fast(x)
    assert_close(compile_once(fast, x), eager.double(), "ieee", "torch.compile (custom ops) against eager")
    conv = _prologue_conv(fast)
    h = torch.randn(2, conv.weight.shape[1], 7, 5)
    with torch.no_grad():
        direct = conv(h)
        op = torch.ops.fuser.conv2d_act(h, conv.weight, conv.bias, None, conv.packed, *conv._op_args, None, None, 1,
                                        conv.input_affine, conv.input_act)  # fmt: skip
    assert_close(op, direct.double(), "ieee", "the op against the module's eager call")
    args = (h, conv.weight, conv.bias, None, conv.packed, *conv._op_args, None, None, 1, conv.input_affine, 1)
    torch.library.opcheck(torch.ops.fuser.conv2d_act.default, args, test_utils=("test_schema", "test_faketensor"))


def test_onnx_export_applies_bn_and_relu_before_the_conv_and_matches_onnxruntime(tmp_path: Path) -> None:
    model = _model(k=3)
    fast = fuser.optimize(model, (torch.randn(2, 3, 11, 9),), precision="ieee", backend="torch")
    path = export_onnx(fast, (torch.randn(2, 3, 11, 9),), tmp_path / "dense.onnx")
    ops = [n.op_type for n in exported_standard(path).graph.node]
    # norm5 stays a BatchNorm (torch's exporter writes it as one); the three prologues are Mul, Add, Relu
    assert ops.count("BatchNormalization") <= 1 and ops.count("Relu") >= 4 and ops.count("Mul") >= 3, ops
    for batch in (1, 3):  # the exported batch axis is dynamic
        inputs = torch.randn(batch, 3, 11, 9)
        assert_close(run_onnxruntime(path, inputs)[0], reference64(model, inputs), "ieee", f"onnxruntime, {batch}")


def test_save_load_and_casts_keep_the_prologue() -> None:
    model, x = _model(), torch.randn(2, 3, 11, 9)
    fast = fuser.optimize(model, (x,), precision="ieee", backend="interpret")
    buffer = io.BytesIO()
    torch.save(fast, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with torch.no_grad():
        assert torch.equal(loaded(x), fast(x))
    assert any(k.endswith("input_affine") for k in _prologue_conv(fast).state_dict())
    double = copy.deepcopy(fast).double()  # float64 runs the reference; the prologue's constants stay float32
    assert _prologue_conv(double).input_affine.dtype == torch.float32
    with torch.no_grad():
        assert_close(double(x.double()), reference64(model, x), "ieee", "float64")


# ---------------------------------------------------------------------------------------------------------
# GPU (compiled Triton kernels)


GPU_CASES = [(n, p) for n in CONVS for p in ("auto", "pointer") if not n.startswith("depthwise") or p == "auto"]


@pytest.mark.gpu
@pytest.mark.parametrize(("name", "path"), GPU_CASES)  # the depthwise kernel has one path
@pytest.mark.parametrize("precision", ["tf32", "fp16"])
def test_gpu_kernels_apply_the_affine_prologue(name: str, path: str, precision: str) -> None:
    c_in, c_out, k, stride, pad, groups = CONVS[name]
    dtype = torch.float16 if precision == "fp16" else torch.float32
    x = torch.randn(3, c_in, 13, 11, device="cuda").to(dtype).to(memory_format=torch.channels_last)
    w, b = torch.randn(c_out, c_in // groups, k, k, device="cuda").to(dtype), torch.randn(c_out, device="cuda")
    affine = _affine(c_in).cuda()
    xin = _prologue64(x, affine, Activation.RELU)
    ref = F.conv2d(xin.to(dtype).double(), w.double(), b.double(), stride, pad, 1, groups)
    out = conv2d_act(x, pack_conv_weight(w, precision, groups=groups), b, stride=stride, padding=pad, path=path,
                     input_affine=affine, input_act=int(Activation.RELU))  # fmt: skip
    assert_close(out, ref, "tf32" if precision == "tf32" else "fp16", f"{name} {path} {precision}")


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["tf32", "fp16"])
def test_gpu_densenet_like_model_folds_its_batch_norms(precision: str) -> None:
    model = _model(k=3, c=53, growth=19).cuda()
    x = torch.randn(2, 3, 29, 27, device="cuda")
    fast = fuser.optimize(copy.deepcopy(model), (x,), precision=precision)
    assert len(_kinds(fast, "batch_norm_prologue")) == 3, str(fast.fusion_report)
    with torch.no_grad():
        for _ in range(2):  # the second call replays the CUDA graph
            out = fast(x)
    assert_close(out, reference64(model, x), "tf32" if precision == "tf32" else "fp16")
