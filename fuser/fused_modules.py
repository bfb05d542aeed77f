"""The modules a rewritten chain becomes: they own the folded parameters and call one fused op.

``FusedConv2d`` replaces conv [-> BN] [-> act] [-> +residual]; ``FusedLinear`` replaces linear / matmul
[-> +bias] [-> act] [-> +residual] [-> *scale]. Their ``weight`` and ``bias`` buffers are new tensors (the
user's parameters are never written). The weight packed for the kernels is derived on first use per device
and dtype and is not saved: ``torch.save`` stores the plain folded weight.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fuser import kernel_dispatch, ops
from fuser.kernels.epilogue import Epilogue
from fuser.kernels.precision import Precision

_MAX_CALLS = 16  # input signatures whose calls a fused module keeps


class _FusedBase(nn.Module):
    """Shared state: folded weight and bias, the epilogue, the precision and the backend."""

    weight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        epilogue: Epilogue,
        precision: Precision | str,
        backend: str,
        source: str,
    ) -> None:
        super().__init__()
        # Never written in place, so the folded (new) tensors are kept as they are, not copied again.
        self.register_buffer("weight", weight.detach())
        self.register_buffer("bias", None if bias is None else bias.detach())
        self.epilogue = epilogue
        self.precision = Precision.parse(precision)
        self.backend = ops.check_backend(backend)
        self.source = source
        self._packed: dict[tuple[Any, ...], torch.Tensor | None] = {}
        self._calls: dict[tuple[Any, ...], ops.Call] = {}

    def _pack(self) -> torch.Tensor | None:
        raise NotImplementedError

    @property
    def kernel_precision(self) -> Precision:
        """The policy the kernels run: a float16/bfloat16 model's operands are 16-bit already, so a
        float32 policy (tf32, tf32x3, ieee) would only widen them; they stay in the model's dtype."""
        native = {torch.float16: Precision.FP16, torch.bfloat16: Precision.BF16}.get(self.weight.dtype)
        if native is not None and self.precision.operand_dtype is None:
            return native
        return self.precision

    def packed_weight(self, device: torch.device) -> torch.Tensor | None:
        """The weight packed for the kernels on ``device``, or None when the reference path runs there."""
        if ops.resolve_backend(self.backend, device) == "torch":
            return None
        key = (self.weight.device, self.weight.dtype, self.weight.data_ptr(), self.weight._version)
        if key not in self._packed:
            self._packed.clear()
            self._packed[key] = self._pack()
        return self._packed[key]

    def _make_call(self, x: torch.Tensor, residual: torch.Tensor | None) -> ops.Call:
        raise NotImplementedError

    def _call(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor | None:
        """The op run directly, without the custom op's dispatch, or None where the custom op must run.

        The custom op is what torch.compile, torch.export and tracers see; a plain eager call gets the
        same result from the same code (``ops.*_call``) with the per-signature decisions cached here, as
        on a small layer the dispatch costs more host time than the kernel takes on the GPU."""
        if type(x) is not torch.Tensor or torch.compiler.is_compiling() or torch.jit.is_tracing():
            return None
        if torch.is_grad_enabled() and x.requires_grad:
            return None  # the custom op has no autograd formula and says so; a direct call would drop it silently
        if residual is not None and type(residual) is not torch.Tensor:
            return None
        buffers = self._buffers  # not self.weight: nn.Module.__getattr__ costs microseconds per access
        weight, bias = buffers["weight"], buffers["bias"]
        key = (
            x.shape,
            x.stride(),
            x.dtype,
            x.device,
            x.data_ptr() % 16,
            None if residual is None else (residual.shape, residual.stride(), residual.dtype, residual.data_ptr() % 16),
            weight.data_ptr(),
            weight._version,
            None if bias is None else bias.data_ptr(),
        )
        calls = self.__dict__["_calls"]
        call = calls.get(key)
        if call is None:
            call = self._make_call(x, residual)
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                return call(x, residual)  # a choice made during CUDA-graph capture is provisional
            if len(calls) >= _MAX_CALLS:
                calls.clear()
            calls[key] = call
        return call(x, residual)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_packed"] = {}  # derived data: rebuilt on first use after loading
        state["_calls"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.setdefault("_calls", {})
        super().__setstate__(state)


class FusedConv2d(_FusedBase):
    """conv2d with BN folded in and the activation / residual add in the epilogue."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        stride: tuple[int, int],
        padding: tuple[int, int, int, int],
        dilation: tuple[int, int],
        groups: int,
        epilogue: Epilogue,
        precision: Precision | str = Precision.TF32,
        backend: str = "auto",
        source: str = "",
    ) -> None:
        super().__init__(weight, bias, epilogue, precision, backend, source)
        if weight.dim() != 4:
            raise ValueError(f"FusedConv2d needs a 4-D weight, got shape {tuple(weight.shape)}")
        self.stride = tuple(stride)
        self.padding = tuple(padding)
        self.dilation = tuple(dilation)
        self.groups = int(groups)

    def _pack(self) -> torch.Tensor | None:
        return kernel_dispatch.pack_conv(self.weight, self.groups, self.kernel_precision)

    def _make_call(self, x: torch.Tensor, residual: torch.Tensor | None) -> ops.Call:
        return ops.conv2d_call(
            x,
            self.weight,
            self.bias,
            residual,
            self.packed_weight(x.device),
            self.stride,
            self.padding,
            self.dilation,
            self.groups,
            self.epilogue,
            self.kernel_precision,
            self.backend,
        )

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        e = self.epilogue
        if ops.is_decomposed():
            return ops.conv2d_reference(
                x, self.weight, self.bias, residual, self.stride, self.padding, self.dilation, self.groups, e
            )
        out = self._call(x, residual)
        if out is not None:
            return out
        return torch.ops.fuser.conv2d_act(
            x,
            self.weight,
            self.bias,
            residual,
            self.packed_weight(x.device),
            self.stride,
            self.padding,
            self.dilation,
            self.groups,
            int(e.act),
            e.alpha,
            int(e.residual),
            self.kernel_precision.value,
            self.backend,
        )

    def extra_repr(self) -> str:
        c_out, c_in, kh, kw = self.weight.shape
        return (
            f"{c_in * self.groups}, {c_out}, kernel_size=({kh}, {kw}), stride={self.stride}, "
            f"padding={self.padding}, dilation={self.dilation}, groups={self.groups}, "
            f"epilogue='{self.epilogue.describe()}', precision={self.precision.value}, backend={self.backend}"
        )


class FusedLinear(_FusedBase):
    """x @ W^T + bias with the activation, residual add and scale in the epilogue."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        epilogue: Epilogue,
        precision: Precision | str = Precision.TF32,
        backend: str = "auto",
        source: str = "",
    ) -> None:
        super().__init__(weight, bias, epilogue, precision, backend, source)
        if weight.dim() != 2:
            raise ValueError(f"FusedLinear needs a 2-D weight, got shape {tuple(weight.shape)}")

    def _pack(self) -> torch.Tensor | None:
        return kernel_dispatch.pack_gemm(self.weight, self.kernel_precision)

    def _make_call(self, x: torch.Tensor, residual: torch.Tensor | None) -> ops.Call:
        return ops.gemm_call(
            x,
            self.weight,
            self.bias,
            residual,
            self.packed_weight(x.device),
            self.epilogue,
            self.kernel_precision,
            self.backend,
        )

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        e = self.epilogue
        if ops.is_decomposed():
            return ops.gemm_reference(x, self.weight, self.bias, residual, e)
        out = self._call(x, residual)
        if out is not None:
            return out
        return torch.ops.fuser.gemm_act(
            x,
            self.weight,
            self.bias,
            residual,
            self.packed_weight(x.device),
            int(e.act),
            e.alpha,
            int(e.residual),
            e.scale,
            self.kernel_precision.value,
            self.backend,
        )

    def extra_repr(self) -> str:
        n, k = self.weight.shape
        return (
            f"in_features={k}, out_features={n}, epilogue='{self.epilogue.describe()}', "
            f"precision={self.precision.value}, backend={self.backend}"
        )
