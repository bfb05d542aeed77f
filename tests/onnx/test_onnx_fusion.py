"""ONNX forms of the issue's chains fuse like their torch forms, run like onnxruntime, and export back to
standard ONNX (checker clean, no BatchNormalization left, batch dynamic) that onnxruntime runs the same.

Each graph is built with onnx.helper, optimized with ``fuser.optimize(path, precision="ieee",
backend="torch")`` (the reference implementation of the fused ops, on the CPU), checked fused through
``fusion_report.fused``, compared with onnxruntime at two batch sizes, exported with export_onnx, and
the exported file compared with onnxruntime's run of the original at a third batch size.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from accuracy import TOLERANCE
from onnx import helper
from onnx_testing import assert_outputs_match, const, info, make_model, random_feeds, run_module, run_ort

import fuser
from fuser.onnx.exporter import export_onnx

RNG = np.random.default_rng(5)
C_IN, C_OUT, H, W = 5, 7, 9, 11
K, N = 19, 21

# Each activation: (nodes from "z" to "a", its initializers, the minimum opset, the reported name).
ActivationForm = Callable[[], tuple[list[onnx.NodeProto], list[onnx.TensorProto], int, str]]


def _relu() -> tuple:
    return [helper.make_node("Relu", ["z"], ["a"])], [], 13, "relu"


def _silu() -> tuple:
    nodes = [helper.make_node("Sigmoid", ["z"], ["s"]), helper.make_node("Mul", ["z", "s"], ["a"])]
    return nodes, [], 13, "silu"


def _hardswish() -> tuple:
    return [helper.make_node("HardSwish", ["z"], ["a"])], [], 14, "hardswish"


def _clip_0_6() -> tuple:
    inits = [const("lo", np.float32(0.0)), const("hi", np.float32(6.0))]
    return [helper.make_node("Clip", ["z", "lo", "hi"], ["a"])], inits, 13, "relu6"


def _leaky_relu() -> tuple:
    return [helper.make_node("LeakyRelu", ["z"], ["a"], alpha=0.1)], [], 13, "leaky_relu"


def _sigmoid() -> tuple:
    return [helper.make_node("Sigmoid", ["z"], ["a"])], [], 13, "sigmoid"


def _tanh() -> tuple:
    return [helper.make_node("Tanh", ["z"], ["a"])], [], 13, "tanh"


def _gelu_erf_form() -> tuple:
    """As torch exports F.gelu below opset 20: x * (1 + erf(x / sqrt(2))) * 0.5."""
    nodes = [
        helper.make_node("Div", ["z", "sqrt2"], ["d"]),
        helper.make_node("Erf", ["d"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["p"]),
        helper.make_node("Mul", ["z", "p"], ["m"]),
        helper.make_node("Mul", ["m", "half"], ["a"]),
    ]
    inits = [const("sqrt2", np.float32(math.sqrt(2))), const("one", np.float32(1.0)), const("half", np.float32(0.5))]
    return nodes, inits, 13, "gelu"


def _gelu_tanh_form() -> tuple:
    """As torch exports F.gelu(approximate="tanh") below opset 20:
    (0.5 * x) * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x * (x * x))))."""
    nodes = [
        helper.make_node("Mul", ["z", "z"], ["sq"]),
        helper.make_node("Mul", ["z", "sq"], ["cube"]),
        helper.make_node("Mul", ["kappa", "cube"], ["kc"]),
        helper.make_node("Add", ["z", "kc"], ["inner"]),
        helper.make_node("Mul", ["beta", "inner"], ["scaled"]),
        helper.make_node("Tanh", ["scaled"], ["t"]),
        helper.make_node("Add", ["one", "t"], ["p"]),
        helper.make_node("Mul", ["half", "z"], ["hz"]),
        helper.make_node("Mul", ["hz", "p"], ["a"]),
    ]
    inits = [
        const("kappa", np.float32(0.044715)),
        const("beta", np.float32(math.sqrt(2 / math.pi))),
        const("one", np.float32(1.0)),
        const("half", np.float32(0.5)),
    ]
    return nodes, inits, 13, "gelu_tanh"


def _gelu_op() -> tuple:
    return [helper.make_node("Gelu", ["z"], ["a"])], [], 20, "gelu"


def _gelu_op_tanh() -> tuple:
    return [helper.make_node("Gelu", ["z"], ["a"], approximate="tanh")], [], 20, "gelu_tanh"


ACTIVATIONS: dict[str, ActivationForm] = {
    "relu": _relu,
    "silu": _silu,
    "hardswish": _hardswish,
    "clip06": _clip_0_6,
    "leaky_relu": _leaky_relu,
    "sigmoid": _sigmoid,
    "tanh": _tanh,
    "gelu_erf": _gelu_erf_form,
    "gelu_tanh_form": _gelu_tanh_form,
    "gelu_op": _gelu_op,
    "gelu_op_tanh": _gelu_op_tanh,
}


def bn_initializers(c: int) -> list[onnx.TensorProto]:
    """Random BN statistics (a fresh BN is the identity and would hide folding bugs)."""
    return [
        const("bn_scale", RNG.uniform(0.5, 1.5, c)),
        const("bn_bias", RNG.standard_normal(c) * 0.2),
        const("bn_mean", RNG.standard_normal(c) * 0.2),
        const("bn_var", RNG.uniform(0.25, 1.75, c)),
    ]


def conv_chain(act: str, bn: bool, residual: str | None) -> onnx.ModelProto:
    """x -> Conv [-> BatchNormalization] -> act [-> + r]; residual "before" is ResNet's add-then-ReLU."""
    act_nodes, inits, opset, _ = ACTIVATIONS[act]()
    w = RNG.standard_normal((C_OUT, C_IN, 3, 3)).astype(np.float32) / math.sqrt(C_IN * 9)
    inits = [*inits, const("w", w), const("b", RNG.standard_normal(C_OUT) * 0.1)]
    nodes = [helper.make_node("Conv", ["x", "w"] + ([] if bn else ["b"]), ["c"], pads=[1, 1, 1, 1])]
    if bn:
        inits += bn_initializers(C_OUT)
        nodes.append(helper.make_node("BatchNormalization", ["c", "bn_scale", "bn_bias", "bn_mean", "bn_var"], ["z0"]))
    else:
        nodes.append(helper.make_node("Identity", ["c"], ["z0"]))
    return _with_residual(nodes, act_nodes, inits, opset, residual, ["N", C_IN, H, W], ["N", C_OUT, H, W])


