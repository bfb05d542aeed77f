"""What an fx node is: the vocabulary the canonicalizer writes and the matcher reads.

After canonicalization (fuser.canonicalize) every fusable thing has one form:

    conv2d      torch.nn.functional.conv2d(x, weight, bias, stride, padding, dilation, groups)
    batch_norm  torch.nn.functional.batch_norm(x, mean, var, weight, bias, training, momentum, eps)
    linear      torch.nn.functional.linear(x, weight, bias)
    act         the canonical call of a row of fuser.activations, e.g. torch.nn.functional.silu(x)
    add         x + y (operator.add, torch.add without alpha, Tensor.add)
    scale       x * c or x / c with c a Python number

:func:`classify` maps a node to one of these kinds (or None); the ``read_*`` helpers bind a node's
arguments by name, whichever way the call was written (positional or keyword).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from fuser.activations import ACTIVATIONS, Activation
from fuser.match.tree_patterns import is_number

# The canonical call of each activation (what canonicalization writes), from the table of fuser.activations.
CANONICAL_ACTIVATION: dict[Activation, Any] = {row.act: row.call for row in ACTIVATIONS if row.act != Activation.NONE}

ADD_TARGETS = {operator.add, torch.add}
MUL_TARGETS = {operator.mul, torch.mul}
DIV_TARGETS = {operator.truediv, torch.div}
CAT_TARGETS = {torch.cat, torch.concat, torch.concatenate}

# Activation-like ops that no epilogue implements: a chain that ends in one says so in the report.
UNSUPPORTED_ACTIVATIONS: dict[Any, str] = {
    F.elu: "elu",
    F.selu: "selu",
    F.celu: "celu",
    F.softplus: "softplus",
    F.prelu: "prelu",
    F.logsigmoid: "logsigmoid",
    F.softsign: "softsign",
    nn.ELU: "elu",
    nn.SELU: "selu",
    nn.CELU: "celu",
    nn.Softplus: "softplus",
    nn.PReLU: "prelu",
    nn.LogSigmoid: "logsigmoid",
    nn.Softsign: "softsign",
}


def unsupported_successor(node: fx.Node, modules: dict[str, nn.Module]) -> str | None:
    """The name of the activation no epilogue implements that is ``node``'s only user, or None."""
    if len(node.users) != 1:
        return None
    user = next(iter(node.users))
    if user.op == "call_function":
        return UNSUPPORTED_ACTIVATIONS.get(user.target)
    if user.op == "call_module":
        return UNSUPPORTED_ACTIVATIONS.get(type(modules.get(str(user.target))))
    return None


CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
CONV_DEFAULTS = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}
BN_ARGS = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
BN_DEFAULTS = {"weight": None, "bias": None, "training": False, "momentum": 0.1, "eps": 1e-5}
LINEAR_ARGS = ("input", "weight", "bias")
LINEAR_DEFAULTS = {"bias": None}


