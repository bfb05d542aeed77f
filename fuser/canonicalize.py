"""Canonicalization: one form for each thing before matching (see fuser.graph_ops for the forms).

A rule is data: a name, a one-line description, and a function that rewrites one node and says whether it
did. :func:`canonicalize` drives every rule over the graph until none applies, so a rule never needs to know
about the others. Every rewrite keeps the function the graph computes; forms that cannot be rewritten
safely (an in-place activation whose input may alias another tensor, a BatchNorm in training mode) are left
as they are, and the matcher's guards report them.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from fuser.graph_ops import (
    ADD_TARGETS,
    CANONICAL_ACTIVATION,
    DIV_TARGETS,
    MUL_TARGETS,
    bind,
    constant_tensor,
    is_number,
    read_activation,
)
from fuser.kernels.epilogue import Activation
from fuser.passthrough import PASSTHROUGH_RULES


@dataclass
class Context:
    gm: fx.GraphModule
    modules: dict[str, nn.Module]
    order: dict[fx.Node, int]

    def refresh_order(self) -> None:
        self.order = {n: i for i, n in enumerate(self.gm.graph.nodes)}


@dataclass(frozen=True)
class Rule:
    name: str
    description: str
    apply: Callable[[fx.Node, Context], bool]


# ---------------------------------------------------------------------------------------------------------
# Helpers


def _replace(node: fx.Node, target: Any, args: tuple, kwargs: dict | None = None) -> fx.Node:
    """Insert ``target(*args, **kwargs)`` before ``node``, move node's users and meta to it, erase node."""
    graph = node.graph
    with graph.inserting_before(node):
        new = graph.call_function(target, args, kwargs or {})
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return new


def _erase_if_dead(*nodes: Any) -> None:
    for n in nodes:
        if isinstance(n, fx.Node) and not n.users and n.op in ("call_function", "call_method", "get_attr"):
            n.graph.erase_node(n)


def _canonical_activation_call(act: Activation, alpha: float, x: fx.Node) -> tuple[Any, tuple, dict]:
    target = CANONICAL_ACTIVATION[act]
    if act == Activation.LEAKY_RELU:
        return target, (x, alpha), {}
    if act in (Activation.GELU, Activation.GELU_TANH):
        return target, (x,), {"approximate": "tanh" if act == Activation.GELU_TANH else "none"}
    return target, (x,), {}


# Producers whose output is a fresh tensor: an in-place op on it cannot be seen through another alias.
_FRESH_FUNCTIONS = {
    F.conv2d,
    F.batch_norm,
    F.linear,
    *ADD_TARGETS,
    *MUL_TARGETS,
    *DIV_TARGETS,
    torch.cat,
    *CANONICAL_ACTIVATION.values(),
}
_FRESH_MODULES = (nn.Conv2d, nn.Linear, nn.modules.batchnorm._BatchNorm)


def _is_fresh(node: fx.Node, ctx: Context) -> bool:
    if node.op == "call_function":
        return node.target in _FRESH_FUNCTIONS
    if node.op == "call_module":
        return isinstance(ctx.modules.get(str(node.target)), _FRESH_MODULES)
    return False


def _make_out_of_place(node: fx.Node, x: fx.Node, target: Any, args: tuple, kwargs: dict, ctx: Context) -> bool:
    """Rewrite an in-place op on ``x`` out of place; later readers of ``x`` read the new value instead.

    Refused (returns False) when ``x`` may share memory with another tensor (a view, an input, a
    parameter), or when an earlier user of ``x`` might be a view that sees the mutation.
    """
    if not _is_fresh(x, ctx):
        return False
    here = ctx.order[node]
    earlier = [u for u in x.users if u is not node and ctx.order[u] < here]
    if any(not _is_fresh(u, ctx) for u in earlier):
        return False
    later = [u for u in x.users if u is not node and ctx.order[u] > here]
    new = _replace(node, target, args, kwargs)
    for u in later:
        u.replace_input_with(x, new)
    ctx.refresh_order()
    return True


