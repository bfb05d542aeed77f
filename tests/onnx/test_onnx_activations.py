"""Activation ops imported from ONNX match onnxruntime at two batch sizes, at the opsets they span."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_testing import check_import, const, single_op

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
