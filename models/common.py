"""Helpers shared by the reference models."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def randomize_batchnorm(module: nn.Module, generator: torch.Generator | None = None) -> nn.Module:
    """Give every BatchNorm realistic, random statistics and affine parameters; returns ``module``.

    A fresh BatchNorm has mean 0, var 1, weight 1, bias 0, which makes folding it into a conv an
    identity and hides folding bugs. The variance stays in [0.25, 1.75] and gamma in [0.5, 1.5], so
    activations keep a trained network's scale through deep stacks.
    """
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            c = m.num_features
            if m.running_mean is not None:
                m.running_mean.copy_(torch.randn(c, generator=generator) * 0.2)
                m.running_var.copy_(torch.rand(c, generator=generator) * 1.5 + 0.25)
            if m.affine:
                m.weight.copy_(torch.rand(c, generator=generator) + 0.5)
                m.bias.copy_(torch.randn(c, generator=generator) * 0.2)
    return module