# ---------------------------------------------------------------------------------------------------------
# Activation forms written as one call: modules, functions, methods, in-place or not.

# module type -> (activation, alpha) read from the module, or None when its settings are not an activation
_MODULE_ACTIVATIONS: dict[type, Callable[[nn.Module], tuple[Activation, float] | None]] = {
    nn.ReLU: lambda m: (Activation.RELU, 0.0),
    nn.ReLU6: lambda m: (Activation.RELU6, 0.0),
    nn.LeakyReLU: lambda m: (Activation.LEAKY_RELU, float(m.negative_slope)),
    nn.SiLU: lambda m: (Activation.SILU, 0.0),
    nn.Hardswish: lambda m: (Activation.HARDSWISH, 0.0),
    nn.GELU: lambda m: {"none": (Activation.GELU, 0.0), "tanh": (Activation.GELU_TANH, 0.0)}.get(m.approximate),
    nn.Sigmoid: lambda m: (Activation.SIGMOID, 0.0),
    nn.Tanh: lambda m: (Activation.TANH, 0.0),
    nn.Hardtanh: lambda m: (Activation.RELU6, 0.0) if (m.min_val, m.max_val) == (0.0, 6.0) else None,
}


def _clamp_is_relu6(lo: Any, hi: Any) -> bool:
    return is_number(lo) and is_number(hi) and float(lo) == 0.0 and float(hi) == 6.0


def _read_call_activation(node: fx.Node) -> tuple[Activation, float, bool] | None:
    """(activation, alpha, in_place) of a one-call activation written as a function or method."""
    a, kw = node.args, node.kwargs
    t = node.target
    inplace = bool(kw.get("inplace", False))
    if node.op == "call_method":
        method_acts = {"relu": Activation.RELU, "sigmoid": Activation.SIGMOID, "tanh": Activation.TANH}
        base = t.rstrip("_")
        if base in method_acts:
            return method_acts[base], 0.0, t.endswith("_")
        if base in ("clamp", "clip"):
            lo, hi = kw.get("min", a[1] if len(a) > 1 else None), kw.get("max", a[2] if len(a) > 2 else None)
            return (Activation.RELU6, 0.0, t.endswith("_")) if _clamp_is_relu6(lo, hi) else None
        return None
    if t in (F.relu, torch.relu):
        return Activation.RELU, 0.0, inplace or (len(a) > 1 and bool(a[1]))
    if t in (torch.relu_, F.relu_):
        return Activation.RELU, 0.0, True
    if t is F.silu:
        return Activation.SILU, 0.0, inplace or (len(a) > 1 and bool(a[1]))
    if t is F.relu6:
        return Activation.RELU6, 0.0, inplace or (len(a) > 1 and bool(a[1]))
    if t in (F.hardtanh, F.hardtanh_):
        lo, hi = (
            kw.get("min_val", a[1] if len(a) > 1 else -1.0),
            kw.get("max_val", a[2] if len(a) > 2 else 1.0),
        )
        inplace = inplace or t is F.hardtanh_ or (len(a) > 3 and bool(a[3]))
        return (Activation.RELU6, 0.0, inplace) if _clamp_is_relu6(lo, hi) else None
    if t in (torch.clamp, torch.clip, torch.clamp_, torch.clip_):
        lo, hi = kw.get("min", a[1] if len(a) > 1 else None), kw.get("max", a[2] if len(a) > 2 else None)
        return (Activation.RELU6, 0.0, t in (torch.clamp_, torch.clip_)) if _clamp_is_relu6(lo, hi) else None
    if t in (F.leaky_relu, F.leaky_relu_):
        slope = kw.get("negative_slope", a[1] if len(a) > 1 else 0.01)
        inplace = inplace or t is F.leaky_relu_ or (len(a) > 2 and bool(a[2]))
        return (Activation.LEAKY_RELU, float(slope), inplace) if is_number(slope) else None
    if t is F.hardswish:
        return Activation.HARDSWISH, 0.0, inplace or (len(a) > 1 and bool(a[1]))
    if t is F.gelu:
        approximate = kw.get("approximate", a[1] if len(a) > 1 else "none")
        act = {"none": Activation.GELU, "tanh": Activation.GELU_TANH}.get(approximate)
        return (act, 0.0, False) if act is not None else None
    if t in (torch.sigmoid, F.sigmoid):
        return Activation.SIGMOID, 0.0, False
    if t is torch.sigmoid_:
        return Activation.SIGMOID, 0.0, True
    if t in (torch.tanh, F.tanh):
        return Activation.TANH, 0.0, False
    if t is torch.tanh_:
        return Activation.TANH, 0.0, True
    return None


