"""Activation ops imported from ONNX match onnxruntime at two batch sizes, at the opsets they span; the
activation table's ONNX columns hold (every op it imports, every row's export -> re-import round trip); an
activation after a conv fuses exactly when the ONNX nodes compute one (Clip(0, 1) is not relu6)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from accuracy import assert_close, reference64
from onnx import helper
from onnx_testing import (
    assert_outputs_match,
    check_import,
    const,
    info,
    make_model,
    random_feeds,
    run_module,
    run_ort,
    single_op,
)
from toy_models import ConvBnAct, seeded

import fuser
from fuser.activations import ACTIVATIONS, Activation
from fuser.graph_ops import read_activation
from fuser.onnx.convert_activations import LAST_OPSET
from fuser.onnx.exporter import export_onnx
from fuser.onnx.importer import import_onnx

SHAPE = ["N", 5, 7, 3]


@pytest.mark.parametrize("opset", [14, 17, 21])
@pytest.mark.parametrize("op", ["Relu", "Sigmoid", "Tanh", "Erf", "HardSwish"])
def test_unary(op: str, opset: int) -> None:
    check_import(single_op(op, [SHAPE], opset=opset), f"{op} opset {opset}")


@pytest.mark.parametrize("alpha", [0.01, 0.173])
def test_leaky_relu(alpha: float) -> None:
    check_import(single_op("LeakyRelu", [SHAPE], alpha=alpha), f"LeakyRelu {alpha}")


@pytest.mark.parametrize("alpha, beta", [(0.2, 0.5), (1 / 6, 0.5), (0.3, 0.1)])
def test_hard_sigmoid(alpha: float, beta: float) -> None:
    check_import(single_op("HardSigmoid", [SHAPE], alpha=alpha, beta=beta), f"HardSigmoid {alpha} {beta}")


@pytest.mark.parametrize("opset", [20, 21])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu(approximate: str, opset: int) -> None:
    check_import(single_op("Gelu", [SHAPE], opset=opset, approximate=approximate), f"Gelu {approximate}")


@pytest.mark.parametrize("axis", [-1, 1, 2, 0])
def test_softmax(axis: int) -> None:
    check_import(single_op("Softmax", [SHAPE], opset=13, axis=axis), f"Softmax axis {axis}")


@pytest.mark.parametrize(
    "bounds",
    [(0.0, 6.0), (-0.5, None), (None, 0.25), (None, None)],
    ids=["both", "min", "max", "none"],
)
@pytest.mark.parametrize("opset", [11, 13, 21])
def test_clip_constant_bounds(bounds: tuple, opset: int) -> None:
    low, high = bounds
    inits, names = [], []
    for name, value in (("lo", low), ("hi", high)):
        if value is None:
            names.append("")
        else:
            inits.append(const(name, np.float32(value)))
            names.append(name)
    while names and names[-1] == "":
        names.pop()
    model = single_op("Clip", [SHAPE], opset=opset, initializers=inits, extra_inputs=names)
    check_import(model, f"Clip {bounds} opset {opset}")


def test_clip_runtime_bounds() -> None:
    model = single_op("Clip", [SHAPE, [], []], opset=13)
    check_import(model, "Clip runtime bounds")


def test_clip_attributes_opset6() -> None:
    check_import(single_op("Clip", [SHAPE], opset=6, min=-0.3, max=0.7), "Clip opset 6")


# ---------------------------------------------------------------------------------------------------------
# The activation table's ONNX columns: every op it imports, at its first and last opset, and every row's
# export -> re-import round trip.

TABLE_FORMS = [
    pytest.param(row, form, opset, id=f"{form.op_type}-{row.name}-opset{opset}")
    for row in ACTIVATIONS
    for form in row.onnx_in
    for opset in sorted({form.since if form.since >= 13 else 13, LAST_OPSET})
]


@pytest.mark.parametrize(("row", "form", "opset"), TABLE_FORMS)
def test_table_op_imports_as_its_row(row, form, opset: int) -> None:
    attrs = {name: value for name, _, value in form.attributes}
    if form.alpha:
        attrs[form.alpha[0]] = 0.173
    module = check_import(single_op(form.op_type, [SHAPE], opset=opset, **attrs), f"{form.op_type} opset {opset}")
    found = [read_activation(n) for n in module.graph.nodes if n.op == "call_function"]
    assert found == [(row.act, pytest.approx(0.173 if form.alpha else 0.0))], found


def test_softplus_imports() -> None:
    check_import(single_op("Softplus", [SHAPE], opset=17), "Softplus")


def test_gelu_with_an_unknown_approximation_is_refused() -> None:
    model = single_op("Gelu", [SHAPE], opset=20, approximate="tanh")
    model.graph.node[0].attribute[0].s = b"erf"
    with pytest.raises(Exception, match="approximate='erf'"):
        import_onnx(model)


def _conv_then(act_nodes: list, inits: list, opset: int) -> onnx.ModelProto:
    """x -> Conv (with bias) -> the activation's nodes from "c" to "y"."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((7, 5, 3, 3)).astype(np.float32) / math.sqrt(45)
    inits = [*inits, const("w", w), const("b", rng.standard_normal(7) * 0.5)]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]), *act_nodes]
    return make_model(nodes, [info("x", ["N", 5, 9, 11])], [info("y", ["N", 7, 9, 11])], inits, opset)


