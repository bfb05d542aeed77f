"""The activations a fused epilogue applies: one table (:data:`ACTIVATIONS`), from which every other place
that names an activation is derived.

Each row (:class:`ActivationSpec`) says, for one :class:`Activation`:

- ``formula`` and ``reference``: what it computes, in torch (the "torch" backend and the tests' float64 oracle);
- ``call`` (+ ``call_kwargs``, ``alpha_arg``): the canonical fx call canonicalization writes and the matcher
  reads (fuser.graph_ops);
- ``modules``, ``functions``, ``methods``: the one-call forms users write, each with a reader that returns
  ``(alpha, in_place)`` or None when the call's arguments make it something else (``clamp(0, 5)``);
- ``written_out``: the forms spelled over several calls (``x * sigmoid(x)``, the erf GELU), as tree patterns
  (fuser.match.tree_patterns), each a canonicalization rule with a name and a one-line description;
- ``onnx_in``: the ONNX ops imported as this activation (fuser.onnx.convert_activations), ``onnx_out``: the ops
  torch's ONNX exporter writes for it, from which opset;
- ``triton``: the ``@triton.jit`` function of fuser.kernels.epilogue that computes it, selected in
  ``apply_activation`` by the constexpr named :attr:`ActivationSpec.constexpr`.

The tests iterate over this table (kernels, forms, ONNX in and out, the models' chain counts), so a new row is
tested everywhere or the suite fails. EXTENDING.md walks through adding one. This module imports torch but
not triton: the graph side reads it without loading the kernels.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fuser.match.tree_patterns import (
    ERF,
    SOFTPLUS,
    OpFamily,
    Pattern,
    Var,
    add,
    any_of,
    div,
    is_number,
    mul,
    op,
    power,
)


class Activation(enum.IntEnum):
    """Activations a fused kernel applies in its epilogue. The values are the kernels' constexprs and part of
    the custom ops' schema (an int argument): never renumber, only append."""

    NONE = 0
    RELU = 1
    RELU6 = 2
    LEAKY_RELU = 3
    SILU = 4
    HARDSWISH = 5
    GELU = 6
    GELU_TANH = 7
    SIGMOID = 8
    TANH = 9
    HARDSIGMOID = 10
    MISH = 11


# ---------------------------------------------------------------------------------------------------------
# Readers of one-call forms: (args, kwargs) of the fx node -> (alpha, in_place), or None when not this activation.

CallReader = Callable[[tuple, dict], "tuple[float, bool] | None"]
ModuleReader = Callable[[nn.Module], "float | None"]  # the module's alpha, or None when it is not this activation


def _bind(args: tuple, kwargs: dict, params: tuple[str, ...], defaults: dict[str, Any]) -> dict[str, Any] | None:
    """Arguments by name; None when the call passes more, or other, arguments than ``params``."""
    if len(args) > len(params) or set(kwargs) - set(params):
        return None
    bound = {**defaults, **dict(zip(params, args, strict=False)), **kwargs}
    return bound if "input" in bound else None


def flag(*params: str, in_place: bool = False) -> CallReader:
    """A call whose only option is an ``inplace`` flag (``F.silu(x, inplace=True)``), or an always in-place
    call (``torch.relu_``, ``x.sigmoid_()``)."""
    params = ("input", *params)

    def read(args: tuple, kwargs: dict) -> tuple[float, bool] | None:
        bound = _bind(args, kwargs, params, {"inplace": False})
        return None if bound is None else (0.0, in_place or bool(bound["inplace"]))

    return read


def bounds(lo: str, hi: str, defaults: tuple[Any, Any], *more: str, in_place: bool = False) -> CallReader:
    """A clamp written as ``clamp(x, 0, 6)`` / ``hardtanh(x, 0., 6.)``: relu6 only for the bounds (0, 6)."""
    params = ("input", lo, hi, *more)

    def read(args: tuple, kwargs: dict) -> tuple[float, bool] | None:
        bound = _bind(args, kwargs, params, {lo: defaults[0], hi: defaults[1], "inplace": False})
        if bound is None or not (is_number(bound[lo]) and is_number(bound[hi])):
            return None
        if (float(bound[lo]), float(bound[hi])) != (0.0, 6.0):
            return None
        return 0.0, in_place or bool(bound["inplace"])

    return read


