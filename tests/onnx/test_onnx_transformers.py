"""transformers' BertModel, GPT2Model and ViTModel (small configs, random weights) exported by torch.onnx,
both the TorchScript exporter and the dynamo one, import and match onnxruntime on fresh inputs of another
batch size and sequence length, with padded attention masks.

These exports are what a user brings: their attention-mask code becomes GatherElements, GatherND,
CumSum, comparisons, And/Not, IsNaN and Max, each of which the importer must read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from accuracy import TOLERANCE, rel_error
from export_checks import EXPORTER_WARNINGS
from onnx_testing import run_ort

from fuser.onnx.importer import import_onnx

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency of this file")

pytestmark = [pytest.mark.slow, *EXPORTER_WARNINGS]

VOCAB = 101


@dataclass
class Case:
    build: Callable[[], torch.nn.Module]
    inputs: Callable[[int, int, int], tuple[torch.Tensor, ...]]
    names: tuple[str, ...]


def text_inputs(batch: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and a mask whose first row is padded after a few tokens (the mask code paths run)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.int64)
    mask[0, seq - 3 :] = 0
    return ids, mask


def image_inputs(batch: int, _seq: int, seed: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(seed)),)


class LastHiddenState(torch.nn.Module):
    """The model called with its inputs by name, ``last_hidden_state`` as a plain tensor output."""

    def __init__(self, model: torch.nn.Module, names: tuple[str, ...]) -> None:
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.model(**dict(zip(self.names, inputs, strict=True))).last_hidden_state


def bert() -> torch.nn.Module:
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=64,
    )
    return transformers.BertModel(config)


def gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    config.use_cache = False
    return transformers.GPT2Model(config)


def vit() -> torch.nn.Module:
    config = transformers.ViTConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37
    )
    return transformers.ViTModel(config)


CASES = {
    "bert": Case(bert, text_inputs, ("input_ids", "attention_mask")),
    "gpt2": Case(gpt2, text_inputs, ("input_ids", "attention_mask")),
    "vit": Case(vit, image_inputs, ("pixel_values",)),
}


def export(case: Case, dynamo: bool, path: Path) -> None:
    torch.manual_seed(0)
    model = LastHiddenState(case.build().eval(), case.names)
    example = case.inputs(2, 11, 0)
    if dynamo:
        pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript")
        batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq", min=2, max=60)
        shapes = tuple({0: batch, 1: seq} if t.dtype == torch.int64 else {0: batch} for t in example)
        torch.onnx.export(
            model, example, path, input_names=list(case.names), dynamic_shapes=(shapes,), opset_version=18, dynamo=True
        )
    else:
        dims = [{0: "batch", 1: "seq"} if t.dtype == torch.int64 else {0: "batch"} for t in example]
        axes = dict(zip(case.names, dims, strict=True))
        torch.onnx.export(
            model, example, path, input_names=list(case.names), dynamic_axes=axes, opset_version=17, dynamo=False
        )


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
@pytest.mark.parametrize("name", list(CASES))
def test_transformers_export_imports_and_matches_onnxruntime(name: str, dynamo: bool, tmp_path: Path) -> None:
    case = CASES[name]
    path = tmp_path / f"{name}.onnx"
    export(case, dynamo, path)
    module = import_onnx(path)
    for batch, seq, seed in ((3, 13, 1), (1, 7, 2)):
        inputs = case.inputs(batch, seq, seed)
        (expected,) = run_ort(str(path), {n: t.numpy() for n, t in zip(case.names, inputs, strict=True)})
        with torch.no_grad():
            got = module(*inputs)
        ref = torch.from_numpy(np.asarray(expected))
        assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} vs onnxruntime {tuple(ref.shape)}"
        err = rel_error(got, ref)
        assert err < TOLERANCE["ieee"], f"{name} batch {batch} seq {seq}: relative error {err:.2e}"


def test_bert_export_uses_the_ops_added_for_it(tmp_path: Path) -> None:
    """The export really contains the ops this file is about (else the test above proves nothing new)."""
    path = tmp_path / "bert.onnx"
    export(CASES["bert"], False, path)
    ops = {n.op_type for n in onnx.load(path).graph.node}
    assert {"GatherElements", "GreaterOrEqual", "And", "IsNaN"} <= ops, sorted(ops)
