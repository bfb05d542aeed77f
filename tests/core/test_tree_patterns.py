"""The tree patterns of fuser.match.tree_patterns: declared commutativity, one node per variable, number leaves
within their tolerance, alternatives; and the driver's pattern rules replace a match and keep shared nodes."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx

from fuser.canonicalize.driver import pattern_rule, run_rules
from fuser.match.tree_patterns import DIV, NUMBER_RTOL, OpFamily, Var, add, any_of, div, match, matches, mul, op

X, Y = Var("x"), Var("y")
SIGMOID = OpFamily("sigmoid", frozenset({torch.sigmoid}))


def _root(gm: fx.GraphModule) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.op == "output").args[0]


@pytest.mark.parametrize(
    "fn", [lambda x: x * torch.sigmoid(x), lambda x: torch.sigmoid(x) * x, lambda x: x.mul(torch.sigmoid(x))]
)
def test_commutative_op_matches_either_order(fn) -> None:
    found = match(mul(X, op(SIGMOID, X)), _root(fx.symbolic_trace(fn)))
    assert found is not None and found["x"].op == "placeholder"
    assert [n.target for n in found.nodes][1] is torch.sigmoid


def test_a_variable_is_one_node() -> None:
    class M(torch.nn.Module):
        def forward(self, x, y):
            return x * torch.sigmoid(y)

    assert match(mul(X, op(SIGMOID, X)), _root(fx.symbolic_trace(M()))) is None


def test_non_commutative_op_keeps_its_order() -> None:
    assert match(div(X, 6.0), _root(fx.symbolic_trace(lambda x: x / 6))) is not None
    assert match(div(X, 6.0), _root(fx.symbolic_trace(lambda x: 6 / x))) is None
    assert not DIV.commutative


@pytest.mark.parametrize(("value", "hit"), [(6.0, True), (6 * (1 + NUMBER_RTOL / 2), True), (6.001, False), (5, False)])
def test_number_leaf_tolerance(value: float, hit: bool) -> None:
    assert (match(div(X, 6.0), _root(fx.symbolic_trace(lambda x: x / value))) is not None) == hit


def test_alternatives_and_every_match() -> None:
    pattern = any_of(div(X, 2.0), mul(X, 0.5))
    assert match(pattern, _root(fx.symbolic_trace(lambda x: x * 0.5))) is not None

    # a commutative op yields both operand orders, for a rule whose own checks reject the first
    class M(torch.nn.Module):
        def forward(self, x, y):
            return x + y

    both = [(m["a"].name, m["b"].name) for m in matches(add(Var("a"), Var("b")), _root(fx.symbolic_trace(M())))]
    assert both == [("x", "y"), ("y", "x")]


def test_pattern_rule_rewrites_and_keeps_shared_nodes() -> None:
    def fn(x):
        s = torch.sigmoid(x)
        return x * s + s  # s has a second user: it must stay

    gm = fx.symbolic_trace(fn)
    rule = pattern_rule(
        "silu", "x * sigmoid(x) -> silu(x)", mul(X, op(SIGMOID, X)), lambda m: (torch.nn.functional.silu, (m["x"],), {})
    )
    fired = run_rules(gm, [rule])
    assert fired == {"silu": 1}
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.nn.functional.silu in targets and torch.sigmoid in targets and operator.mul not in targets
    x = torch.randn(13, 7)
    torch.testing.assert_close(gm(x), fn(x))
