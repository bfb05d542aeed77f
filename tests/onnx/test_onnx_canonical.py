"""The importer emits the canonical forms the fusion passes match: the same plain torch calls, with the
same arguments, that a symbolically traced PyTorch model contains."""

from __future__ import annotations

import operator

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import helper
from onnx_testing import check_import, const, info, make_model, single_op
from torch import fx

from fuser.onnx.importer import import_onnx

RNG = np.random.default_rng(11)


def calls(module: fx.GraphModule) -> list[fx.Node]:
    return [n for n in module.graph.nodes if n.op in ("call_function", "call_method")]


def only_call(module: fx.GraphModule) -> fx.Node:
    nodes = calls(module)
    assert len(nodes) == 1, f"expected one call, got {[n.format_node() for n in nodes]}"
    return nodes[0]


def buffer_of(module: fx.GraphModule, node: fx.Node) -> torch.Tensor:
    assert node.op == "get_attr", f"{node.format_node()} is not a get_attr"
    return getattr(module, node.target)


def conv_bn_model(pads: list[int], **conv_attrs: object) -> onnx.ModelProto:
    c_in, c_out = 5, 7
    inits = [
        const("conv.weight", RNG.standard_normal((c_out, c_in, 3, 3)).astype(np.float32) * 0.2),
        const("conv.bias", RNG.standard_normal(c_out)),
        const("bn.scale", RNG.uniform(0.5, 1.5, c_out)),
        const("bn.bias", RNG.standard_normal(c_out) * 0.2),
        const("bn.mean", RNG.standard_normal(c_out) * 0.2),
        const("bn.var", RNG.uniform(0.25, 1.75, c_out)),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "conv.weight", "conv.bias"], ["c"], pads=pads, **conv_attrs),
        helper.make_node("BatchNormalization", ["c", "bn.scale", "bn.bias", "bn.mean", "bn.var"], ["b"], epsilon=1e-3),
        helper.make_node("Relu", ["b"], ["y"]),
    ]
    return make_model(nodes, [info("x", ["N", c_in, 11, 9])], [info("y", None)], inits, opset=15)


def test_conv_bn_relu_forms() -> None:
    model = conv_bn_model([1, 1, 1, 1], strides=[2, 1], dilations=[1, 2])
    module = check_import(model, "conv-bn-relu")
    conv, bn, relu = calls(module)
    assert conv.target is F.conv2d
    x, w, b, stride, padding, dilation, groups = conv.args
    assert x.op == "placeholder"
    assert (stride, padding, dilation, groups) == ((2, 1), (1, 1), (1, 2), 1)
    init = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    assert np.array_equal(buffer_of(module, w).numpy(), init["conv.weight"])
    assert np.array_equal(buffer_of(module, b).numpy(), init["conv.bias"])
    assert w.target == "conv_weight", "initializer names become buffer names, sanitized"

    assert bn.target is F.batch_norm
    x, mean, var, weight, bias, training, momentum, eps = bn.args
    assert x is conv
    assert (training, momentum) == (False, 0.0)
    assert eps == pytest.approx(1e-3)
    for node, name in ((mean, "bn.mean"), (var, "bn.var"), (weight, "bn.scale"), (bias, "bn.bias")):
        assert np.array_equal(buffer_of(module, node).numpy(), init[name]), name
    assert relu.target is torch.relu and relu.args == (bn,)


def test_asymmetric_conv_pads_become_f_pad() -> None:
    module = check_import(conv_bn_model([0, 1, 2, 1]), "asymmetric conv")
    pad, conv = calls(module)[:2]
    assert pad.target is F.pad and pad.args[1] == [1, 1, 0, 2]
    assert conv.target is F.conv2d and conv.args[0] is pad and conv.args[4] == (0, 0)


@pytest.mark.parametrize(
    "op, attrs, target",
    [
        ("Relu", {}, torch.relu),
        ("Sigmoid", {}, torch.sigmoid),
        ("Tanh", {}, torch.tanh),
        ("Erf", {}, torch.erf),
        ("HardSwish", {}, F.hardswish),
        ("HardSigmoid", {"alpha": 1 / 6, "beta": 0.5}, F.hardsigmoid),
    ],
)
def test_activation_targets(op: str, attrs: dict, target: object) -> None:
    call = only_call(import_onnx(single_op(op, [["N", 3]], opset=17, **attrs)))
    assert call.target is target


def test_leaky_relu_and_gelu_arguments() -> None:
    call = only_call(import_onnx(single_op("LeakyRelu", [["N", 3]], opset=17, alpha=0.125)))
    assert call.target is F.leaky_relu and call.args[1] == pytest.approx(0.125)
    for approximate in ("none", "tanh"):
        call = only_call(import_onnx(single_op("Gelu", [["N", 3]], opset=20, approximate=approximate)))
        assert call.target is F.gelu and call.kwargs == {"approximate": approximate}


def test_clip_0_6_is_clamp_with_numbers() -> None:
    inits = [const("lo", np.float32(0.0)), const("hi", np.float32(6.0))]
    call = only_call(
        import_onnx(single_op("Clip", [["N", 3]], opset=13, initializers=inits, extra_inputs=["lo", "hi"]))
    )
    assert call.target is torch.clamp and call.args[1:] == (0.0, 6.0)
    assert all(type(a) is float for a in call.args[1:])


