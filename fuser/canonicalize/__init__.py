"""Canonicalization: one form for each thing before matching (see fuser.graph_ops for the forms).

First, computations on parameters and buffers alone are folded into constants (constant_folding, a pass).
The rules come in families, one module each, and one driver (fuser.canonicalize.driver) applies them:

    passthrough       ops that compute nothing (nn.Identity, inactive dropout, GPT-2's flatten pair) vanish
    layers            nn.Conv2d / eval nn.BatchNorm2d / nn.Linear -> F.conv2d / F.batch_norm / F.linear
    identity_branches BN(x) + BN(conv(x)) -> one conv -> BN branch (RepVGG, MobileOne identity branches)
    gemm_forms        matmul by a constant, addmm, linear + constant bias -> F.linear
    activation_calls  one-call activation forms (modules, functions, methods, in place) -> canonical call
    activation_forms  written-out activations (x * sigmoid(x), the erf GELU, ...) as tree patterns

Every rewrite keeps the function the graph computes; forms that cannot be rewritten safely (an in-place
activation whose input may alias another tensor, a BatchNorm in training mode) are left as they are, and the
matcher's guards report them.
"""

from __future__ import annotations

import torch.fx as fx

from fuser.canonicalize import activation_calls, activation_forms, gemm_forms, identity_branches, layers, passthrough
from fuser.canonicalize.constant_folding import fold_constants
from fuser.canonicalize.driver import Context, Rule, run_rules

# Ordered: layer modules first (so activation rules see fresh producers), then GEMM forms, single-call
# activations, and the written-out forms built on the canonical single calls.
RULES: list[Rule] = [
    *passthrough.RULES,  # ops that pass their value through vanish first
    *layers.RULES,
    *identity_branches.RULES,
    *gemm_forms.RULES,
    *activation_calls.RULES,
    *activation_forms.RULES,
]


def canonicalize(gm: fx.GraphModule, rules: list[Rule] | None = None) -> dict[str, int]:
    """Rewrite ``gm`` in place to canonical forms; returns {rule name: times fired}, in the order they first
    fired (``constant_folding`` first: the computations folded), empty when nothing changed. The graph is
    linted and recompiled when anything did."""
    folded = fold_constants(gm)
    fired = run_rules(gm, RULES if rules is None else rules)
    return {"constant_folding": folded, **fired} if folded else fired


__all__ = ["RULES", "Context", "Rule", "canonicalize", "fold_constants"]
