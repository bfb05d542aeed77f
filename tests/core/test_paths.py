"""One behaviour on every path: a fused module gives the same answer whichever way it is run.

The paths: the eager shortcut (the op's code called directly), the custom op called as such, the custom op
reached through autograd (inputs that need gradients), torch.compile, torch.jit.trace, torch.export, and the
decomposed reference exporters record. Each is checked against a float64 computation written out here, for
each op with an activation, a residual and a scale (a scale the custom op dropped once went unnoticed,
as no test used one). Backward through any of them says that fuser is for inference."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from accuracy import assert_close
from torch import nn
from toy_models import ConvBnAct, LinearAct, seeded

import fuser
from fuser.kernels.epilogue import Activation, Epilogue, Residual
from fuser.lower import ops
from fuser.lower.fused_modules import FusedConv2d, FusedLinear

SCALE = 0.37


def conv_case(backend: str) -> tuple[nn.Module, tuple[torch.Tensor, ...], torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(7, 5, 3, 3, generator=g) * 0.3, torch.randn(7, generator=g)
    x, r = torch.randn(2, 5, 11, 9, generator=g), torch.randn(2, 7, 6, 7, generator=g)
    epilogue = Epilogue(Activation.SILU, residual=Residual.AFTER_ACT, scale=SCALE)
    module = FusedConv2d(
        weight, bias, stride=(2, 1), padding=(1, 1, 2, 0), dilation=(1, 2), groups=1, epilogue=epilogue,
        precision="ieee", backend=backend,
    )  # fmt: skip
    y = F.conv2d(F.pad(x.double(), (2, 0, 1, 1)), weight.double(), bias.double(), (2, 1), 0, (1, 2))
    return module, (x, r), (F.silu(y) + r.double()) * SCALE


def gemm_case(backend: str) -> tuple[nn.Module, tuple[torch.Tensor, ...], torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    weight, bias = torch.randn(21, 19, generator=g) * 0.3, torch.randn(21, generator=g)
    a, r = torch.randn(3, 5, 19, generator=g), torch.randn(3, 5, 21, generator=g)
    epilogue = Epilogue(Activation.GELU, residual=Residual.BEFORE_ACT, scale=SCALE)
    module = FusedLinear(weight, bias, epilogue=epilogue, precision="ieee", backend=backend)
    y = a.double() @ weight.double().T + bias.double()
    return module, (a, r), F.gelu(y + r.double()) * SCALE


def via_custom_op(module: nn.Module, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    if isinstance(module, FusedConv2d):
        args = ops.conv2d_op_args(module.geometry, module.epilogue, module.kernel_precision, module.backend)
        return torch.ops.fuser.conv2d_act(x, module.weight, module.bias, r, module.packed, *args)
    args = ops.gemm_op_args(module.epilogue, module.kernel_precision, module.backend)
    return torch.ops.fuser.gemm_act(x, module.weight, module.bias, r, module.packed, *args)


def via_autograd(module: nn.Module, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    with torch.enable_grad():
        return module(x.clone().requires_grad_(), r).detach()


def via_compile(module: nn.Module, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    torch._dynamo.reset()
    return torch.compile(module, backend="eager", fullgraph=True)(x, r)


def via_jit_trace(module: nn.Module, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # deprecated, but what the ONNX exporter uses
        return torch.jit.trace(module, (x, r), check_trace=False)(x, r)


def via_export(module: nn.Module, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    return torch.export.export(module, (x, r)).module()(x, r)


def via_decomposed(module: nn.Module, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    with ops.decomposed():
        return module(x, r)


PATHS: dict[str, Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "eager shortcut": lambda module, x, r: module(x, r),
    "custom op": via_custom_op,
    "autograd": via_autograd,
    "torch.compile": via_compile,
    "torch.jit.trace": via_jit_trace,
    "torch.export": via_export,
    "decomposed": via_decomposed,
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("backend", ["torch", "interpret"])
@pytest.mark.parametrize("case", [conv_case, gemm_case], ids=["conv2d", "gemm"])
def test_every_path_applies_the_whole_epilogue(case, backend, path):
    module, (x, r), expected = case(backend)
    with torch.no_grad():
        out = PATHS[path](module, x, r)
    assert out.shape == expected.shape
    assert_close(out, expected, "ieee", f"{case.__name__} via {path} on {backend}")


def test_backward_says_fuser_is_for_inference():
    model = nn.Sequential(seeded(ConvBnAct(nn.SiLU(), 3, 5)), nn.Flatten(), seeded(LinearAct(k=75, act=torch.tanh)))
    x = torch.randn(2, 3, 5, 3)
    opt = fuser.optimize(model, (x,), backend="torch")
    assert len(opt.fusion_report.fused) == 2
    out = opt(x.clone().requires_grad_())
    with pytest.raises(RuntimeError, match=r"fuser::gemm_act.*for inference.*fuser\.optimize\(\) on it after"):
        out.sum().backward()


def test_backward_through_a_compiled_model_says_the_same():
    model = seeded(LinearAct(act=torch.tanh))
    x = torch.randn(3, 19)
    opt = fuser.optimize(model, (x,), backend="torch")
    torch._dynamo.reset()
    out = torch.compile(opt, backend="aot_eager")(x.clone().requires_grad_())  # compiles forward and backward
    assert_close(out.detach(), model(x).double(), "ieee")
    with pytest.raises(RuntimeError, match="an optimized model is for inference"):
        out.sum().backward()
