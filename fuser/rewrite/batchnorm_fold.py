"""BatchNorm folding: conv -> BN(eval) becomes one conv with new weight and bias.

    y = gamma * (conv(x, W) + b - mean) / sqrt(var + eps) + beta
      = conv(x, W * s) + (b - mean) * s + beta,         s = gamma / sqrt(var + eps)

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
    f64 = dict(dtype=torch.float64, device=conv_weight.device)
    mean = bn.running_mean.detach().to(**f64)
    var = bn.running_var.detach().to(**f64)
    gamma = bn.weight.detach().to(**f64) if bn.weight is not None else torch.ones(c_out, **f64)
    beta = bn.bias.detach().to(**f64) if bn.bias is not None else torch.zeros(c_out, **f64)
    bias = conv_bias.detach().to(**f64) if conv_bias is not None else torch.zeros(c_out, **f64)

    scale = gamma / torch.sqrt(var + bn.eps)
    weight = conv_weight.detach().to(**f64) * scale.reshape(-1, *([1] * (conv_weight.dim() - 1)))
    new_bias = (bias - mean) * scale + beta
    return weight.to(conv_weight.dtype), new_bias.to(conv_weight.dtype)
