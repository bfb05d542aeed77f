"""The activation table (fuser.activations) on the graph side: every row is complete and consistent with
the vocabulary, the converters and the reference; and the graph side reads it without loading triton."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.fx as fx

from fuser.activations import ACTIVATIONS, BY_NAME, Activation, apply_activation_torch, module_activation
from fuser.graph_ops import UNSUPPORTED_ACTIVATIONS, read_activation
from fuser.onnx.convert_activations import LAST_OPSET
from fuser.onnx.registry import REGISTRY

ROWS = [pytest.param(row, id=row.name) for row in ACTIVATIONS if row.act != Activation.NONE]


def test_the_graph_side_does_not_load_triton() -> None:
    code = (
        "import sys, fuser.graph_ops, fuser.canonicalize, fuser.match.matcher, fuser.report, fuser.activations; "
        "loaded = [m for m in ('triton', 'fuser.kernels') if m in sys.modules]; "
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("row", ROWS)
def test_canonical_call_reads_back_as_its_row(row) -> None:
    graph = fx.Graph()
    x = graph.placeholder("x")
    alpha = 0.25 if row.alpha_arg else 0.0
    target, args, kwargs = row.canonical_call(x, alpha)
    node = graph.call_function(target, args, kwargs)
    assert read_activation(node) == (row.act, alpha)
    assert BY_NAME[row.name] is row.act


@pytest.mark.parametrize("row", ROWS)
def test_module_forms_read_as_their_row(row) -> None:
    for module_type in row.modules:
        if module_type is torch.nn.Hardtanh:
            module = module_type(0.0, 6.0)
        elif module_type is torch.nn.GELU:
            module = module_type(approximate="tanh" if row.act == Activation.GELU_TANH else "none")
        else:
            module = module_type()
        found = module_activation(module)
        assert found is not None and found[0] == row.act, (module_type, found)


@pytest.mark.parametrize("row", ROWS)
def test_no_form_is_also_listed_as_unsupported(row) -> None:
    for target in (row.call, *row.functions, *row.modules):
        assert target not in UNSUPPORTED_ACTIVATIONS, target


@pytest.mark.parametrize("row", ROWS)
def test_onnx_forms_are_registered(row) -> None:
    for form in row.onnx_in:
        for opset in (form.since, LAST_OPSET):
            assert REGISTRY.find("", form.op_type, opset) is not None, (form.op_type, opset)


@pytest.mark.parametrize("row", ROWS)
def test_reference_is_out_of_place_and_matches_the_canonical_call(row) -> None:
    y = torch.randn(37, 5, dtype=torch.float64) * 4
    before = y.clone()
    target, args, kwargs = row.canonical_call(y, 0.1 if row.alpha_arg else 0.0)
    out = apply_activation_torch(y, row.act, 0.1 if row.alpha_arg else 0.0)
    assert torch.equal(y, before)
    torch.testing.assert_close(out, target(*args, **kwargs), rtol=0, atol=0)
