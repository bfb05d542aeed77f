"""Helpers shared by the reference models."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from fuser.activations import module_activation


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


# The last BN of every residual branch has gamma and beta multiplied by this (scale_batchnorm).
# Measured on a random ResNet-50 (8 images of 67x61): at 1.0 a 1e-3 relative input perturbation
# moves the logits by 4% and float32 is 1.8e-5 from float64 (chaotic: past the 1e-5 tolerance); at
# 0.25, 0.3% and 1.4e-6. YOLOv8s and EfficientNet-B0 change little (below 3e-6 either way).
RESIDUAL_SCALE = 0.25


@torch.no_grad()
def scale_batchnorm(bn: nn.Module, factor: float) -> nn.Module:
    """Multiply a BatchNorm's affine gamma and beta by ``factor``: its output shrinks by ``factor``.

    Used, before calibration, on the last BN of each residual branch: trained networks keep that
    branch small next to the identity path (torchvision's ``zero_init_residual`` starts its gamma at
    zero), and a random deep residual network with full-size branches is chaotic (see
    ``RESIDUAL_SCALE``). Returns ``bn``.
    """
    bn.weight.mul_(factor)
    bn.bias.mul_(factor)
    return bn


@torch.no_grad()
def calibrate_batchnorm(module: nn.Module, calibration_input: torch.Tensor) -> nn.Module:
    """Put every BatchNorm's running statistics on the scale of the data that reaches it.

    A trained BatchNorm's running statistics track the activations flowing into it; that is what keeps
    a trained network's activations O(1) through fifty layers. Random weights with hand-picked BN
    statistics do not: each layer scales the signal by a random factor and deep models blow up or
    vanish, and float32 then drifts from float64. So the statistics already in each BN (from
    ``randomize_batchnorm``) are read as standardized units: one eval-mode forward pass on
    ``calibration_input`` measures each BN input's per-channel mean ``m`` and standard deviation ``s``,
    and sets ``running_mean = m + running_mean * s`` and ``running_var = running_var * s**2``. Each BN
    then maps its input to about ``gamma * N(-running_mean, running_var) + beta`` in those units:
    statistics that are realistic, different per channel, and still deliberately off from the data.
    Near-dead channels have ``s`` floored at 1% of the layer's mean, so they are not amplified.
    A BN called twice is calibrated on its first call. Returns ``module``.

    The calibration input must resemble real inputs, in size and in number. Statistics measured at
    64x64 put a random EfficientNet-B0's head features 100x too large at 224x224 (its last stages
    are 2x2 at 64: padding dominates). Deep features see the whole image, so a channel's statistics
    rest on about one independent value per image: 2 images of 128x128 left YOLOv8s's neck BNs 4-30x
    off for a fresh input of the same size. Each builder's defaults were measured to stay within
    about 2x from its test sizes to its usual input size.
    """
    seen: set[nn.Module] = set()

    def rescale(bn: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        if bn in seen or bn.running_mean is None:
            return
        seen.add(bn)
        x = args[0]
        var, mean = torch.var_mean(x, dim=[d for d in range(x.dim()) if d != 1])
        mean, std = mean.double(), var.double().sqrt()
        std = std.clamp_min(0.01 * std.mean().item() + 1e-12)
        bn.running_mean.copy_(mean + bn.running_mean.double() * std)
        bn.running_var.copy_(bn.running_var.double() * std**2)

    batchnorms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    hooks = [bn.register_forward_pre_hook(rescale) for bn in batchnorms]
    module.eval()
    try:
        module(calibration_input)
    finally:
        for hook in hooks:
            hook.remove()
    return module


def is_activation_module(module: nn.Module | None) -> bool:
    """True when ``module`` may end a fusable chain: an activation of fuser.activations' table, with settings
    the table's reader accepts (nn.Hardtanh only as (0, 6))."""
    return module_activation(module) is not None


def fusable_chain_heads(module: nn.Module, prefix: str = "") -> list[str]:
    """Qualified names of the Conv2d / Linear modules that start a fusable chain in ``module``.

    The rule (what a conv/GEMM fusion library should fuse; each chain is named by its first module):

    - every Conv2d followed by a BatchNorm2d is one chain (conv_bn[_act][_residual]), whatever follows;
    - every other Conv2d WITH bias is one chain, whatever follows: with the activation after it
      (squeeze-excitation convs) or alone, its bias in the epilogue (YOLO's final 1x1 head convs, a ViT's
      patch embedding);
    - every Linear followed by an activation, or whose output is directly added to a residual, is one
      chain;
    - a bias-free Conv2d or a Linear followed by nothing fusable is not a chain: the DFL conv, a ViT's
      qkv projection, a classifier head. Matmuls between two activations (attention's ``q @ k^T`` and
      ``attn @ v``) have no weights and are not counted.

    Data flow is not visible from the module tree, so it is read in three ways: a block that knows its
    own forward declares its heads with a ``declared_chain_heads() -> list[str]`` method (names
    relative to the block, covering its children); an ``nn.Sequential`` runs its children in order, so
    adjacent (Conv2d, BatchNorm2d) and (Linear, activation) pairs and biased Conv2d are chains; any other
    module is the union of its children, a biased Conv2d child being a chain.
    """
    declared = getattr(module, "declared_chain_heads", None)
    if declared is not None:
        names = list(declared())
    elif isinstance(module, nn.Sequential):
        names = _sequential_chain_heads(module)
    else:
        names = [
            h
            for name, child in module.named_children()
            for h in ([name] if _biased_conv(child) else fusable_chain_heads(child, f"{name}."))
        ]
    return [prefix + name for name in names]


def _biased_conv(module: nn.Module | None) -> bool:
    return isinstance(module, nn.Conv2d) and module.bias is not None


def _sequential_chain_heads(seq: nn.Sequential) -> list[str]:
    items = list(seq.named_children())
    heads: list[str] = []
    for (name, child), (_, after) in zip(items, [*items[1:], ("", None)], strict=True):
        is_conv_bn = isinstance(child, nn.Conv2d) and isinstance(after, nn.modules.batchnorm._BatchNorm)
        is_linear_act = isinstance(child, nn.Linear) and is_activation_module(after)
        if is_conv_bn or _biased_conv(child) or is_linear_act:
            heads.append(name)
        else:
            heads.extend(fusable_chain_heads(child, f"{name}."))
    return heads


def build_seeded(make: Callable[[], nn.Module], seed: int, calibration_shape: Sequence[int] | None = None) -> nn.Module:
    """Build ``make()`` deterministically from ``seed``, calibrate its BatchNorms, return it in eval mode.

    ``make`` constructs the model and draws its random parameters (``randomize_batchnorm`` and the
    like). It runs, and so does everything else random here (the calibration input included), inside
    ``torch.random.fork_rng`` after ``torch.manual_seed(seed)``: the same seed gives the same weights,
    and the caller's global RNG state is left exactly as it was. ``calibration_shape`` is the shape of
    the random input that puts the BN statistics on the data's scale (``calibrate_batchnorm``); None
    for models without BatchNorm. The model gets ``expected_chain_heads`` (``fusable_chain_heads``) and
    ``expected_fusions``, the number of those chains.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = make()
        if calibration_shape is not None:
            calibrate_batchnorm(model, torch.randn(*calibration_shape))
    model.eval()
    heads = fusable_chain_heads(model)
    model.expected_chain_heads = tuple(heads)
    model.expected_fusions = len(heads)
    return model
