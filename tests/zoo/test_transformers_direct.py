"""transformers' models optimized as a user calls them: not wrapped (the zoo wraps them for tuple outputs),
returning their ModelOutput, called again with other shapes.

What this guards: the optimized model returns the same ModelOutput class (torch.fx would make it a plain dict);
a layer that transformers calls with keyword arguments its traced graph lacks (BERT's ``position_ids``) is
captured through its children instead of failing at the first call; MobileNetV2's tf_padding layers fuse by
the shape-specialized trace and still answer other image sizes.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from accuracy import assert_close, reference64

import fuser
from fuser.models.common import randomize_batchnorm

pytest.importorskip("transformers", reason="needs transformers: `make test` installs it (Makefile, extra 'zoo')")
import transformers

pytestmark = pytest.mark.slow


def _build(model_cls: str, config_cls: str, **config: object) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = getattr(transformers, config_cls)(**config)
    cfg._attn_implementation = "eager"
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():
                p.normal_(0.0, 0.05)
    return randomize_batchnorm(model, torch.Generator().manual_seed(1))


def _same_output(out, ref, what: str) -> None:
    assert type(out) is type(ref), f"{what}: {type(out).__name__} instead of {type(ref).__name__}"
    assert list(out.keys()) == list(ref.keys())
    for key in ref:
        assert_close(out[key], ref[key], "ieee", f"{what}: {key}")


def test_bert_called_directly_returns_its_model_output_for_any_sequence_length():
    model = _build("BertModel", "BertConfig", hidden_size=48, num_hidden_layers=2, num_attention_heads=3,
                   intermediate_size=96)  # fmt: skip
    ids = torch.randint(0, 1000, (2, 11), generator=torch.Generator().manual_seed(2))
    opt = fuser.optimize(model, (ids,), precision="ieee", backend="torch")
    report = opt.fusion_report
    assert report.specialized == ""  # the attention mask holds the sequence length: not worth tying to it
    assert any("keyword arguments (position_ids)" in u.reason for u in report.untraced), str(report)
    assert sum(e.ops == ["linear", "gelu"] for e in report.fused) == 2, str(report)
    for x in (ids, torch.randint(0, 1000, (3, 7), generator=torch.Generator().manual_seed(5))):
        with torch.no_grad():
            _same_output(opt(x), reference64(model, x), f"ids {tuple(x.shape)}")


def test_mobilenet_v2_with_tf_padding_fuses_and_answers_other_shapes():
    model = _build("MobileNetV2Model", "MobileNetV2Config", depth_multiplier=0.35, image_size=48)
    x = torch.randn(2, 3, 45, 39, generator=torch.Generator().manual_seed(3))
    opt = fuser.optimize(model, (x,), precision="ieee", backend="torch")
    report = opt.fusion_report
    assert report.specialized == "(*, 3, 45, 39)"
    assert report.untraced == [] and len(report.fused) == 52, str(report)
    with torch.no_grad():
        _same_output(opt(x), reference64(model, x), "the example")
        x3 = torch.randn(3, 3, 45, 39)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _same_output(opt(x3), reference64(model, x3), "batch 3")
        other = torch.randn(1, 3, 40, 40)
        with pytest.warns(RuntimeWarning, match="runs the original model"):
            _same_output(opt(other), reference64(model, other), "40 x 40")


def test_resnet_called_directly_keeps_its_model_output_through_save_and_load(tmp_path):
    model = _build("ResNetModel", "ResNetConfig", embedding_size=16, hidden_sizes=[16, 24], depths=[1, 1])
    x = torch.randn(2, 3, 45, 39, generator=torch.Generator().manual_seed(4))
    opt = fuser.optimize(model, (x,), precision="ieee", backend="torch")
    torch.save(opt, tmp_path / "opt.pt")
    loaded = torch.load(tmp_path / "opt.pt", weights_only=False)
    ref = reference64(model, x)
    with torch.no_grad():
        _same_output(opt(x), ref, "optimized")
        _same_output(loaded(x), ref, "loaded")
        assert opt(x).last_hidden_state.shape == ref.last_hidden_state.shape
