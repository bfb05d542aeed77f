"""Architecture details of EfficientNet-B0, ResNet, ViT and BERT that the fusion tests rely on."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from accuracy import rel_error
from models_cases import CHEAP_KWARGS, built, input_for
from torch import fx, nn

from fuser.models import build
from fuser.models.efficientnet import B0_STAGES, MBConv
from fuser.models.resnet import Bottleneck
from fuser.models.vit import Attention


def _call_modules(gm: fx.GraphModule, kind: type[nn.Module]) -> list[fx.Node]:
    modules = dict(gm.named_modules())
    return [n for n in gm.graph.nodes if n.op == "call_module" and isinstance(modules[n.target], kind)]


def test_efficientnet_b0_follows_the_stage_table() -> None:
    model = built("efficientnet_b0")
    blocks = [b for b in model.modules() if isinstance(b, MBConv)]
    expected = [(s.kernel, s.stride if i == 0 else 1) for s in B0_STAGES for i in range(s.layers)]
    assert [(b.depthwise.conv.kernel_size[0], b.depthwise.conv.stride[0]) for b in blocks] == expected
    assert [b.project[0].out_channels for b in blocks][-1] == 320 and model.head[0].out_channels == 1280
    assert [b.expand is None for b in blocks] == [True] + [False] * 15  # stage 1 has expand ratio 1
    assert sum(b.use_residual for b in blocks) == 9
    for b in blocks:  # SE squeezes to a quarter of the block's input channels
        c_in = b.expand[0].in_channels if b.expand is not None else b.depthwise.conv.in_channels
        assert b.se.fc1.out_channels == max(1, c_in // 4)


def test_efficientnet_mixes_the_written_forms_of_silu() -> None:
    gm = fx.symbolic_trace(built("efficientnet_b0"))
    silu_modules = _call_modules(gm, nn.SiLU)
    functional = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is F.silu]
    sigmoids = [n for n in gm.graph.nodes if n.target is torch.sigmoid]
    written_out = [s for s in sigmoids if any(u.target is operator.mul and s.args[0] in u.args for u in s.users)]
    assert silu_modules and all(dict(gm.named_modules())[n.target].inplace for n in silu_modules)
    assert {n.kwargs.get("inplace", False) for n in functional} == {False, True}
    assert len(written_out) == 16  # x * torch.sigmoid(x) after every depthwise conv
    assert len(sigmoids) == 16 + 16  # and every SE gate


def test_efficientnet_width_multiplier() -> None:
    model = build("efficientnet_b0", width_mult=0.5, num_classes=11, **CHEAP_KWARGS["efficientnet_b0"])
    assert model.stem[0].out_channels == 16 and model.classifier.out_features == 11
    with torch.no_grad():
        assert model(input_for("efficientnet_b0")).shape == (2, 11)


def test_resnet_adds_the_residual_before_the_relu() -> None:
    model = built("resnet50")
    gm = fx.symbolic_trace(model)
    modules = dict(gm.named_modules())
    bn3 = [n for n in _call_modules(gm, nn.BatchNorm2d) if n.target.endswith("bn3")]
    assert len(bn3) == 16
    for node in bn3:
        (add,) = node.users
        assert add.target in (operator.add, operator.iadd)
        (relu,) = add.users
        assert isinstance(modules[relu.target], nn.ReLU)
    # torchvision's bottleneck calls one ReLU module three times.
    assert all(len([n for n in gm.graph.nodes if n.target == f"{b}.relu"]) == 3 for b in ("layer1.0", "layer4.2"))


def test_resnet_layers_and_downsampling() -> None:
    model = built("resnet50")
    stages = [model.layer1, model.layer2, model.layer3, model.layer4]
    assert [len(s) for s in stages] == [3, 4, 6, 3]
    assert [s[0].conv2.stride[0] for s in stages] == [1, 2, 2, 2]  # v1.5: the stride on the 3x3
    assert [b.downsample is not None for s in stages for b in s] == [i == 0 for s in stages for i in range(len(s))]
    small = build("resnet26", layers=(1, 2, 1, 1), width=8, **CHEAP_KWARGS["resnet26"])
    assert sum(isinstance(m, Bottleneck) for m in small.modules()) == 5 and small.fc.in_features == 256
    with pytest.raises(ValueError, match=r"four stage depths of at least 1, got \[1, 0, 1\]"):
        build("resnet26", layers=(1, 0, 1))


def test_vit_attention_equals_scaled_dot_product_attention() -> None:
    torch.manual_seed(3)
    attention = Attention(dim=30, heads=5).double()
    x = torch.randn(3, 7, 30, dtype=torch.float64)
    q, k, v = attention.qkv(x).view(3, 7, 3, 5, 6).permute(2, 0, 3, 1, 4)
    expected = attention.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(3, 7, 30))
    assert rel_error(attention(x), expected) < 1e-12


def test_vit_graph_has_explicit_attention_and_exact_gelu() -> None:
    gm = fx.symbolic_trace(built("vit_tiny"))
    matmuls = [n for n in gm.graph.nodes if n.target is operator.matmul]
    assert len(matmuls) == 2 * 12
    gelus = [dict(gm.named_modules())[n.target] for n in _call_modules(gm, nn.GELU)]
    assert len(gelus) == 12 and {g.approximate for g in gelus} == {"none"}


def test_vit_input_size_is_checked() -> None:
    with pytest.raises(ValueError, match=r"built for \[B, C, 67, 61\] images.*got shape \(1, 3, 64, 64\)"):
        built("vit_tiny")(torch.randn(1, 3, 64, 64))
    with pytest.raises(ValueError, match="smaller than one 16x16 patch"):
        build("vit_tiny", img_size=(15, 40))


def test_bert_runs_batched_gemms_with_tanh_gelu_and_post_norm() -> None:
    model = built("bert_tiny")
    gm = fx.symbolic_trace(model)
    gelus = [dict(gm.named_modules())[n.target] for n in _call_modules(gm, nn.GELU)]
    assert len(gelus) == 2 and {g.approximate for g in gelus} == {"tanh"}
    seen: list[int] = []
    hooks = [
        m.register_forward_pre_hook(lambda m, a: seen.append(a[0].dim()))
        for m in model.modules()
        if isinstance(m, nn.Linear)
    ]
    with torch.no_grad():
        model(input_for("bert_tiny"))
    for hook in hooks:
        hook.remove()
    assert seen and set(seen) == {3}
    # Post-norm: each layer's output is a LayerNorm of a residual sum.
    norms = {n.target for n in _call_modules(gm, nn.LayerNorm)}
    assert {"layers.0.output_norm", "layers.1.attention_norm"} <= norms


def test_bert_input_is_checked() -> None:
    with pytest.raises(ValueError, match=r"token embeddings \[B, S, 128\] with S <= 512; got shape \(2, 5, 64\)"):
        built("bert_tiny")(torch.randn(2, 5, 64))
    with pytest.raises(ValueError, match=r"S <= 512; got shape \(1, 513, 128\)"):
        built("bert_tiny")(torch.randn(1, 513, 128))
