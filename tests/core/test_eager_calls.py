"""A fused module called eagerly runs its op directly (no custom-op dispatch), with the decisions that depend
only on the input signature kept per module. These tests pin down that the shortcut computes exactly what the
custom op computes, that it is rebuilt whenever what it captured changes, and that it steps aside where the
custom op must run (autograd, tracing)."""

from __future__ import annotations

import pytest
import torch
from accuracy import assert_close, reference64
from torch import nn
from toy_models import ConvBnActAdd, LinearAct, seeded

import fuser
from fuser.lower import calls, ops
from fuser.lower.fused_modules import FusedConv2d, FusedLinear


@pytest.fixture
def built_calls(monkeypatch):
    """Counts how often each op's call is built (calls.conv2d_call / calls.gemm_call)."""
    counts = {"conv2d": 0, "gemm": 0}
    real_conv, real_gemm = calls.conv2d_call, calls.gemm_call

    def conv(*args, **kwargs):
        counts["conv2d"] += 1
        return real_conv(*args, **kwargs)

    def gemm(*args, **kwargs):
        counts["gemm"] += 1
        return real_gemm(*args, **kwargs)

    monkeypatch.setattr(calls, "conv2d_call", conv)
    monkeypatch.setattr(calls, "gemm_call", gemm)
    return counts


def _fused(module: nn.Module, kind: type) -> nn.Module:
    return next(m for m in module.modules() if isinstance(m, kind))


@pytest.mark.parametrize("backend", ["torch", "interpret"])
def test_direct_call_equals_the_custom_op(backend):
    model = seeded(ConvBnActAdd(5))
    x = torch.randn(2, 5, 9, 7)
    opt = fuser.optimize(model, (x,), backend=backend)
    conv = _fused(opt, FusedConv2d)
    residual = torch.randn(2, 5, 9, 7)
    with torch.no_grad():
        direct = conv(x, residual)
        args = ops.conv2d_op_args(conv.geometry, conv.epilogue, conv.kernel_precision, conv.backend)
        via_op = torch.ops.fuser.conv2d_act(x, conv.weight, conv.bias, residual, conv.packed, *args)
    assert torch.equal(direct, via_op)
    assert direct.stride() == via_op.stride()


def test_calls_are_built_once_per_input_signature(built_calls):
    model = seeded(LinearAct(act=nn.GELU(), residual=True, scale=0.7))
    x, r = torch.randn(2, 7, 19), torch.randn(2, 7, 21)
    opt = fuser.optimize(model, (x, r), backend="interpret")
    built_calls["gemm"] = 0
    with torch.no_grad():
        first = opt(x, r)
        again = opt(x, r)
        assert built_calls["gemm"] == 1
        other = opt(x[:, :5], r[:, :5])  # a new shape: a new call
        assert built_calls["gemm"] == 2
    assert torch.equal(first, again)
    assert_close(other, reference64(model, x[:, :5], r[:, :5]), "tf32")


def test_call_follows_weights_loaded_into_the_optimized_module():
    model_a, model_b = seeded(ConvBnActAdd(5), seed=1), seeded(ConvBnActAdd(5), seed=2)
    x = torch.randn(1, 5, 11, 9)
    opt_a = fuser.optimize(model_a, (x,), backend="interpret")
    opt_b = fuser.optimize(model_b, (x,), backend="interpret")
    with torch.no_grad():
        before = opt_a(x)
        opt_a.load_state_dict(opt_b.state_dict())  # copies in place: same storage, new contents
        after = opt_a(x)
    assert_close(before, reference64(model_a, x), "tf32")
    assert_close(after, reference64(model_b, x), "tf32")


def test_call_follows_a_dtype_change_of_the_module():
    model = seeded(ConvBnActAdd(5))
    x = torch.randn(2, 5, 9, 7)
    opt = fuser.optimize(model, (x,), backend="interpret")
    with torch.no_grad():
        opt(x)
        out = opt.double()(x.double())
    assert out.dtype == torch.float64
    assert_close(out, reference64(model, x), "tf32")


def test_inputs_that_need_gradients_go_through_the_custom_op(built_calls):
    model = seeded(LinearAct(act=torch.tanh))
    x = torch.randn(3, 19)
    opt = fuser.optimize(model, (x,), backend="torch")
    linear = _fused(opt, FusedLinear)
    built_calls["gemm"] = 0
    x_grad = x.clone().requires_grad_()
    for _ in range(2):
        linear(x_grad)
    assert built_calls["gemm"] == 2  # built on every call by the custom op, never cached by the module
    assert not linear.__dict__["_calls"]


def test_symbolic_trace_of_the_optimized_module_records_the_custom_op():
    model = seeded(LinearAct(act=torch.tanh))
    x = torch.randn(3, 19)
    opt = fuser.optimize(model, (x,), backend="torch")
    linear = _fused(opt, FusedLinear)
    traced = torch.fx.symbolic_trace(linear)
    targets = [n.target for n in traced.graph.nodes if n.op == "call_function"]
    assert torch.ops.fuser.gemm_act.default in targets or torch.ops.fuser.gemm_act in targets
    with torch.no_grad():
        assert_close(traced(x), reference64(model, x), "ieee")