def gemm_chain(act: str, form: str, residual: str | None) -> onnx.ModelProto:
    """x -> (MatMul + Add | Gemm transB=1 | Gemm transB=0) -> act [-> + r]."""
    act_nodes, inits, opset, _ = ACTIVATIONS[act]()
    w = RNG.standard_normal((K, N)).astype(np.float32) / math.sqrt(K)
    inits = [*inits, const("bias", RNG.standard_normal(N) * 0.1)]
    if form == "matmul_add":
        inits.append(const("w", w))
        nodes = [helper.make_node("MatMul", ["x", "w"], ["xw"]), helper.make_node("Add", ["xw", "bias"], ["z0"])]
        x_shape, y_shape = ["N", 3, K], ["N", 3, N]
    else:
        trans_b = int(form == "gemm_transB1")
        inits.append(const("w", w.T.copy() if trans_b else w))
        nodes = [helper.make_node("Gemm", ["x", "w", "bias"], ["z0"], transB=trans_b)]
        x_shape, y_shape = ["N", K], ["N", N]
    return _with_residual(nodes, act_nodes, inits, opset, residual, x_shape, y_shape)


def _with_residual(
    nodes: list, act_nodes: list, inits: list, opset: int, residual: str | None, x_shape: list, y_shape: list
) -> onnx.ModelProto:
    inputs = [info("x", x_shape)] + ([info("r", y_shape)] if residual else [])
    if residual == "before":
        nodes = [*nodes, helper.make_node("Add", ["z0", "r"], ["z"]), *act_nodes]
        nodes.append(helper.make_node("Identity", ["a"], ["y"]))
    else:
        nodes = [*nodes, helper.make_node("Identity", ["z0"], ["z"]), *act_nodes]
        nodes.append(
            helper.make_node("Add", ["a", "r"], ["y"]) if residual else helper.make_node("Identity", ["a"], ["y"])
        )
    return make_model(nodes, inputs, [info("y", y_shape)], inits, opset=max(opset, 17))