def slope(in_place: bool = False) -> CallReader:
    """``F.leaky_relu(x, negative_slope=0.01, inplace=False)``: alpha is the slope."""

    def read(args: tuple, kwargs: dict) -> tuple[float, bool] | None:
        bound = _bind(args, kwargs, ("input", "negative_slope", "inplace"), {"negative_slope": 0.01, "inplace": False})
        if bound is None or not is_number(bound["negative_slope"]):
            return None
        return float(bound["negative_slope"]), in_place or bool(bound["inplace"])

    return read


def approximate(value: str) -> CallReader:
    """``F.gelu(x, approximate=...)``: this row only for one value of ``approximate``."""

    def read(args: tuple, kwargs: dict) -> tuple[float, bool] | None:
        bound = _bind(args, kwargs, ("input", "approximate"), {"approximate": "none"})
        return (0.0, False) if bound is not None and bound["approximate"] == value else None

    return read


def always(alpha: float = 0.0) -> ModuleReader:
    return lambda module: alpha


# ---------------------------------------------------------------------------------------------------------
# The table's row types.


@dataclass(frozen=True)
class WrittenOut:
    """A form written over several calls: a tree pattern binding ``x``, rewritten to the row's canonical call."""

    name: str  # the canonicalization rule's name (the fusion report lists the rules that fired)
    description: str  # one line
    pattern: Pattern


@dataclass(frozen=True)
class OnnxForm:
    """An ONNX op imported as this activation, from opset ``since``.

    ``attributes`` are (name, default, value) triples the node must carry for it to be this activation (the
    converter handles other values itself, or refuses them); ``alpha`` is the attribute that becomes alpha.
    """

    op_type: str
    since: int
    attributes: tuple[tuple[str, Any, Any], ...] = ()
    alpha: tuple[str, float] | None = None