def _is_canonical_activation(node: fx.Node) -> bool:
    """True for exactly the call canonicalization writes (no inplace flag, canonical target and arguments)."""
    if node.op != "call_function" or read_activation(node) is None:
        return False
    act, _ = read_activation(node)
    if node.target is F.leaky_relu:
        return len(node.args) == 2 and not node.kwargs
    if node.target is F.gelu:
        return len(node.args) == 1 and set(node.kwargs) == {"approximate"}
    return len(node.args) == 1 and not node.kwargs and CANONICAL_ACTIVATION[act] is node.target


def rule_activation_one_call(node: fx.Node, ctx: Context) -> bool:
    if node.op == "call_module":
        module = ctx.modules.get(str(node.target))
        reader = _MODULE_ACTIVATIONS.get(type(module))
        found = reader(module) if reader is not None else None
        if found is None:
            return False
        act, alpha = found
        inplace = bool(getattr(module, "inplace", False))
    elif node.op in ("call_function", "call_method"):
        if _is_canonical_activation(node):
            return False
        found3 = _read_call_activation(node)
        if found3 is None:
            return False
        act, alpha, inplace = found3
    else:
        return False
    x = node.args[0] if node.args else node.kwargs.get("input")
    if not isinstance(x, fx.Node):
        return False
    target, args, kwargs = _canonical_activation_call(act, alpha, x)
    if inplace:
        return _make_out_of_place(node, x, target, args, kwargs, ctx)
    _replace(node, target, args, kwargs)
    return True


# ---------------------------------------------------------------------------------------------------------
# Activation forms written as several calls.


def _mul_operands(node: fx.Node) -> tuple[Any, Any] | None:
    """The two operands of a plain multiplication, or None."""
    is_mul = (node.op == "call_function" and node.target in MUL_TARGETS) or (
        node.op == "call_method" and node.target == "mul"
    )
    if is_mul and len(node.args) == 2 and not node.kwargs:
        return node.args[0], node.args[1]
    return None


def _is_activation(node: Any, act: Activation) -> bool:
    return isinstance(node, fx.Node) and read_activation(node) == (act, 0.0)


def _is_hardsigmoid(node: Any, ctx: Context) -> bool:
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_function" and node.target is F.hardsigmoid:
        return True
    return node.op == "call_module" and type(ctx.modules.get(str(node.target))) is nn.Hardsigmoid


def rule_mul_sigmoid_is_silu(node: fx.Node, ctx: Context) -> bool:
    ops = _mul_operands(node)
    if ops is None:
        return False
    for x, gate in (ops, ops[::-1]):
        if isinstance(x, fx.Node) and _is_activation(gate, Activation.SIGMOID) and gate.args[0] is x:
            _replace(node, F.silu, (x,))
            _erase_if_dead(gate)
            return True
    return False


