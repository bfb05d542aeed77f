"""Weights computed from parameters alone are computed once (fuser.canonicalize.constant_folding, and the
parametrized-layer rule of fuser.canonicalize.layers), so the convs that read them fuse.

The replicas copy the forward of timm's ``ScaledStdConv2d`` (NFNets) and ``StdConv2d`` (BiT ResNetV2) as timm
writes it; the parametrizations are torch's own. The tests that fold compare with a float64 run of the
original and check that the tensors the weight was computed from are gone from the optimized module. What must
not fold (a gather that grows a table, random numbers, a parameter other ops still read or the forward writes)
stays in the graph and behaves as in the original.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from accuracy import fused_ops, optimize_and_compare
from torch import nn
from torch.nn.utils import parametrizations
from toy_models import seeded

import fuser
from fuser.canonicalize import fold_constants
from fuser.capture.tracing import trace


def elements(module: nn.Module) -> int:
    """The elements of every tensor ``module`` holds (parameters and buffers, persistent or not), each once."""
    tensors = {t.data_ptr(): t.numel() for _, t in [*module.named_parameters(), *module.named_buffers()]}
    return sum(tensors.values())


class ScaledStdConv2d(nn.Conv2d):
    """timm.layers.std_conv.ScaledStdConv2d: the weight standardized per output channel in every forward."""

    def __init__(self, c_in: int, c_out: int, k: int, gamma: float = 1.0, eps: float = 1e-6) -> None:
        super().__init__(c_in, c_out, k, padding=k // 2, bias=True)
        self.gain = nn.Parameter(torch.full((c_out, 1, 1, 1), 1.0))
        self.scale = gamma * self.weight[0].numel() ** -0.5
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = F.batch_norm(
            self.weight.reshape(1, self.out_channels, -1),
            None,
            None,
            weight=(self.gain * self.scale).view(-1),
            training=True,
            momentum=0.0,
            eps=self.eps,
        ).reshape_as(self.weight)
        return F.conv2d(x, weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class StdConv2d(nn.Conv2d):
    """timm.layers.std_conv.StdConv2d (BiT): standardized without a gain."""

    def __init__(self, c_in: int, c_out: int, k: int, eps: float = 1e-8) -> None:
        super().__init__(c_in, c_out, k, padding=k // 2, bias=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = F.batch_norm(
            self.weight.reshape(1, self.out_channels, -1), None, None, training=True, momentum=0.0, eps=self.eps
        ).reshape_as(self.weight)
        return F.conv2d(x, weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class NfBlock(nn.Module):
    """An NFNet-style pair: std conv -> GELU -> std conv, plus the input (the residual)."""

    def __init__(self, conv: type[nn.Conv2d], c: int = 13) -> None:
        super().__init__()
        self.conv1 = conv(c, 19, 3)
        self.conv2 = conv(19, c, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(F.gelu(self.conv1(x))) + x


@pytest.mark.parametrize("conv", [ScaledStdConv2d, StdConv2d], ids=lambda c: c.__name__)
def test_standardized_weights_are_folded_and_the_convs_fuse(conv: type[nn.Conv2d]):
    model = seeded(NfBlock(conv))
    opt = optimize_and_compare(model, torch.randn(2, 13, 11, 9))
    assert fused_ops(opt) == [["conv2d", "gelu"], ["conv2d", "add"]], str(opt.fusion_report)
    assert opt.fusion_report.rules_fired.get("constant_folding") == 2, opt.fusion_report.rules_fired
    assert F.batch_norm not in [n.target for n in opt.module.graph.nodes]
    # the standardized weights replace the raw ones (and the gains): no tensor is kept twice
    assert elements(opt) <= elements(model), sorted(opt.state_dict())


class WeightNormed(nn.Module):
    def __init__(self, parametrization) -> None:
        super().__init__()
        self.conv = parametrization(nn.Conv2d(5, 7, 3, padding=1))
        self.fc = parametrization(nn.Linear(7, 11))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.silu(self.conv(x))
        return F.relu(self.fc(y.mean((2, 3))))


@pytest.mark.parametrize(
    "parametrization", [parametrizations.weight_norm, parametrizations.spectral_norm], ids=["weight", "spectral"]
)
def test_parametrized_conv_and_linear_fuse_with_their_weight_computed_once(parametrization):
    model = seeded(WeightNormed(parametrization))
    opt = optimize_and_compare(model, torch.randn(3, 5, 13, 7))
    assert fused_ops(opt) == [["conv2d", "silu"], ["linear", "relu"]], str(opt.fusion_report)
    assert opt.fusion_report.rules_fired.get("parametrized_layer") == 2, opt.fusion_report.rules_fired
    assert not [k for k in opt.state_dict() if "parametrizations" in k]


def test_a_parametrized_layer_in_training_mode_is_left_alone():
    model = seeded(WeightNormed(parametrizations.weight_norm))
    model.conv.train()
    report = fuser.explain(model, (torch.randn(3, 5, 13, 7),))
    assert "parametrized_layer" not in report.rules_fired or report.rules_fired["parametrized_layer"] == 1
    assert [c.ops for c in report.fused] == [["linear", "relu"]], str(report)


class AttentionBiasTable(nn.Module):
    """timm's LeViT attention biases: a (heads, offsets) table gathered into (heads, N, N) in every forward."""

    def __init__(self, heads: int = 3, side: int = 5) -> None:
        super().__init__()
        points = [(i, j) for i in range(side) for j in range(side)]
        offsets: dict[tuple[int, int], int] = {}
        idxs = []
        for p1 in points:
            for p2 in points:
                offset = (abs(p1[0] - p2[0]), abs(p1[1] - p2[1]))
                idxs.append(offsets.setdefault(offset, len(offsets)))
        self.attention_biases = nn.Parameter(torch.zeros(heads, len(offsets)))
        self.register_buffer("attention_bias_idxs", torch.tensor(idxs).view(side * side, side * side), False)
        self.qk = nn.Linear(9, 2 * heads * 4)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k = self.qk(x).view(b, n, 2, self.heads, 4).permute(2, 0, 3, 1, 4)
        return (q @ k.transpose(-2, -1)) + self.attention_biases[:, self.attention_bias_idxs]