def bind(node: fx.Node, names: tuple[str, ...], defaults: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by parameter name, whether they were passed by position or keyword."""
    out = dict(defaults)
    out.update(zip(names, node.args, strict=False))
    out.update({k: v for k, v in node.kwargs.items() if k in names})
    return out


@dataclass(frozen=True)
class OpInfo:
    """A classified node: its kind, its data input, and the kind-specific constants."""

    kind: str
    data: fx.Node
    act: Activation = Activation.NONE
    alpha: float = 0.0
    other: fx.Node | None = None  # the second operand of an add
    scale: float = 1.0


def read_activation(node: fx.Node) -> tuple[Activation, float] | None:
    """(activation, alpha) of a canonical activation call (exactly what canonicalization writes), or None."""
    if node.op != "call_function":
        return None
    for row in ACTIVATIONS:
        alpha = row.read_canonical(node)
        if alpha is not None:
            return row.act, alpha
    return None


def _tensor_operands(node: fx.Node) -> tuple[Any, Any] | None:
    if len(node.args) < 2:
        return None
    return node.args[0], node.args[1]


def classify(node: fx.Node, modules: dict[str, nn.Module]) -> OpInfo | None:
    """The kind of a canonical node, or None when it is not part of any chain vocabulary."""
    if node.op == "call_function":
        t = node.target
        if t is F.conv2d:
            return OpInfo("conv2d", node.args[0])
        if t is F.batch_norm:
            return OpInfo("batch_norm", node.args[0])
        if t is F.linear:
            return OpInfo("linear", node.args[0])
        act = read_activation(node)
        if act is not None:
            return OpInfo("act", node.args[0], act=act[0], alpha=act[1])
        if t in ADD_TARGETS and "alpha" not in node.kwargs:
            return _classify_add(node)
        if t in MUL_TARGETS or t in DIV_TARGETS:
            return _classify_scale(node, divide=t in DIV_TARGETS)
        return None
    if node.op == "call_method":
        if node.target == "add" and "alpha" not in node.kwargs:
            return _classify_add(node)
        if node.target in ("mul", "div"):
            return _classify_scale(node, divide=node.target == "div")
        return None
    if node.op == "call_module":
        module = modules.get(str(node.target))
        # Leaf modules left by canonicalization on purpose (training-mode BN, reflect-padded conv): the
        # matcher still sees them, so the guards can say why their chain is not fused.
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            return OpInfo("batch_norm", node.args[0])
        if isinstance(module, nn.Conv2d):
            return OpInfo("conv2d", node.args[0])
    return None


def _classify_add(node: fx.Node) -> OpInfo | None:
    pair = _tensor_operands(node)
    if pair is None or not all(isinstance(a, fx.Node) for a in pair):
        return None
    return OpInfo("add", pair[0], other=pair[1])


def _classify_scale(node: fx.Node, divide: bool) -> OpInfo | None:
    pair = _tensor_operands(node)
    if pair is None or node.kwargs:
        return None
    a, b = pair
    if isinstance(a, fx.Node) and is_number(b):
        factor = float(b)
    elif not divide and isinstance(b, fx.Node) and is_number(a):
        a, factor = b, float(a)
    else:
        return None
    if divide:
        if factor == 0:
            return None
        factor = 1.0 / factor
    return OpInfo("scale", a, scale=factor)


def fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    """The object at a dotted attribute path of ``gm`` (what a get_attr node reads)."""
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def constant_tensor(gm: fx.GraphModule, value: Any) -> torch.Tensor | None:
    """The tensor behind a get_attr node, or None when ``value`` is not such a node."""
    if isinstance(value, fx.Node) and value.op == "get_attr":
        obj = fetch_attr(gm, str(value.target))
        if isinstance(obj, torch.Tensor):
            return obj
    return None


def cat_operands(node: fx.Node) -> tuple[list[Any], Any] | None:
    """``(tensors, dim)`` of a plain ``torch.cat(tensors, dim)`` node; None for any other node, and for a
    cat with further arguments (``out=``), which a rewrite must not drop."""
    if node.op != "call_function" or node.target not in CAT_TARGETS:
        return None
    tensors = node.args[0] if node.args else node.kwargs.get("tensors")
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if not isinstance(tensors, (list, tuple)) or len(node.args) + len(node.kwargs) > 2:
        return None
    return list(tensors), dim


def unused_name(owner: nn.Module, stem: str) -> str:
    """``stem``, or ``stem_1``, ``stem_2``, ...: the first that is not an attribute of ``owner`` yet."""
    name, i = stem, 1
    while hasattr(owner, name):
        name, i = f"{stem}_{i}", i + 1
    return name


def int_pair(value: Any) -> tuple[int, int] | None:
    """``(a, b)`` for an int ``a == b`` or a sequence of one or two ints (a pool's or conv's window, stride,
    padding); None for anything else (a node, a 3-D window)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return (value, value)
    if isinstance(value, (tuple, list)) and len(value) in (1, 2) and all(type(v) is int for v in value):
        return (value[0], value[-1])
    return None


MAX_POOL_FUNCTIONS = frozenset({F.max_pool2d, torch.max_pool2d})
_MAX_POOL_ARGS = ("input", "kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices")


@dataclass(frozen=True)
class MaxPoolCall:
    """A 2-D max pool as the graph wrote it: ``nn.MaxPool2d`` or ``F.max_pool2d`` / ``torch.max_pool2d``,
    its arguments bound by name (``stride`` defaults to the window, as both forms define)."""

    input: Any
    kernel_size: Any
    stride: Any
    padding: Any = 0
    dilation: Any = 1
    ceil_mode: bool = False
    return_indices: bool = False


def read_max_pool(node: fx.Node, modules: dict[str, nn.Module]) -> MaxPoolCall | None:
    """The max pool ``node`` computes, or None when it is none (or its arguments cannot be bound)."""
    if node.op == "call_module" and isinstance(modules.get(str(node.target)), nn.MaxPool2d):
        m = modules[str(node.target)]
        if len(node.args) != 1 or node.kwargs:
            return None
        return MaxPoolCall(node.args[0], m.kernel_size, m.stride or m.kernel_size, m.padding, m.dilation,
                           m.ceil_mode, m.return_indices)  # fmt: skip
    if node.op != "call_function" or node.target not in MAX_POOL_FUNCTIONS or len(node.args) > len(_MAX_POOL_ARGS):
        return None
    values = dict(zip(_MAX_POOL_ARGS, node.args, strict=False)) | dict(node.kwargs)
    if "kernel_size" not in values or not set(values) <= set(_MAX_POOL_ARGS):
        return None
    values["stride"] = values.get("stride") or values["kernel_size"]
    return MaxPoolCall(**values)