def rule_mul_hardsigmoid_is_hardswish(node: fx.Node, ctx: Context) -> bool:
    ops = _mul_operands(node)
    if ops is None:
        return False
    for x, gate in (ops, ops[::-1]):
        if isinstance(x, fx.Node) and _is_hardsigmoid(gate, ctx) and gate.args and gate.args[0] is x:
            if gate.kwargs.get("inplace") or (len(gate.args) > 1 and gate.args[1]):
                return False
            if gate.op == "call_module" and getattr(ctx.modules[str(gate.target)], "inplace", False):
                return False
            _replace(node, F.hardswish, (x,))
            _erase_if_dead(gate)
            return True
    return False


def _number_operand(node: fx.Node, targets: set, method: str) -> tuple[fx.Node, float] | None:
    """(tensor operand, number) of a binary op with one Python-number operand, either side."""
    if not (
        (node.op == "call_function" and node.target in targets) or (node.op == "call_method" and node.target == method)
    ):
        return None
    if len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    if isinstance(a, fx.Node) and is_number(b):
        return a, float(b)
    if isinstance(b, fx.Node) and is_number(a) and node.target not in DIV_TARGETS:
        return b, float(a)
    return None


def _erf_argument_of(node: Any) -> tuple[fx.Node, list[fx.Node]] | None:
    """(x, the nodes between) when ``node`` is erf(x / sqrt(2)) or erf(x * (1 / sqrt(2)))."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is torch.erf):
        return None
    inner = node.args[0]
    if not isinstance(inner, fx.Node):
        return None
    div = _number_operand(inner, DIV_TARGETS, "div")
    if div is not None and math.isclose(div[1], math.sqrt(2.0), rel_tol=1e-4):
        return div[0], [inner]
    mul = _number_operand(inner, MUL_TARGETS, "mul")
    if mul is not None and math.isclose(mul[1], math.sqrt(0.5), rel_tol=1e-4):
        return mul[0], [inner]
    return None


def _cube_of(node: Any) -> tuple[fx.Node, list[fx.Node]] | None:
    """(x, the nodes between) when ``node`` is x ** 3, pow(x, 3), x * (x * x) or (x * x) * x."""
    if not isinstance(node, fx.Node):
        return None
    is_pow = (node.op == "call_function" and node.target in (torch.pow, operator.pow)) or (
        node.op == "call_method" and node.target == "pow"
    )
    if is_pow and len(node.args) == 2 and not node.kwargs and is_number(node.args[1]) and node.args[1] == 3:
        return (node.args[0], []) if isinstance(node.args[0], fx.Node) else None
    ops = _mul_operands(node)
    if ops is None:
        return None
    for x, square in (ops, ops[::-1]):
        inner = _mul_operands(square) if isinstance(square, fx.Node) else None
        if isinstance(x, fx.Node) and inner is not None and inner[0] is x and inner[1] is x:
            return x, [square]
    return None


def _tanh_argument_of(node: Any) -> tuple[fx.Node, list[fx.Node]] | None:
    """(x, the nodes between) when ``node`` is tanh(sqrt(2 / pi) * (x + 0.044715 * x^3))."""
    if not (isinstance(node, fx.Node) and read_activation(node) == (Activation.TANH, 0.0) and node.args):
        return None
    scaled = _number_operand(node.args[0], MUL_TARGETS, "mul") if isinstance(node.args[0], fx.Node) else None
    if scaled is None or not math.isclose(scaled[1], math.sqrt(2.0 / math.pi), rel_tol=1e-4):
        return None
    total = scaled[0]
    is_add = (total.op == "call_function" and total.target in ADD_TARGETS) or (
        total.op == "call_method" and total.target == "add"
    )
    if not is_add or len(total.args) != 2 or total.kwargs:
        return None
    for x, cubic in (total.args, total.args[::-1]):
        term = _number_operand(cubic, MUL_TARGETS, "mul") if isinstance(cubic, fx.Node) else None
        if term is None or not math.isclose(term[1], 0.044715, rel_tol=1e-4):
            continue
        cube = _cube_of(term[0])
        if cube is not None and cube[0] is x:
            return x, [node.args[0], total, cubic, term[0], *cube[1]]
    return None


# The gates of the written-out GELUs: erf(x / sqrt(2)) is the exact GELU, the tanh polynomial the approximation.
_GELU_GATES = ((_erf_argument_of, "none"), (_tanh_argument_of, "tanh"))


def rule_written_out_gelu(node: fx.Node, ctx: Context) -> bool:
    """0.5 * x * (1 + erf(x / sqrt(2))) and 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3))), in the
    association orders exporters and hand-written models use, become gelu(x) (approximate "none" / "tanh")."""
    ops = _mul_operands(node)
    if ops is None:
        return False
    half = _number_operand(node, MUL_TARGETS, "mul")
    if half is not None and half[1] == 0.5:
        # (x * (1 + gate(x))) * 0.5
        product = _mul_operands(half[0])
        candidates = [(product, half[0])] if product is not None else []
    else:
        # (x * 0.5) * (1 + gate(x))
        candidates = [(ops, None)]
    for pair, inner_mul in candidates:
        for left, right in (pair, pair[::-1]):
            one_plus = _number_operand(right, ADD_TARGETS, "add") if isinstance(right, fx.Node) else None
            if one_plus is None or one_plus[1] != 1.0:
                continue
            for gate_argument, approximate in _GELU_GATES:
                found = gate_argument(one_plus[0])
                if found is None:
                    continue
                x, between = found
                if inner_mul is not None and left is x:
                    _replace(node, F.gelu, (x,), {"approximate": approximate})
                    _erase_if_dead(inner_mul, right, one_plus[0], *between)
                    return True
                if inner_mul is None and isinstance(left, fx.Node):
                    scaled = _number_operand(left, MUL_TARGETS, "mul")
                    if scaled is not None and scaled[0] is x and scaled[1] == 0.5:
                        _replace(node, F.gelu, (x,), {"approximate": approximate})
                        _erase_if_dead(left, right, one_plus[0], *between)
                        return True
    return False


# ---------------------------------------------------------------------------------------------------------
# Layers: modules to functional calls with their parameters read through get_attr.


def _get_attr(ctx: Context, before: fx.Node, target: str) -> fx.Node:
    with ctx.gm.graph.inserting_before(before):
        return ctx.gm.graph.get_attr(target)


def rule_conv_module(node: fx.Node, ctx: Context) -> bool:
    if node.op != "call_module":
        return False
    m = ctx.modules.get(str(node.target))
    if type(m) is not nn.Conv2d or m.padding_mode != "zeros" or len(node.args) != 1 or node.kwargs:
        return False
    w = _get_attr(ctx, node, f"{node.target}.weight")
    b = _get_attr(ctx, node, f"{node.target}.bias") if m.bias is not None else None
    _replace(node, F.conv2d, (node.args[0], w, b, m.stride, m.padding, m.dilation, m.groups))
    ctx.refresh_order()
    return True


def rule_batchnorm_module(node: fx.Node, ctx: Context) -> bool:
    if node.op != "call_module":
        return False
    m = ctx.modules.get(str(node.target))
    if type(m) not in (nn.BatchNorm2d, nn.SyncBatchNorm) or len(node.args) != 1 or node.kwargs:
        return False
    if m.training or m.running_mean is None or m.running_var is None:
        return False  # uses batch statistics: left as is, and reported by the BN guard
    names = ["running_mean", "running_var"] + (["weight", "bias"] if m.affine else [])
    attrs = [_get_attr(ctx, node, f"{node.target}.{n}") for n in names]
    weight, bias = (attrs[2], attrs[3]) if m.affine else (None, None)
    _replace(node, F.batch_norm, (node.args[0], attrs[0], attrs[1], weight, bias, False, 0.0, m.eps))
    ctx.refresh_order()
    return True


def rule_linear_module(node: fx.Node, ctx: Context) -> bool:
    if node.op != "call_module":
        return False
    m = ctx.modules.get(str(node.target))
    if type(m) is not nn.Linear or len(node.args) != 1 or node.kwargs:
        return False
    w = _get_attr(ctx, node, f"{node.target}.weight")
    b = _get_attr(ctx, node, f"{node.target}.bias") if m.bias is not None else None
    _replace(node, F.linear, (node.args[0], w, b))
    ctx.refresh_order()
    return True


def _register_constant(ctx: Context, base: str, value: torch.Tensor) -> str:
    """Register a new constant tensor on the graph module under a free name derived from ``base``."""
    stem = base.replace(".", "_")
    name, i = stem, 1
    while hasattr(ctx.gm, name):
        name, i = f"{stem}_{i}", i + 1
    ctx.gm.register_buffer(name, value)
    return name


def rule_matmul_constant_is_linear(node: fx.Node, ctx: Context) -> bool:
    """x @ W (W a constant [K, N]) becomes linear(x, W^T): one GEMM form for the matcher."""
    is_matmul = (node.op == "call_function" and node.target in (torch.matmul, operator.matmul, torch.mm)) or (
        node.op == "call_method" and node.target in ("matmul", "mm")
    )
    if not is_matmul or len(node.args) != 2 or node.kwargs:
        return False
    x, w_node = node.args
    w = constant_tensor(ctx.gm, w_node)
    if not isinstance(x, fx.Node) or w is None or w.dim() != 2:
        return False
    name = _register_constant(ctx, f"{w_node.target}_t", w.detach().t().contiguous())
    _replace(node, F.linear, (x, _get_attr(ctx, node, name), None))
    _erase_if_dead(w_node)
    ctx.refresh_order()
    return True


def rule_addmm_is_linear(node: fx.Node, ctx: Context) -> bool:
    """addmm(b, x, W) with constant W [K, N] becomes linear(x, W^T, b)."""
    if not (node.op == "call_function" and node.target is torch.addmm and len(node.args) == 3 and not node.kwargs):
        return False
    b_node, x, w_node = node.args
    w = constant_tensor(ctx.gm, w_node)
    if not isinstance(x, fx.Node) or w is None or w.dim() != 2 or constant_tensor(ctx.gm, b_node) is None:
        return False
    name = _register_constant(ctx, f"{w_node.target}_t", w.detach().t().contiguous())
    _replace(node, F.linear, (x, _get_attr(ctx, node, name), b_node))
    _erase_if_dead(w_node)
    ctx.refresh_order()
    return True


def rule_linear_plus_constant_is_bias(node: fx.Node, ctx: Context) -> bool:
    """linear(x, W) + b (b a constant of N elements along the last dim) becomes linear(x, W, b)."""
    if not (
        (node.op == "call_function" and node.target in ADD_TARGETS)
        or (node.op == "call_method" and node.target == "add")
    ):
        return False
    if len(node.args) != 2 or node.kwargs:
        return False
    for lin, b_node in (node.args, node.args[::-1]):
        if not (isinstance(lin, fx.Node) and lin.op == "call_function" and lin.target is F.linear):
            continue
        args = bind(lin, ("input", "weight", "bias"), {"bias": None})
        bias = constant_tensor(ctx.gm, b_node)
        weight = constant_tensor(ctx.gm, args["weight"])
        if args["bias"] is not None or bias is None or weight is None or len(lin.users) != 1:
            continue
        n = weight.shape[0]
        if bias.numel() != n or (bias.dim() > 0 and bias.shape[-1] != n) or bias.dtype != weight.dtype:
            continue
        target = str(b_node.target)
        if bias.dim() > 1:
            # A [1, ..., N] bias also broadcasts the output to its rank: fold it only when that changes nothing.
            if lin.meta.get("tensor_meta") is None or len(lin.meta["tensor_meta"].shape) < bias.dim():
                continue
            target = _register_constant(ctx, f"{target}_flat", bias.detach().reshape(n).clone())
        lin.args = (args["input"], args["weight"], _get_attr(ctx, lin, target))
        lin.kwargs = {}
        node.replace_all_uses_with(lin)
        ctx.gm.graph.erase_node(node)
        _erase_if_dead(b_node)
        ctx.refresh_order()
        return True
    return False


# Ordered: layer modules first (so activation rules see fresh producers), then single-call activations,
# then multi-call forms built on the canonical single calls.
RULES: list[Rule] = [
    *(Rule(*rule) for rule in PASSTHROUGH_RULES),  # ops that pass their value through vanish first
    # nn.Conv2d (zeros padding) -> F.conv2d(x, weight, bias, stride, padding, dilation, groups)
    Rule("conv_module", "nn.Conv2d -> F.conv2d with get_attr parameters", rule_conv_module),
    # nn.BatchNorm2d in eval with running stats -> F.batch_norm(x, mean, var, w, b, False, 0, eps)
    Rule("batchnorm_module", "eval nn.BatchNorm2d -> F.batch_norm(training=False)", rule_batchnorm_module),
    # nn.Linear -> F.linear(x, weight, bias)
    Rule("linear_module", "nn.Linear -> F.linear with get_attr parameters", rule_linear_module),
    # x @ W, torch.matmul(x, W), x.mm(W) with constant W -> F.linear(x, W^T)
    Rule("matmul_constant", "matmul by a constant matrix -> F.linear", rule_matmul_constant_is_linear),
    # torch.addmm(b, x, W) with constants b, W -> F.linear(x, W^T, b)
    Rule("addmm", "addmm with constant operands -> F.linear", rule_addmm_is_linear),
    # F.linear(x, W) + b with constant b over the last dim -> F.linear(x, W, b)
    Rule("linear_bias", "linear + constant bias -> linear with bias", rule_linear_plus_constant_is_bias),
    # nn.SiLU(), F.relu(x, inplace=True), x.relu_(), F.hardtanh(x, 0, 6), x.clamp(0, 6), ... -> canonical call
    Rule("activation_call", "any one-call activation form -> its canonical call", rule_activation_one_call),
    # x * torch.sigmoid(x), x.sigmoid() * x -> F.silu(x)
    Rule("silu_product", "x * sigmoid(x) -> silu(x)", rule_mul_sigmoid_is_silu),
    # x * F.hardsigmoid(x) (ONNX HardSigmoid + Mul) -> F.hardswish(x)
    Rule("hardswish_product", "x * hardsigmoid(x) -> hardswish(x)", rule_mul_hardsigmoid_is_hardswish),
    # 0.5 * x * (1 + erf(x / sqrt(2))) (ONNX Erf-form GELU) and its tanh approximation written out -> F.gelu(x)
    Rule("gelu_written_out", "erf- and tanh-form GELU -> gelu(x)", rule_written_out_gelu),
]


def canonicalize(gm: fx.GraphModule, rules: list[Rule] | None = None) -> list[str]:
    """Rewrite ``gm`` in place to canonical forms; returns the names of the rules that fired, in order.

    An empty list means nothing changed. The graph is linted and recompiled when anything did.
    """
    rules = RULES if rules is None else rules
    ctx = Context(gm, dict(gm.named_modules()), {})
    ctx.refresh_order()
    fired: list[str] = []
    changed = True
    while changed:
        changed = False
        for node in list(gm.graph.nodes):
            if node.graph is not gm.graph or node not in ctx.order:
                continue  # erased by an earlier rewrite in this sweep
            for rule in rules:
                if rule.apply(node, ctx):
                    fired.append(rule.name)
                    changed = True
                    ctx.refresh_order()
                    break
    if fired:
        gm.graph.lint()
        gm.recompile()
    return fired