def optimize_and_check(model: onnx.ModelProto, tmp_path: Path, pattern: str, act: str, residual: bool) -> None:
    src = tmp_path / "model.onnx"
    onnx.save(model, src)
    fused = fuser.optimize(src, precision="ieee", backend="torch")
    chains = fused.fusion_report.fused
    assert len(chains) == 1, f"expected one fused chain, report:\n{fused.fusion_report}"
    (chain,) = chains
    assert (chain.pattern, chain.activation, chain.residual) == (pattern, act, residual), str(fused.fusion_report)

    for batch in (2, 5):
        feeds = random_feeds(model, batch, seed=batch)
        assert_outputs_match(run_module(fused, feeds), run_ort(model, feeds), f"optimized, batch {batch}")

    example = tuple(torch.from_numpy(v) for v in random_feeds(model, 2, seed=11).values())
    out = export_onnx(fused, example, tmp_path / "optimized.onnx")
    exported = onnx.load(out)
    onnx.checker.check_model(exported)
    op_types = {n.op_type for n in exported.graph.node}
    assert "BatchNormalization" not in op_types, f"a folded chain exported a BatchNormalization: {op_types}"
    for value in (*exported.graph.input, *exported.graph.output):
        assert value.type.tensor_type.shape.dim[0].dim_param, f"{value.name}: batch dim is not dynamic"
    feeds = random_feeds(model, 3, seed=3)
    renamed = {i.name: v for i, v in zip(exported.graph.input, feeds.values(), strict=True)}
    got = [torch.from_numpy(v) for v in run_ort(str(out), renamed)]
    assert_outputs_match(got, run_ort(model, feeds), "exported", TOLERANCE["ieee"])


@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize("bn", [True, False], ids=["conv_bn", "conv_bias"])
def test_conv_chain(act: str, bn: bool, tmp_path: Path) -> None:
    name = ACTIVATIONS[act]()[3]
    optimize_and_check(conv_chain(act, bn, None), tmp_path, "conv_bn_act" if bn else "conv_act", name, False)


@pytest.mark.parametrize("act", ["relu", "silu", "hardswish", "clip06", "gelu_erf", "gelu_tanh_form"])
def test_conv_bn_act_residual_after(act: str, tmp_path: Path) -> None:
    name = ACTIVATIONS[act]()[3]
    optimize_and_check(conv_chain(act, True, "after"), tmp_path, "conv_bn_act", name, True)


@pytest.mark.parametrize("bn", [True, False], ids=["conv_bn", "conv_bias"])
def test_conv_add_relu_residual_before(bn: bool, tmp_path: Path) -> None:
    optimize_and_check(conv_chain("relu", bn, "before"), tmp_path, "conv_bn_act" if bn else "conv_act", "relu", True)


@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize("form", ["matmul_add", "gemm_transB1", "gemm_transB0"])
def test_gemm_chain(act: str, form: str, tmp_path: Path) -> None:
    name = ACTIVATIONS[act]()[3]
    optimize_and_check(gemm_chain(act, form, None), tmp_path, "gemm_epilogue", name, False)


@pytest.mark.parametrize("form", ["matmul_add", "gemm_transB1"])
def test_gemm_act_residual_after(form: str, tmp_path: Path) -> None:
    optimize_and_check(gemm_chain("gelu_erf", form, "after"), tmp_path, "gemm_epilogue", "gelu", True)


def test_same_upper_conv_runs_as_one_fused_conv(tmp_path: Path) -> None:
    """auto_pad SAME_UPPER at stride 2 pads one more pixel at the end: the importer writes a Pad, which the
    fused conv takes as its own padding (fuser.rewrite.zero_pad)."""
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((7, 5, 3, 3)) / np.sqrt(45)).astype(np.float32)
    bn = [const("s", rng.uniform(0.5, 1.5, 7)), const("t", rng.standard_normal(7) * 0.2),
          const("m", rng.standard_normal(7) * 0.2), const("v", rng.uniform(0.25, 1.75, 7))]  # fmt: skip
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], auto_pad="SAME_UPPER", strides=[2, 2]),
        helper.make_node("BatchNormalization", ["c", "s", "t", "m", "v"], ["z"]),
        helper.make_node("Relu", ["z"], ["y"]),
    ]
    model = make_model(nodes, [info("x", ["N", 5, 13, 10])], [info("y", None)], [const("w", w), *bn], opset=17)
    optimize_and_check(model, tmp_path, "conv_bn_act", "relu", False)  # like onnxruntime, and exported
    onnx.save(model, tmp_path / "same.onnx")
    opt = fuser.optimize(tmp_path / "same.onnx", precision="ieee", backend="torch")
    assert [r.kind for r in opt.fusion_report.rewrites if r.kind == "zero_pad"] == ["zero_pad"]
    assert [n.op for n in opt.module.graph.nodes if n.op.startswith("call")] == ["call_module"], opt.module.code