def test_silu_as_sigmoid_mul() -> None:
    nodes = [helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Mul", ["x", "s"], ["y"])]
    module = import_onnx(make_model(nodes, [info("x", ["N", 3])], [info("y", None)], opset=13))
    sigmoid, mul = calls(module)
    assert sigmoid.target is torch.sigmoid and mul.target is operator.mul
    assert mul.args[0].op == "placeholder" and mul.args[1] is sigmoid


@pytest.mark.parametrize(
    "op, target", [("Add", operator.add), ("Sub", operator.sub), ("Mul", operator.mul), ("Div", operator.truediv)]
)
def test_binary_scalar_constant_is_a_python_number(op: str, target: object) -> None:
    model = single_op(op, [["N", 3]], opset=13, initializers=[const("c", np.float32(0.5))], extra_inputs=["c"])
    call = only_call(import_onnx(model))
    assert call.target is target and call.args[1] == 0.5


def test_binary_tensor_constant_is_a_buffer() -> None:
    bias = RNG.standard_normal(3).astype(np.float32)
    model = single_op("Add", [["N", 3]], opset=13, initializers=[const("bias", bias)], extra_inputs=["bias"])
    module = import_onnx(model)
    call = only_call(module)
    assert call.target is operator.add and np.array_equal(buffer_of(module, call.args[1]).numpy(), bias)


def test_gemm_trans_b_is_linear_with_the_initializer() -> None:
    w, b = RNG.standard_normal((5, 3)).astype(np.float32), RNG.standard_normal(5).astype(np.float32)
    model = single_op(
        "Gemm", [["N", 3]], opset=13, initializers=[const("w", w), const("b", b)], extra_inputs=["w", "b"], transB=1
    )
    module = check_import(model, "Gemm transB=1")
    call = only_call(module)
    assert call.target is F.linear
    assert np.array_equal(buffer_of(module, call.args[1]).numpy(), w)
    assert np.array_equal(buffer_of(module, call.args[2]).numpy(), b)
    assert (call.args[1].target, call.args[2].target) == ("w", "b"), "the initializers themselves, by name"


def test_gemm_trans_b0_stores_the_transposed_weight() -> None:
    w = RNG.standard_normal((3, 5)).astype(np.float32)
    model = single_op("Gemm", [["N", 3]], opset=13, initializers=[const("w", w)], extra_inputs=["w"])
    module = check_import(model, "Gemm transB=0")
    call = only_call(module)
    assert call.target is F.linear and call.args[2] is None
    weight = buffer_of(module, call.args[1])
    assert np.array_equal(weight.numpy(), w.T) and weight.is_contiguous()
    assert call.args[1].target == "w_t"


def test_matmul_constant_weight_then_add() -> None:
    w, b = RNG.standard_normal((3, 5)).astype(np.float32), RNG.standard_normal(5).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["y"])]
    model = make_model(nodes, [info("x", ["N", 7, 3])], [info("y", None)], [const("w", w), const("b", b)], 13)
    matmul, add = calls(check_import(model, "MatMul + Add"))
    assert matmul.target is torch.matmul and matmul.args[1].op == "get_attr"
    assert add.target is operator.add and add.args[0] is matmul and add.args[1].op == "get_attr"


def test_inputs_keep_their_order_and_get_python_names() -> None:
    nodes = [helper.make_node("Sub", ["input.2", "1x"], ["y"])]
    model = make_model(nodes, [info("input.2", ["N", 3]), info("1x", ["N", 3])], [info("y", None)], opset=13)
    module = check_import(model, "sanitized names")
    names = [n.target for n in module.graph.nodes if n.op == "placeholder"]
    assert names == ["input_2", "input_1x"]


def test_two_outputs_are_a_tuple() -> None:
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Sigmoid", ["x"], ["b"])]
    model = make_model(nodes, [info("x", ["N", 3])], [info("a", None), info("b", None)], opset=13)
    out = import_onnx(model)(torch.randn(4, 3))
    assert isinstance(out, tuple) and len(out) == 2


def test_initializer_listed_as_input_is_a_constant() -> None:
    """IR < 4 lists initializers among the inputs (as defaults); they are constants, not arguments."""
    w = RNG.standard_normal((3,)).astype(np.float32)
    nodes = [helper.make_node("Mul", ["x", "w"], ["y"])]
    graph = helper.make_graph(nodes, "g", [info("x", ["N", 3]), info("w", [3])], [info("y", ["N", 3])], [const("w", w)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    module = check_import(model, "initializer as input")
    assert [n.target for n in module.graph.nodes if n.op == "placeholder"] == ["x"]


def test_the_model_proto_is_not_modified() -> None:
    model = conv_bn_model([1, 1, 1, 1])
    before = model.SerializeToString()
    import_onnx(model)
    assert model.SerializeToString() == before


def test_onnx_node_names_are_recorded() -> None:
    module = import_onnx(single_op("Relu", [["N", 3]], opset=13))
    assert only_call(module).meta["onnx_node"] == "Relu_0"


def test_batch_is_read_at_run_time() -> None:
    """Flatten of a batch-dynamic input, then a reshape using the batch: no size from import time."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["b"], axis=0),
        helper.make_node("Unsqueeze", ["b", "axes"], ["b1"]),
        helper.make_node("Concat", ["b1", "rest"], ["shape"], axis=0),
        helper.make_node("Reshape", ["x", "shape"], ["y"]),
    ]
    inits = [const("zero", np.int64(0)), const("axes", [0]), const("rest", [5, -1])]
    model = make_model(nodes, [info("x", ["N", 5, 3, 2])], [info("y", ["N", 5, 6])], inits, opset=13)
    module = check_import(model, "reshape with batch", batches=(1, 3))
    (size, reshape) = calls(module)
    assert size.target == "size" and size.args[1] == 0
    assert reshape.target is torch.reshape and reshape.args[1] == (size, 5, -1)
