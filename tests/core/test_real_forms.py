"""The forms real libraries write, as faithful replicas of their code (the libraries are not needed).

Each replica copies the forward of the library's layer as that library writes it: ultralytics' Conv after
``model.fuse()``, timm's BatchNormAct2d, torchvision's BasicBlock, transformers' BERT output block and
GPT-2's Conv1D MLP. Every test compares with a float64 run of the original and checks the report.
"""

from __future__ import annotations

import copy
import math
import types

import pytest
import torch
import torch.nn.functional as F
from accuracy import assert_close, fused_ops, optimize_and_compare, reference64
from torch import nn
from toy_models import seeded

import fuser

# ---------------------------------------------------------------------------------------------------------
# The forward the instance runs


class UltralyticsConv(nn.Module):
    """ultralytics.nn.modules.conv.Conv: conv -> BN -> SiLU; ``fuse()`` folds BN into the conv, deletes ``bn``
    and sets ``m.forward = m.forward_fuse``."""

    default_act = nn.SiLU()

    def __init__(self, c1: int, c2: int, k: int = 1, s: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c1, c2, k, s, k // 2, bias=False)
        self.bn = nn.BatchNorm2d(c2)
        self.act = self.default_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x)))

    def forward_fuse(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.conv(x))


def ultralytics_fuse(model: nn.Module) -> nn.Module:
    """What ultralytics' BaseModel.fuse() does to every Conv."""
    for m in model.modules():
        if isinstance(m, UltralyticsConv) and hasattr(m, "bn"):
            m.conv = torch.nn.utils.fusion.fuse_conv_bn_eval(m.conv, m.bn)
            delattr(m, "bn")
            m.forward = m.forward_fuse
    return model


class RoutedDetector(nn.Module):
    """A parent torch.fx cannot trace (its forward branches on a value), so each block is traced alone."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([UltralyticsConv(3, 8, 3, 2), UltralyticsConv(8, 13, 3), UltralyticsConv(13, 7)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.layers:
            x = m(x)
        return x if bool(x.isfinite().all()) else x.nan_to_num()


class SkipsBn(nn.Module):
    """A block whose instance forward was replaced by one that skips the BN and uses another activation."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(5, 7, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))

    def forward_silu(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.conv(x))


@pytest.mark.parametrize("nested", [False, True], ids=["root", "child"])
def test_instance_forward_is_what_is_traced(nested):
    block = seeded(SkipsBn())
    block.forward = block.forward_silu
    model = nn.Sequential(block, nn.Conv2d(7, 5, 1)).eval() if nested else block
    x = torch.randn(2, 5, 11, 9)
    opt = optimize_and_compare(model, x)
    assert ["conv2d", "silu"] in fused_ops(opt)
    assert not any("batch_norm" in ops for ops in fused_ops(opt)), str(opt.fusion_report)


def test_ultralytics_conv_after_fuse():
    model = ultralytics_fuse(seeded(RoutedDetector()))
    x = torch.randn(2, 3, 21, 19)
    opt = optimize_and_compare(model, x)
    assert fused_ops(opt) == [["conv2d", "silu"]] * 3, str(opt.fusion_report)
    assert [u.path for u in opt.fusion_report.untraced] == ["(model)"]


def test_instance_forward_that_is_no_method_is_refused_with_a_message():
    block = seeded(SkipsBn())
    block.forward = types.MethodType(lambda self, x: F.silu(self.conv(x)), block)  # not a method of SkipsBn
    x = torch.randn(2, 5, 11, 9)
    opt = optimize_and_compare(block, x)
    assert not opt.fusion_report.fused
    (entry,) = [u for u in opt.fusion_report.untraced if u.path == "(model)"]
    assert "forward was replaced on the instance" in entry.reason


# ---------------------------------------------------------------------------------------------------------
# Training mode: the shape-propagation forward never moves buffers


def conv3x3(c_in: int, c_out: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)