def _clip(lo: float, hi: float) -> tuple[list, list]:
    inits = [const("lo", np.float32(lo)), const("hi", np.float32(hi))]
    return [helper.make_node("Clip", ["c", "lo", "hi"], ["y"])], inits


_MISH_WRITTEN = [
    helper.make_node("Softplus", ["c"], ["sp"]),
    helper.make_node("Tanh", ["sp"], ["t"]),
    helper.make_node("Mul", ["c", "t"], ["y"]),
]
CONV_FORMS = [
    ("Mish", [helper.make_node("Mish", ["c"], ["y"])], [], 18, "mish"),
    ("Mul(x,Tanh(Softplus(x)))", _MISH_WRITTEN, [], 17, "mish"),
    ("Mul(Tanh(Softplus(x)),x)", [*_MISH_WRITTEN[:2], helper.make_node("Mul", ["t", "c"], ["y"])], [], 17, "mish"),
    (
        "HardSigmoid(1/6,0.5)",
        [helper.make_node("HardSigmoid", ["c"], ["y"], alpha=1 / 6, beta=0.5)],
        [],
        17,
        "hardsigmoid",
    ),
    ("HardSigmoid(0.2,0.5)", [helper.make_node("HardSigmoid", ["c"], ["y"])], [], 17, None),
    ("HardSigmoid(1/6,0.4)", [helper.make_node("HardSigmoid", ["c"], ["y"], alpha=1 / 6, beta=0.4)], [], 17, None),
    ("Clip(0,6)", *_clip(0.0, 6.0), 17, "relu6"),
    ("Clip(0,1)", *_clip(0.0, 1.0), 17, None),
    ("Clip(0,6.5)", *_clip(0.0, 6.5), 17, None),
]


@pytest.mark.parametrize(("what", "nodes", "inits", "opset", "expected"), CONV_FORMS, ids=[c[0] for c in CONV_FORMS])
def test_conv_then_activation(what: str, nodes: list, inits: list, opset: int, expected: str | None) -> None:
    """conv -> activation fuses exactly when the ONNX nodes compute a fused activation, and stays correct; a
    near miss fuses the conv alone (its bias), the activation left after it."""
    model = _conv_then(nodes, inits, opset)
    optimized = fuser.optimize(model, precision="ieee", backend="torch")
    chains = [(e.pattern, e.activation) for e in optimized.fusion_report.fused]
    want = [("conv_act", expected)] if expected else [("conv", None)]
    assert chains == want, (what, str(optimized.fusion_report))
    for batch in (2, 5):
        feeds = random_feeds(model, batch, seed=batch)
        assert_outputs_match(run_module(optimized, feeds), run_ort(model, feeds), f"{what} batch {batch}")


ROWS = [pytest.param(row, id=row.name) for row in ACTIVATIONS if row.act != Activation.NONE]


@pytest.mark.parametrize("opset", [17, 20])
@pytest.mark.parametrize("row", ROWS)
def test_export_reimport_round_trip(row, opset: int, tmp_path: Path) -> None:
    """fuser's own export of every activation reads back and fuses as the same activation (the ONNX ops the
    table's ``onnx_out`` names are what torch's exporter writes)."""
    alpha = 0.13 if row.alpha_arg else 0.0

    def act(y: torch.Tensor) -> torch.Tensor:
        target, args, kwargs = row.canonical_call(y, alpha)
        return target(*args, **kwargs)

    model = seeded(ConvBnAct(act))
    x = torch.randn(2, 5, 9, 11) * 3
    optimized = fuser.optimize(model, (x,), precision="ieee", backend="torch")
    path = export_onnx(optimized, (x,), tmp_path / "model.onnx", opset=opset)
    op_types = {n.op_type for n in onnx.load(path).graph.node}
    assert set(row.onnx_out_at(opset)) <= op_types, (row.name, op_types)
    assert "BatchNormalization" not in op_types

    again = fuser.optimize(path, precision="ieee", backend="torch")
    chains = [(e.pattern, e.activation) for e in again.fusion_report.fused]
    assert chains == [("conv_act", row.name)], str(again.fusion_report)
    if row.alpha_arg:
        assert again.fusion_report.fused[0].epilogue.alpha == pytest.approx(alpha)
    x = torch.randn(5, 5, 9, 11) * 3
    with torch.no_grad():
        assert_close(again(x), reference64(model, x), "ieee", f"{row.name} opset {opset}")
