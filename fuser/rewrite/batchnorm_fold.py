"""BatchNorm folding: conv -> BN(eval) becomes one conv with new weight and bias.

    y = gamma * (conv(x, W) + b - mean) / sqrt(var + eps) + beta
      = conv(x, W * s) + (b - mean) * s + beta,         s = gamma / sqrt(var + eps)

A BatchNorm *before* a layer without padding folds the other way (:func:`fold_batchnorm_before`, used by
fuser.rewrite.batchnorm_prologue): ``layer(bn(x)) = layer'(x)`` with ``W' = W * s`` along the layer's input
and ``b' = b + W t``.

The arithmetic runs in float64 and the results are cast to the conv weight's dtype at the end, so folding
adds no rounding beyond that one cast. The inputs are never modified: the results are new tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BatchNormParams:
    """The constants of an eval-mode BatchNorm; ``weight``/``bias`` are None when it has no affine part."""

    running_mean: torch.Tensor
    running_var: torch.Tensor
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    eps: float


def fold_batchnorm(
    conv_weight: torch.Tensor, conv_bias: torch.Tensor | None, bn: BatchNormParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(weight, bias)`` of the conv that computes ``bn(conv(x))``.

    ``conv_weight`` is ``[C_out, C_in / groups, KH, KW]`` (or ``[C_out, C_in]`` for a linear layer);
    the BN runs over C_out. The bias is always returned, in the weight's dtype.
    """
    c_out = conv_weight.shape[0]
    if bn.running_mean.numel() != c_out:
        raise ValueError(f"BatchNorm has {bn.running_mean.numel()} channels but the conv before it has {c_out} outputs")
    scale, shift = batchnorm_scale_shift(bn)
    f64 = dict(dtype=torch.float64, device=conv_weight.device)
    scale, shift = scale.to(**f64), shift.to(**f64)
    bias = conv_bias.detach().to(**f64) if conv_bias is not None else torch.zeros(c_out, **f64)
    weight = conv_weight.detach().to(**f64) * scale.reshape(-1, *([1] * (conv_weight.dim() - 1)))
    new_bias = bias * scale + shift
    return weight.to(conv_weight.dtype), new_bias.to(conv_weight.dtype)


def batchnorm_scale_shift(bn: BatchNormParams) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, t)`` in float64 with ``bn(x) = x * s + t`` per channel: ``s = gamma / sqrt(var + eps)``,
    ``t = beta - mean * s``."""
    f64 = dict(dtype=torch.float64, device=bn.running_mean.device)
    mean = bn.running_mean.detach().to(**f64)
    c = mean.numel()
    gamma = bn.weight.detach().to(**f64) if bn.weight is not None else torch.ones(c, **f64)
    beta = bn.bias.detach().to(**f64) if bn.bias is not None else torch.zeros(c, **f64)
    scale = gamma / torch.sqrt(bn.running_var.detach().to(**f64) + bn.eps)
    return scale, beta - mean * scale


def fold_batchnorm_before(
    weight: torch.Tensor, bias: torch.Tensor | None, bn: BatchNormParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(weight, bias)`` of the ungrouped linear layer or unpadded conv that computes ``layer(bn(x))``.

    ``weight`` is ``[C_out, C_in]`` or ``[C_out, C_in, KH, KW]`` and the BN runs over C_in: ``W' = W * s`` along
    C_in and ``b' = b + sum(W * t)`` over C_in and the taps (exact only without padding, whose zeros the BN
    would not have shifted). float64 arithmetic, cast to the weight's dtype; new tensors.
    """
    c_in = weight.shape[1]
    if bn.running_mean.numel() != c_in:
        raise ValueError(f"BatchNorm has {bn.running_mean.numel()} channels but the layer after it has {c_in} inputs")
    scale, shift = batchnorm_scale_shift(bn)
    w64 = weight.detach().to(torch.float64)
    along_c_in = (1, -1) + (1,) * (weight.dim() - 2)
    new_weight = w64 * scale.to(w64.device).reshape(along_c_in)
    new_bias = (w64 * shift.to(w64.device).reshape(along_c_in)).sum(dim=tuple(range(1, weight.dim())))
    if bias is not None:
        new_bias = new_bias + bias.detach().to(torch.float64)
    return new_weight.to(weight.dtype), new_bias.to(weight.dtype)