class BasicBlock(nn.Module):
    """torchvision.models.resnet.BasicBlock, as torchvision writes it (``out += identity``)."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


def buffers_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.named_buffers()}


def test_optimize_in_training_mode_leaves_running_statistics_alone():
    model = seeded(BasicBlock(5, 11, stride=2)).train()
    before = buffers_of(model)
    x = torch.randn(3, 5, 13, 11) * 2 + 1  # batch statistics far from the running ones
    opt = fuser.optimize(model, (x,), backend="torch")
    for name, value in buffers_of(model).items():
        assert torch.equal(value, before[name]), f"the user's {name} moved"
    kept = buffers_of(opt.module)
    for name, value in before.items():
        assert torch.equal(kept[name], value), f"the optimized module's {name} moved"
    assert not opt.fusion_report.fused
    assert all("training mode" in e.reason for e in opt.fusion_report.rejected), str(opt.fusion_report)
    with torch.no_grad():
        assert_close(opt.eval()(x), reference64(model.eval(), x), "ieee")


def test_explain_in_training_mode_leaves_running_statistics_alone():
    model = seeded(BasicBlock(5, 11)).train()
    before = buffers_of(model)
    report = fuser.explain(model, (torch.randn(3, 5, 13, 11) * 2 + 1,))
    assert report.rejected and not report.fused
    for name, value in buffers_of(model).items():
        assert torch.equal(value, before[name]), f"{name} moved"


def test_training_mode_dropout_does_not_advance_the_random_generator():
    model = nn.Sequential(nn.Linear(19, 21), nn.Dropout(0.3), nn.ReLU()).train()
    x = torch.randn(7, 19)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    fuser.optimize(model, (x,), backend="torch")
    assert torch.equal(torch.rand(3), expected)


# ---------------------------------------------------------------------------------------------------------
# Metadata reads are not users; Identity and inactive dropout vanish


def _assert(condition: bool, message: str) -> None:
    """timm.layers.trace_utils._assert: torch._assert where it exists."""
    torch._assert(condition, message)


class BatchNormAct2d(nn.BatchNorm2d):
    """timm.layers.norm_act.BatchNormAct2d, its forward as timm writes it."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1, act_layer=nn.ReLU) -> None:
        super().__init__(num_features, eps=eps, momentum=momentum)
        self.drop = nn.Identity()
        self.act = act_layer(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _assert(x.ndim == 4, f"expected 4D input (got {x.ndim}D input)")
        if self.momentum is None:  # noqa: SIM108  (timm's code, as written)
            exponential_average_factor = 0.0
        else:
            exponential_average_factor = self.momentum
        if self.training and self.track_running_stats:  # noqa: SIM102
            if self.num_batches_tracked is not None:
                self.num_batches_tracked.add_(1)
                if self.momentum is None:
                    exponential_average_factor = 1.0 / float(self.num_batches_tracked)
                else:
                    exponential_average_factor = self.momentum
        if self.training:  # noqa: SIM108
            bn_training = True
        else:
            bn_training = (self.running_mean is None) and (self.running_var is None)
        x = F.batch_norm(
            x,
            self.running_mean if not self.training or self.track_running_stats else None,
            self.running_var if not self.training or self.track_running_stats else None,
            self.weight,
            self.bias,
            bn_training,
            exponential_average_factor,
            self.eps,
        )
        x = self.drop(x)
        x = self.act(x)
        return x


class TimmConvNormAct(nn.Module):
    """timm.layers.conv_bn_act.ConvNormAct (conv, then BatchNormAct2d), with a residual and a shape assert."""

    def __init__(self, c_in: int, c_out: int, act_layer=nn.SiLU) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.bn = BatchNormAct2d(c_out, act_layer=act_layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.conv(x))
        _assert(y.shape[1] == x.shape[1], "channels")  # a shape read of the output, after the chain
        return y + x


def test_timm_batchnorm_act_fuses_with_the_conv_before_it():
    model = seeded(nn.Sequential(TimmConvNormAct(5, 5), TimmConvNormAct(5, 5, nn.ReLU)))
    x = torch.randn(2, 5, 13, 11)
    opt = optimize_and_compare(model, x)
    assert fused_ops(opt) == [["conv2d", "batch_norm", "silu", "add"], ["conv2d", "batch_norm", "relu", "add"]], str(
        opt.fusion_report
    )
    assert not opt.fusion_report.rejected
    x2 = torch.randn(3, 5, 7, 9)  # the metadata reads are still there and still right on another shape
    with torch.no_grad():
        assert_close(opt(x2), reference64(model, x2), "ieee")


class ShapeReadInside(nn.Module):
    """Metadata reads of every kind on the conv's output before the BN."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(5, 7, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        n, c = y.shape[0], y.size(1)
        _assert(y.dim() == 4, "rank")
        _assert(y.dtype == x.dtype, "dtype")
        z = F.relu(self.bn(y))
        return z * (n / c)


def test_metadata_reads_are_not_users():
    model = seeded(ShapeReadInside())
    x = torch.randn(2, 5, 9, 11)
    opt = optimize_and_compare(model, x)
    assert fused_ops(opt) == [["conv2d", "batch_norm", "relu"]], str(opt.fusion_report)


class BertOutput(nn.Module):
    """transformers' BertIntermediate + BertOutput: dense -> GELU, then dense -> dropout -> LayerNorm(+ input)."""

    def __init__(self, hidden: int = 19, intermediate: int = 45) -> None:
        super().__init__()
        self.intermediate = nn.Linear(hidden, intermediate)
        self.intermediate_act_fn = nn.GELU()
        self.dense = nn.Linear(intermediate, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=1e-12)
        self.dropout = nn.Dropout(0.1)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_tensor = hidden_states
        hidden_states = self.intermediate_act_fn(self.intermediate(hidden_states))
        hidden_states = self.dense(hidden_states)
        hidden_states = self.dropout(hidden_states)
        return self.LayerNorm(hidden_states + input_tensor)


def test_bert_dense_dropout_residual_fuses_in_eval():
    model = seeded(BertOutput())
    x = torch.randn(3, 7, 19)
    opt = optimize_and_compare(model, x)
    assert fused_ops(opt) == [["linear", "gelu"], ["linear", "add"]], str(opt.fusion_report)


class FunctionalDropouts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(19, 21)
        self.drop = nn.Dropout(0.2)
        self.ident = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.dropout(self.fc(x), 0.3, training=self.training)
        y = self.ident(torch.relu(self.drop(y)))
        return F.dropout(y, p=0.0) * 0.5


def test_inactive_dropouts_and_identity_vanish():
    model = seeded(FunctionalDropouts())
    x = torch.randn(5, 19)
    opt = optimize_and_compare(model, x)
    assert fused_ops(opt) == [["linear", "relu", "scale"]], str(opt.fusion_report)


def stochastic_depth(input: torch.Tensor, p: float, mode: str, training: bool = True) -> torch.Tensor:
    """torchvision.ops.stochastic_depth as torchvision writes it (a leaf for torch.fx, named as its module)."""
    if not training or p == 0.0:
        return input
    size = [input.shape[0]] + [1] * (input.ndim - 1) if mode == "row" else [1] * input.ndim
    noise = torch.empty(size, dtype=input.dtype, device=input.device).bernoulli_(1.0 - p)
    return input * noise.div_(1.0 - p)


stochastic_depth.__module__ = "torchvision.ops.stochastic_depth"
torch.fx.wrap("stochastic_depth")


class MBConvTail(nn.Module):
    """torchvision's MBConv end: projection conv -> BN, then ``stochastic_depth`` before the ``+ input``."""

    def __init__(self, c: int = 13) -> None:
        super().__init__()
        self.project = nn.Sequential(nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = stochastic_depth(self.project(x), 0.2, "row", self.training)
        result += x
        return result


def test_eval_stochastic_depth_vanishes_so_the_residual_fuses():
    model = seeded(MBConvTail())
    opt = optimize_and_compare(model, torch.randn(2, 13, 7, 9))
    assert fused_ops(opt) == [["conv2d", "batch_norm", "add"]], str(opt.fusion_report)


def test_training_mode_dropout_stays():
    model = seeded(FunctionalDropouts()).train()
    report = fuser.explain(model, (torch.randn(5, 19),))
    assert not report.fused, str(report)


# ---------------------------------------------------------------------------------------------------------
# GPT-2: Conv1D (addmm on the flattened input, viewed back) and the written-out new GELU


class Conv1D(nn.Module):
    """transformers.pytorch_utils.Conv1D: a linear layer with the weight transposed, on the flattened input."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.nx = nx
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = x.size()[:-1] + (self.nf,)  # noqa: RUF005  (transformers' code, as written)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        x = x.view(size_out)
        return x


class NewGELUActivation(nn.Module):
    """transformers.activations.NewGELUActivation (GPT-2's "gelu_new")."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return 0.5 * input * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (input + 0.044715 * torch.pow(input, 3.0))))


class GPT2MLP(nn.Module):
    """transformers' GPT2MLP, with the block's residual around it."""

    def __init__(self, intermediate_size: int = 45, embed_dim: int = 19) -> None:
        super().__init__()
        self.c_fc = Conv1D(intermediate_size, embed_dim)
        self.c_proj = Conv1D(embed_dim, intermediate_size)
        self.act = NewGELUActivation()
        self.dropout = nn.Dropout(0.1)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.c_fc(hidden_states)
        hidden_states = self.act(hidden_states)
        hidden_states = self.c_proj(hidden_states)
        hidden_states = self.dropout(hidden_states)
        return residual + hidden_states


def test_gpt2_conv1d_mlp_fuses_as_gemm_chains():
    model = seeded(GPT2MLP())
    with torch.no_grad():
        for conv in (model.c_fc, model.c_proj):
            conv.bias.normal_(0.0, 0.3)
    x = torch.randn(3, 7, 19)
    opt = optimize_and_compare(model, x)
    assert fused_ops(opt) == [["linear", "gelu_tanh"], ["linear", "add"]], str(opt.fusion_report)
    x2 = torch.randn(2, 5, 19)  # the leading dimensions come from the input, not from the example
    with torch.no_grad():
        assert_close(opt(x2), reference64(model, x2), "ieee")


def test_gpt2_mlp_holds_no_dead_weights():
    """transformers' GPT2MLP has its residual outside: c_proj stays an addmm, read as F.linear of its weight
    transposed into a new buffer, and the weight it replaced must not stay beside it."""

    class MLPWithoutResidual(GPT2MLP):
        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return self.dropout(self.c_proj(self.act(self.c_fc(hidden_states))))

    model = seeded(MLPWithoutResidual()).eval()
    opt = optimize_and_compare(model, torch.randn(3, 7, 19))
    assert fused_ops(opt) == [["linear", "gelu_tanh"]], str(opt.fusion_report)
    kept = {k: tuple(v.shape) for k, v in opt.state_dict().items()}
    assert sum(v.numel() for v in opt.state_dict().values()) == sum(p.numel() for p in model.parameters()), kept


def test_flatten_of_another_tensor_is_not_cancelled():
    class Mismatched(Conv1D):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            size_out = x.size()[:-1] + (self.nf,)  # noqa: RUF005  (transformers' code, as written)
            flat = x.transpose(0, 1).reshape(-1, x.size(-1))
            return torch.relu(torch.addmm(self.bias, flat, self.weight).view(size_out))

    model = seeded(Mismatched(21, 19))
    x = torch.randn(3, 7, 19)
    opt = optimize_and_compare(copy.deepcopy(model), x)
    assert not opt.fusion_report.fused


# ---------------------------------------------------------------------------------------------------------
# BatchNorms: folded into a linear before them, or reported with the reason they stay


class DenseLayer(nn.Module):
    """torchvision.models.densenet._DenseLayer (without the memory-efficient checkpointing)."""

    def __init__(self, num_input_features: int, growth_rate: int, bn_size: int) -> None:
        super().__init__()
        self.norm1 = nn.BatchNorm2d(num_input_features)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(num_input_features, bn_size * growth_rate, kernel_size=1, stride=1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth_rate)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(bn_size * growth_rate, growth_rate, kernel_size=3, stride=1, padding=1, bias=False)

    def bn_function(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        concated_features = torch.cat(inputs, 1)
        return self.conv1(self.relu1(self.norm1(concated_features)))

    def forward(self, input: list[torch.Tensor]) -> torch.Tensor:
        bottleneck_output = self.bn_function(input)
        return self.conv2(self.relu2(self.norm2(bottleneck_output)))


class DenseBlock(nn.ModuleDict):
    """torchvision.models.densenet._DenseBlock."""

    def __init__(self, num_layers: int, num_input_features: int, bn_size: int, growth_rate: int) -> None:
        super().__init__()
        for i in range(num_layers):
            layer = DenseLayer(num_input_features + i * growth_rate, growth_rate, bn_size)
            self.add_module(f"denselayer{i + 1}", layer)

    def forward(self, init_features: torch.Tensor) -> torch.Tensor:
        features = [init_features]
        for _, layer in self.items():
            features.append(layer(features))
        return torch.cat(features, 1)


def test_densenet_batchnorm_after_concat_goes_into_the_next_conv():
    model = seeded(DenseBlock(2, 5, 2, 3))
    x = torch.randn(2, 5, 9, 11)
    opt = optimize_and_compare(model, x)
    report = opt.fusion_report
    assert fused_ops(opt) == [["conv2d", "batch_norm", "relu"]] * 2, str(report)
    assert not [e for e in report.rejected if "batch_norm" in e.ops], str(report)  # no chain folds them, but:
    prologues = [r.location for r in report.rewrites if r.kind == "batch_norm_prologue"]
    assert prologues == ["denselayer1.norm1", "denselayer2.norm1"], str(report)


class LinearBn(nn.Module):
    """A linear layer followed by BatchNorm1d over its features, then an activation (MLP heads, LeViT)."""

    def __init__(self, k: int = 19, n: int = 21, bias: bool = True, eps: float = 1e-5) -> None:
        super().__init__()
        self.linear = nn.Linear(k, n, bias=bias)
        self.bn = nn.BatchNorm1d(n, eps=eps)
        self.act = nn.Hardswish()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.linear(x)))


@pytest.mark.parametrize(("bias", "eps"), [(True, 1e-5), (False, 0.3)], ids=["bias", "no-bias-large-eps"])
def test_linear_batchnorm1d_folds_into_the_linear(bias, eps):
    model = seeded(LinearBn(bias=bias, eps=eps))
    x = torch.randn(7, 19)
    opt = optimize_and_compare(model, x)
    assert fused_ops(opt) == [["linear", "batch_norm", "hardswish"]], str(opt.fusion_report)
    assert not any(isinstance(m, nn.BatchNorm1d) for m in opt.modules())


class LinearBnPerToken(nn.Module):
    """BatchNorm1d on a 3-D [batch, tokens, features] linear output: it normalizes the tokens, not features."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(19, 21)
        self.bn = nn.BatchNorm1d(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.linear(x))


def test_batchnorm1d_over_another_dimension_is_not_folded():
    model = seeded(LinearBnPerToken())
    opt = optimize_and_compare(model, torch.randn(3, 5, 19))
    assert not opt.fusion_report.fused
    (entry,) = opt.fusion_report.rejected
    assert "normalizes dimension 1 of a 3-D value" in entry.reason


class LeViTLinearNorm(nn.Module):
    """timm.models.levit.LinearNorm: BatchNorm1d on the flattened tokens, reshaped back."""

    def __init__(self, in_features: int = 19, out_features: int = 21) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=False)
        self.bn = nn.BatchNorm1d(out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        return self.bn(x.flatten(0, 1)).reshape_as(x)


def test_levit_linear_norm_folds_into_the_linear():
    model = seeded(LeViTLinearNorm())
    opt = optimize_and_compare(model, torch.randn(3, 5, 19))
    assert fused_ops(opt) == [["linear", "batch_norm"]], str(opt.fusion_report)
    x2 = torch.randn(2, 9, 19)  # other batch and token counts
    with torch.no_grad():
        assert_close(opt(x2), reference64(model, x2), "ieee")


class LeViTLinearNormAsImported(nn.Module):
    """LinearNorm as an ONNX import writes it: ``torch.flatten``, a functional batch norm, and a reshape to the
    linear output's sizes, read from it (``size_twice``: the batch size also scales the output)."""

    def __init__(self, size_twice: bool = False, last_read: bool = False) -> None:
        super().__init__()
        self.inner, self.size_twice, self.last_read = LeViTLinearNorm(), size_twice, last_read

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bn = self.inner.bn
        v = F.linear(x, self.inner.linear.weight)
        y = F.batch_norm(torch.flatten(v, 0, 1), bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, 1e-5)
        batch = v.size(0)
        out = torch.reshape(y, (batch, v.size(1), v.size(2) if self.last_read else 21))
        return out * batch if self.size_twice else out


def _folds_into_the_linear(model: nn.Module, other: tuple[int, ...]) -> None:
    """``model``'s linear -> BatchNorm1d is one fused chain, right at the traced shape and at ``other``."""
    opt = optimize_and_compare(model, torch.randn(3, 5, 19))
    assert fused_ops(opt) == [["linear", "batch_norm"]], str(opt.fusion_report)
    x2 = torch.randn(*other)
    with torch.no_grad():
        assert_close(opt(x2), reference64(model, x2), "ieee")


def _keeps_its_batch_norm(model: nn.Module, reason: str) -> None:
    """Nothing moves in ``model``: its one BatchNorm is reported unfused, for ``reason``."""
    opt = optimize_and_compare(model, torch.randn(3, 5, 19))
    stays = [e for e in opt.fusion_report.rejected if "batch_norm" in e.ops]
    assert len(stays) == 1 and reason in stays[0].reason, str(opt.fusion_report)


@pytest.mark.parametrize("last_read", [False, True], ids=["features", "size-read"])
def test_levit_linear_norm_as_onnx_imports_it_folds_into_the_linear(last_read: bool):
    _folds_into_the_linear(seeded(LeViTLinearNormAsImported(last_read=last_read)), (2, 9, 19))


def test_a_size_read_used_again_keeps_the_flatten_and_the_batch_norm():
    """The batch size read from the linear's output also scales the result: moving the flatten before the linear
    would make that read the flattened size, so nothing moves and the BatchNorm is reported."""
    _keeps_its_batch_norm(seeded(LeViTLinearNormAsImported(size_twice=True)), "follows `flatten`")


class LeViTLinearNormAsDynamoExports(nn.Module):
    """LinearNorm as torch.onnx's dynamo exporter writes it: a reshape to ``(-1, N)``, a functional batch norm, and
    a reshape to the tokens (``reuse``: the linear's output is also added to the result)."""

    def __init__(self, reuse: bool = False) -> None:
        super().__init__()
        self.inner, self.reuse = LeViTLinearNorm(), reuse

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bn = self.inner.bn
        v = F.linear(x, self.inner.linear.weight)
        y = F.batch_norm(torch.reshape(v, (-1, 21)), bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0)
        out = torch.reshape(y, (-1, 5, 21))
        return out + v if self.reuse else out


def test_levit_linear_norm_as_the_dynamo_exporter_writes_it_folds_into_the_linear():
    _folds_into_the_linear(seeded(LeViTLinearNormAsDynamoExports()), (7, 5, 19))


def test_a_linear_output_read_again_keeps_its_reshape_and_batch_norm():
    _keeps_its_batch_norm(seeded(LeViTLinearNormAsDynamoExports(reuse=True)), "reshape")


class FlattenBeforeBatchNorm(nn.Module):
    """A flattened linear output normalized and used again as it is: the BN stays, and is reported."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = LeViTLinearNorm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = self.inner.linear(x)
        return self.inner.bn(v.flatten(0, 1)).reshape_as(v) + v


def test_batchnorm_after_a_flatten_it_cannot_see_through_is_reported():
    model = seeded(FlattenBeforeBatchNorm())
    opt = optimize_and_compare(model, torch.randn(3, 5, 19))
    stays = [e for e in opt.fusion_report.rejected if "batch_norm" in e.ops]
    assert len(stays) == 1 and "follows `flatten`" in stays[0].reason, str(opt.fusion_report)


class PositionalEncodingFourier(nn.Module):
    """timm's EdgeNeXt PositionalEncodingFourier, cut down: the grid it encodes takes its device and dtype from
    ``token_projection.weight``, a conv that fuses; only those metadata reads are left of that weight."""

    def __init__(self, hidden: int = 8, dim: int = 13) -> None:
        super().__init__()
        self.token_projection = nn.Conv2d(hidden * 2, dim, kernel_size=1)
        self.hidden = hidden

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device, dtype = self.token_projection.weight.device, self.token_projection.weight.dtype
        n, _, h, w = x.shape
        y = torch.arange(1, h + 1, device=device).to(dtype).view(1, h, 1).expand(n, h, w)
        x_ = torch.arange(1, w + 1, device=device).to(dtype).view(1, 1, w).expand(n, h, w)
        freq = 10000 ** (torch.arange(self.hidden, device=device).to(dtype) / self.hidden)
        pos = torch.cat([(y[..., None] / freq).sin(), (x_[..., None] / freq).cos()], dim=3).permute(0, 3, 1, 2)
        return x + self.token_projection(pos.to(dtype))


def test_metadata_reads_of_a_fused_weight_do_not_keep_the_weight():
    model = seeded(PositionalEncodingFourier())
    opt = optimize_and_compare(model, torch.randn(2, 13, 7, 9))
    assert fused_ops(opt) == [["conv2d", "add"]], str(opt.fusion_report)
    kept = {k: tuple(v.shape) for k, v in opt.state_dict().items()}
    assert sum(v.numel() for v in opt.state_dict().values()) == sum(p.numel() for p in model.parameters()), kept


class SharedHead(nn.Module):
    """torchvision's RetinaNet / FCOS heads: one conv -> BN -> ReLU block applied to every feature level."""

    def __init__(self, c: int = 13) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, p3: torch.Tensor, p4: torch.Tensor, p5: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(F.relu(self.bn(self.conv(p))) for p in (p3, p4, p5))


def test_a_block_applied_at_several_places_folds_once():
    """Each call fuses on its own (a fused module is specialized per call: its input scale, its cat buffer),
    but the three share one folded weight and bias rather than each holding a copy."""
    model = seeded(SharedHead())
    levels = [torch.randn(2, 13, s, s + 2) for s in (15, 9, 5)]
    opt = optimize_and_compare(model, *levels)
    assert fused_ops(opt) == [["conv2d", "batch_norm", "relu"]] * 3, str(opt.fusion_report)
    fused = [m for m in opt.modules() if type(m).__name__ == "FusedConv2d"]
    assert len(fused) == 3 and len({m.weight.data_ptr() for m in fused}) == 1
    assert len({m.bias.data_ptr() for m in fused}) == 1
    opt.double()  # a move or a cast keeps them shared (nn.Module alone would copy a shared buffer per module)
    assert {m.weight.dtype for m in fused} == {torch.float64}
    assert len({m.weight.data_ptr() for m in fused}) == 1 and len({m.bias.data_ptr() for m in fused}) == 1
    with torch.no_grad():
        outputs = opt(*(x.double() for x in levels))
    for out, ref in zip(outputs, reference64(model, *levels), strict=True):
        assert_close(out, ref, "ieee", "after .double()")