def test_a_gather_that_grows_a_table_is_not_folded():
    model = seeded(AttentionBiasTable())
    opt = optimize_and_compare(model, torch.randn(2, 25, 9))
    assert "constant_folding" not in opt.fusion_report.rules_fired
    assert elements(opt) <= elements(model), sorted(opt.state_dict())
    assert "attention_bias_idxs" not in opt.state_dict() and "module.attention_bias_idxs" not in opt.state_dict()


class RandomWeightNoise(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.conv.weight + 1e-3 * torch.randn_like(self.conv.weight), self.conv.bias)


def test_random_numbers_are_not_folded():
    model, x = seeded(RandomWeightNoise()), torch.randn(2, 3, 9, 7)
    opt = fuser.optimize(model, (x,), backend="torch")
    assert "constant_folding" not in opt.fusion_report.rules_fired
    with torch.no_grad():
        assert not torch.equal(opt(x), opt(x))


class TransposedAndRead(nn.Module):
    """``w.t()`` feeds a matmul while ``w`` itself is read too: a folded transpose would be a second copy."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(11, 7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w.t() + self.w.sum(1)


def test_a_parameter_other_ops_still_read_is_not_copied():
    model = seeded(TransposedAndRead())
    opt = optimize_and_compare(model, torch.randn(3, 7))
    assert "constant_folding" not in opt.fusion_report.rules_fired
    assert elements(opt) <= elements(model), sorted(opt.state_dict())


def test_the_users_model_keeps_its_parametrization_and_weights():
    model = seeded(NfBlock(ScaledStdConv2d))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fuser.optimize(model, (torch.randn(2, 13, 11, 9),), backend="torch")
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


class PositionalConvEmbedding(nn.Module):
    """transformers' Wav2Vec2PositionalConvEmbedding (a grouped Conv1d under weight_norm over dim 2, GELU) added
    to its input, then a linear -> ReLU that fuses."""

    def __init__(self, hidden: int = 24, kernel: int = 7, groups: int = 4) -> None:
        super().__init__()
        conv = nn.Conv1d(hidden, hidden, kernel_size=kernel, padding=kernel // 2, groups=groups)
        self.conv = parametrizations.weight_norm(conv, name="weight", dim=2)
        self.out = nn.Linear(hidden, 11)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.conv(hidden_states.transpose(1, 2)))
        return F.relu(self.out(hidden_states + x.transpose(1, 2)))


def test_a_parametrized_conv1d_is_computed_once_so_the_model_saves_whole(tmp_path):
    """torch.save refuses a module that holds a parametrization: the original cannot be saved whole, the
    optimized one can, since its Conv1d reads the weight computed once."""
    model, x = seeded(PositionalConvEmbedding()), torch.randn(2, 17, 24)
    opt = optimize_and_compare(model, x)
    assert fused_ops(opt) == [["linear", "relu"]], str(opt.fusion_report)
    assert opt.fusion_report.rules_fired.get("parametrized_layer") == 1, opt.fusion_report.rules_fired
    with pytest.raises(RuntimeError, match="parametrized modules"):
        torch.save(model, tmp_path / "original.pt")
    torch.save(opt, tmp_path / "optimized.pt")
    loaded = torch.load(tmp_path / "optimized.pt", weights_only=False)
    with torch.no_grad():
        assert torch.equal(loaded(x), opt(x))


class QkvBias(nn.Module):
    """timm's EVA attention: the qkv bias concatenated in every forward from q and v biases and a zero k bias
    that the model keeps out of its state dict (``persistent=False``)."""

    def __init__(self, dim: int = 15) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.q_bias = nn.Parameter(torch.randn(dim))
        self.register_buffer("k_bias", torch.zeros(dim), persistent=False)
        self.v_bias = nn.Parameter(torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv_bias = torch.cat((self.q_bias, self.k_bias, self.v_bias))
        return F.silu(F.linear(x, self.qkv.weight, qkv_bias))


def test_a_value_folded_from_a_non_persistent_buffer_stays_out_of_the_state_dict():
    model = seeded(QkvBias())
    graph_module = trace(model)
    assert fold_constants(graph_module) == 1
    (folded,) = [name for name, _ in graph_module.named_buffers() if name.endswith("_folded")]
    assert folded not in graph_module.state_dict()  # built from k_bias, which the model's state dict leaves out
    opt = optimize_and_compare(model, torch.randn(3, 5, 15))
    assert fused_ops(opt) == [["linear", "silu"]], str(opt.fusion_report)
    assert elements(opt) <= elements(model), sorted(opt.state_dict())


class CosineClassifier(nn.Module):
    """A cosine-similarity head (face recognition's ArcFace, few-shot classifiers): the class weights are
    normalized in every forward with F.normalize, whose name must not read as a random op's."""

    def __init__(self, features: int = 19, classes: int = 13) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(classes, features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(F.linear(F.normalize(x, dim=1), F.normalize(self.weight, dim=1)))


def test_a_normalized_weight_is_folded():
    model = seeded(CosineClassifier())
    opt = optimize_and_compare(model, torch.randn(5, 19))
    assert opt.fusion_report.rules_fired.get("constant_folding") == 1, opt.fusion_report.rules_fired
    assert fused_ops(opt) == [["linear", "relu"]], str(opt.fusion_report)
    assert elements(opt) <= elements(model), sorted(opt.state_dict())


class ElusItsWeight(nn.Module):
    """A forward that writes its (frozen) weight in place at every call: ELU again, so the weight, and the
    output, change from call to call. The write must run each time, as in the original."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(11, 7), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ F.elu(self.w, inplace=True).t()


def test_a_parameter_written_in_place_is_not_folded():
    model, x = seeded(ElusItsWeight()), torch.randn(3, 7)
    opt = fuser.optimize(model, (x,), backend="torch")
    assert "constant_folding" not in opt.fusion_report.rules_fired
    with torch.no_grad():
        first, second = opt(x), opt(x)
    assert not torch.allclose(first, second)  # the second call reads the weight the first one wrote