@dataclass(frozen=True)
class ActivationSpec:
    """One row of :data:`ACTIVATIONS` (see the module docstring for the columns)."""

    act: Activation
    formula: str
    reference: Callable[[torch.Tensor, float], torch.Tensor]
    call: Callable[..., torch.Tensor]
    triton: str
    call_kwargs: tuple[tuple[str, Any], ...] = ()
    alpha_arg: str | None = None
    modules: dict[type[nn.Module], ModuleReader] = field(default_factory=dict)
    functions: dict[Any, CallReader] = field(default_factory=dict)
    methods: dict[str, CallReader] = field(default_factory=dict)
    written_out: tuple[WrittenOut, ...] = ()
    onnx_in: tuple[OnnxForm, ...] = ()
    onnx_out: dict[int, tuple[str, ...]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The lower-case name the report uses ("silu", "gelu_tanh")."""
        return self.act.name.lower()

    @property
    def constexpr(self) -> str:
        """The name of the ``tl.constexpr`` in fuser.kernels.epilogue that selects ``triton``."""
        return f"ACT_{self.act.name}"

    def canonical_call(self, x: Any, alpha: float = 0.0) -> tuple[Callable, tuple, dict]:
        """(target, args, kwargs) of the call canonicalization writes for this activation of ``x``."""
        args = (x, float(alpha)) if self.alpha_arg else (x,)
        return self.call, args, dict(self.call_kwargs)

    def read_canonical(self, node: Any) -> float | None:
        """alpha when the fx node is exactly this row's canonical call (of any input), else None."""
        if getattr(node, "op", None) != "call_function" or node.target is not self.call:
            return None
        if dict(node.kwargs) != dict(self.call_kwargs):
            return None
        if self.alpha_arg:
            ok = len(node.args) == 2 and is_number(node.args[1])
            return float(node.args[1]) if ok else None
        return 0.0 if len(node.args) == 1 else None

    @property
    def family(self) -> OpFamily:
        """The canonical call as an operation of the tree patterns (alpha-free rows only)."""
        return OpFamily(
            self.name,
            frozenset({self.call}),
            operands=lambda node, arity: (node.args[0],) if self.read_canonical(node) == 0.0 else None,
        )

    def onnx_out_at(self, opset: int) -> tuple[str, ...]:
        """The ONNX op types torch's exporter writes for this activation at ``opset``."""
        since = [v for v in self.onnx_out if v <= opset]
        return self.onnx_out[max(since)] if since else ()


# ---------------------------------------------------------------------------------------------------------
# Tree patterns of the written-out forms (X is the activation's input).

X = Var("x")
_SQRT_2 = math.sqrt(2.0)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _gelu_of(gate: Pattern) -> Pattern:
    """0.5 * x * (1 + gate) in the association orders exporters and models use (mul is commutative)."""
    one_plus = add(gate, 1.0)
    return any_of(mul(mul(X, one_plus), 0.5), mul(mul(X, 0.5), one_plus), mul(X, mul(one_plus, 0.5)))


def _cube(x: Pattern) -> Pattern:
    return any_of(power(x, 3.0), mul(x, mul(x, x)))


def _relu6_x_plus_3_over_6(inner: Pattern) -> Pattern:
    """``inner / 6`` or ``inner * (1 / 6)``."""
    return any_of(div(inner, 6.0), mul(inner, 1.0 / 6.0))


def _written_out(rows: dict[Activation, ActivationSpec]) -> dict[Activation, tuple[WrittenOut, ...]]:
    """The written-out forms of each row; they name other rows' canonical calls, so they are made after them."""
    sigmoid, tanh, relu6, hardsigmoid = (
        rows[a].family for a in (Activation.SIGMOID, Activation.TANH, Activation.RELU6, Activation.HARDSIGMOID)
    )
    relu6_x_plus_3 = op(relu6, add(X, 3.0))
    return {
        Activation.SILU: (WrittenOut("silu_product", "x * sigmoid(x) -> silu(x)", mul(X, op(sigmoid, X))),),
        Activation.HARDSIGMOID: (
            WrittenOut(
                "hardsigmoid_written_out",
                "relu6(x + 3) / 6 (and * (1/6)) -> hardsigmoid(x)",
                _relu6_x_plus_3_over_6(relu6_x_plus_3),
            ),
        ),
        Activation.HARDSWISH: (
            WrittenOut("hardswish_product", "x * hardsigmoid(x) -> hardswish(x)", mul(X, op(hardsigmoid, X))),
            WrittenOut(
                "hardswish_written_out",
                "x * relu6(x + 3) / 6 -> hardswish(x)",
                _relu6_x_plus_3_over_6(mul(X, relu6_x_plus_3)),
            ),
        ),
        Activation.MISH: (
            WrittenOut(
                "mish_written_out",
                "x * tanh(softplus(x)) -> mish(x)",
                mul(X, op(tanh, op(SOFTPLUS, X))),
            ),
        ),
        Activation.GELU: (
            WrittenOut(
                "gelu_erf_written_out",
                "0.5 * x * (1 + erf(x / sqrt(2))) -> gelu(x)",
                _gelu_of(op(ERF, any_of(div(X, _SQRT_2), mul(X, 1.0 / _SQRT_2)))),
            ),
        ),
        Activation.GELU_TANH: (
            WrittenOut(
                "gelu_tanh_written_out",
                "0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))) -> gelu(x, approximate='tanh')",
                _gelu_of(op(tanh, mul(_SQRT_2_OVER_PI, add(X, mul(0.044715, _cube(X)))))),
            ),
        ),
    }


_ROWS: tuple[ActivationSpec, ...] = (
    ActivationSpec(Activation.NONE, "x", lambda y, a: y, call=lambda x: x, triton="_identity"),
    ActivationSpec(
        Activation.RELU,
        "max(x, 0)",
        lambda y, a: torch.relu(y),
        call=torch.relu,
        triton="_relu",
        modules={nn.ReLU: always()},
        functions={
            F.relu: flag("inplace"),
            torch.relu: flag(),
            torch.relu_: flag(in_place=True),  # also F.relu_ (the same function)
        },
        methods={"relu": flag(), "relu_": flag(in_place=True)},
        onnx_in=(OnnxForm("Relu", 6),),
        onnx_out={1: ("Relu",)},
    ),
    ActivationSpec(
        Activation.RELU6,
        "min(max(x, 0), 6)",
        lambda y, a: F.relu6(y),
        call=F.relu6,
        triton="_relu6",
        modules={
            nn.ReLU6: always(),
            nn.Hardtanh: lambda m: 0.0 if (m.min_val, m.max_val) == (0.0, 6.0) else None,
        },
        functions={
            F.relu6: flag("inplace"),
            F.hardtanh: bounds("min_val", "max_val", (-1.0, 1.0), "inplace"),
            F.hardtanh_: bounds("min_val", "max_val", (-1.0, 1.0), in_place=True),
            torch.clamp: bounds("min", "max", (None, None)),
            torch.clip: bounds("min", "max", (None, None)),
            torch.clamp_: bounds("min", "max", (None, None), in_place=True),
            torch.clip_: bounds("min", "max", (None, None), in_place=True),
        },
        methods={
            "clamp": bounds("min", "max", (None, None)),
            "clip": bounds("min", "max", (None, None)),
            "clamp_": bounds("min", "max", (None, None), in_place=True),
            "clip_": bounds("min", "max", (None, None), in_place=True),
        },
        onnx_out={1: ("Clip",)},  # Clip(0, 6) comes in through the Clip converter as torch.clamp(x, 0.0, 6.0)
    ),
    ActivationSpec(
        Activation.LEAKY_RELU,
        "x if x >= 0 else alpha * x",
        lambda y, a: F.leaky_relu(y, a),
        call=F.leaky_relu,
        alpha_arg="negative_slope",
        triton="_leaky_relu",
        modules={nn.LeakyReLU: lambda m: float(m.negative_slope)},
        functions={F.leaky_relu: slope(), F.leaky_relu_: slope(in_place=True)},
        onnx_in=(OnnxForm("LeakyRelu", 6, alpha=("alpha", 0.01)),),
        onnx_out={1: ("LeakyRelu",)},
    ),
    ActivationSpec(
        Activation.SILU,
        "x * sigmoid(x)",
        lambda y, a: F.silu(y),
        call=F.silu,
        triton="_silu",
        modules={nn.SiLU: always()},
        functions={F.silu: flag("inplace")},
        onnx_out={1: ("Sigmoid", "Mul")},
    ),
    ActivationSpec(
        Activation.HARDSWISH,
        "x * relu6(x + 3) / 6",
        lambda y, a: F.hardswish(y),
        call=F.hardswish,
        triton="_hardswish",
        modules={nn.Hardswish: always()},
        functions={F.hardswish: flag("inplace")},
        onnx_in=(OnnxForm("HardSwish", 14),),
        onnx_out={14: ("HardSwish",)},
    ),
    ActivationSpec(
        Activation.GELU,
        "0.5 * x * (1 + erf(x / sqrt(2)))",
        lambda y, a: F.gelu(y),
        call=F.gelu,
        call_kwargs=(("approximate", "none"),),
        triton="_gelu",
        modules={nn.GELU: lambda m: 0.0 if m.approximate == "none" else None},
        functions={F.gelu: approximate("none")},
        onnx_in=(OnnxForm("Gelu", 20, attributes=(("approximate", "none", "none"),)),),
        onnx_out={1: ("Div", "Erf", "Add", "Mul"), 20: ("Gelu",)},
    ),
    ActivationSpec(
        Activation.GELU_TANH,
        "0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3)))",
        lambda y, a: F.gelu(y, approximate="tanh"),
        call=F.gelu,
        call_kwargs=(("approximate", "tanh"),),
        triton="_gelu_tanh",
        modules={nn.GELU: lambda m: 0.0 if m.approximate == "tanh" else None},
        functions={F.gelu: approximate("tanh")},
        onnx_in=(OnnxForm("Gelu", 20, attributes=(("approximate", "none", "tanh"),)),),
        onnx_out={1: ("Tanh", "Add", "Mul"), 20: ("Gelu",)},
    ),
    ActivationSpec(
        Activation.SIGMOID,
        "1 / (1 + exp(-x))",
        lambda y, a: torch.sigmoid(y),
        call=torch.sigmoid,
        triton="_sigmoid",
        modules={nn.Sigmoid: always()},
        functions={torch.sigmoid: flag(), torch.sigmoid_: flag(in_place=True)},  # F.sigmoid traces as x.sigmoid()
        methods={"sigmoid": flag(), "sigmoid_": flag(in_place=True)},
        onnx_in=(OnnxForm("Sigmoid", 6),),
        onnx_out={1: ("Sigmoid",)},
    ),
    ActivationSpec(
        Activation.TANH,
        "tanh(x)",
        lambda y, a: torch.tanh(y),
        call=torch.tanh,
        triton="_tanh",
        modules={nn.Tanh: always()},
        functions={torch.tanh: flag(), torch.tanh_: flag(in_place=True)},  # F.tanh traces as x.tanh()
        methods={"tanh": flag(), "tanh_": flag(in_place=True)},
        onnx_in=(OnnxForm("Tanh", 6),),
        onnx_out={1: ("Tanh",)},
    ),
    ActivationSpec(
        Activation.HARDSIGMOID,
        "relu6(x + 3) / 6",
        lambda y, a: F.hardsigmoid(y),
        call=F.hardsigmoid,
        triton="_hardsigmoid",
        modules={nn.Hardsigmoid: always()},
        functions={F.hardsigmoid: flag("inplace")},
        # torch's hardsigmoid is ONNX's HardSigmoid with alpha=1/6, beta=0.5; other values are another
        # function, which the HardSigmoid converter writes out exactly (clamp(alpha * x + beta, 0, 1)).
        onnx_in=(OnnxForm("HardSigmoid", 6, attributes=(("alpha", 0.2, 1.0 / 6.0), ("beta", 0.5, 0.5))),),
        onnx_out={1: ("HardSigmoid",)},
    ),
    ActivationSpec(
        Activation.MISH,
        "x * tanh(softplus(x))",
        lambda y, a: F.mish(y),
        call=F.mish,
        triton="_mish",
        modules={nn.Mish: always()},
        functions={F.mish: flag("inplace")},
        onnx_in=(OnnxForm("Mish", 18),),
        onnx_out={1: ("Softplus", "Tanh", "Mul")},
    ),
)

_FORMS = _written_out({row.act: row for row in _ROWS})
ACTIVATIONS: tuple[ActivationSpec, ...] = tuple(replace(row, written_out=_FORMS.get(row.act, ())) for row in _ROWS)
SPECS: dict[Activation, ActivationSpec] = {row.act: row for row in ACTIVATIONS}

# Activations as the report names them: "silu" -> Activation.SILU.
BY_NAME: dict[str, Activation] = {spec.name: spec.act for spec in ACTIVATIONS}


def spec(act: Activation | int) -> ActivationSpec:
    """The table row of ``act`` (ValueError for a value that is not an activation)."""
    return SPECS[Activation(act)]


def apply_activation_torch(y: torch.Tensor, act: Activation | int, alpha: float = 0.0) -> torch.Tensor:
    """The torch reference of ``act`` (out of place), read from the table."""
    return spec(act).reference(y, alpha)


def module_activation(module: nn.Module) -> tuple[Activation, float] | None:
    """(activation, alpha) of an activation module (exact type: a subclass may override forward), or None."""
    for row in ACTIVATIONS:
        reader = row.modules.get(type(module))
        alpha = reader(module) if reader is not None else None
        if alpha is not None:
            return row.act, alpha
    return None


def _call_forms() -> dict[tuple[str, Any], list[tuple[Activation, CallReader]]]:
    forms: dict[tuple[str, Any], list[tuple[Activation, CallReader]]] = {}
    for row in ACTIVATIONS:
        for kind, readers in (("call_function", row.functions), ("call_method", row.methods)):
            for target, reader in readers.items():
                forms.setdefault((kind, target), []).append((row.act, reader))
    return forms


# (fx op, target) of every one-call form -> the rows that may read it (F.gelu serves two rows).
_CALL_FORMS = _call_forms()


def read_call_form(op: str, target: Any, args: tuple, kwargs: dict) -> tuple[Activation, float, bool] | None:
    """(activation, alpha, in_place) of a one-call activation form (fx ``op`` "call_function" or
    "call_method", its target and arguments), or None when the call is not one (``clamp(x, 0, 5)``)."""
    for act, reader in _CALL_FORMS.get((op, target), []):
        found = reader(tuple(args), dict(kwargs))
        if found is not None:
            return act, found[0], found[1]
    return None
