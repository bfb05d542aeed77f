"""Small modules that exercise each written form of each chain (importable, so they also pickle)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fuser.models.common import randomize_batchnorm


def seeded(module: nn.Module, seed: int = 0) -> nn.Module:
    """Deterministic random weights, randomized BN statistics, eval mode."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (1.0 / max(1, p[0].numel()) ** 0.5))
    return randomize_batchnorm(module, g).eval()


class ConvBnAct(nn.Module):
    """conv -> BN -> act, the activation given as a callable so that every written form can be tried."""

    def __init__(
        self,
        act: Callable[[torch.Tensor], torch.Tensor] | nn.Module,
        c_in: int = 5,
        c_out: int = 7,
        **conv: object,
    ) -> None:
        super().__init__()
        conv = {"kernel_size": 3, "padding": 1, "bias": False, **conv}
        self.conv = nn.Conv2d(c_in, c_out, **conv)
        self.bn = nn.BatchNorm2d(c_out)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x)))


class ConvBnActAdd(nn.Module):
    """YOLO/MBConv order: x + act(bn(conv(x)))."""

    def __init__(self, c: int = 5, residual_first: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)
        self.act = nn.SiLU()
        self.residual_first = residual_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.bn(self.conv(x)))
        return x + y if self.residual_first else y + x


class ConvBnAddAct(nn.Module):
    """ResNet order: relu(bn(conv(x)) + x), with torch.add."""

    def __init__(self, c: int = 5) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(torch.add(self.bn(self.conv(x)), x), inplace=True)


class FunctionalBatchNorm(nn.Module):
    """BN written as F.batch_norm(training=False) over the module's own buffers."""

    def __init__(self, c_in: int = 5, c_out: int = 7) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.register_buffer("mean", torch.randn(c_out) * 0.3)
        self.register_buffer("var", torch.rand(c_out) + 0.5)
        self.gamma = nn.Parameter(torch.rand(c_out) + 0.5)
        self.beta = nn.Parameter(torch.randn(c_out) * 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.batch_norm(self.conv(x), self.mean, self.var, self.gamma, self.beta, training=False, eps=1e-3)
        return F.silu(y)


class BatchNormAct(nn.BatchNorm2d):
    """A BN subclass that calls F.batch_norm and then its activation inside its own forward (timm style)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training, 0.1, self.eps)
        return F.hardswish(x)


class ConvBnActSubclass(nn.Module):
    def __init__(self, c_in: int = 5, c_out: int = 7) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.bn = BatchNormAct(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x))


class ConvBiasAct(nn.Module):
    """An already-folded block: conv with bias -> activation (-> residual)."""

    def __init__(self, c: int = 5, residual: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1, bias=True)
        self.residual = residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu6(self.conv(x))
        return y + x if self.residual else y


class SharedConv(nn.Module):
    """One conv module used by two paths, one through a BN and one without."""

    def __init__(self, c: int = 5) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1, bias=True)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = F.silu(self.bn(self.conv(x)))
        b = torch.relu(self.conv(x * 0.5))
        return a, b


class LinearAct(nn.Module):
    """linear -> act -> (+ residual) -> (* scale), the scale written as a multiplication or a division."""

    def __init__(
        self,
        k: int = 19,
        n: int = 21,
        act: Callable | None = None,
        residual: bool = False,
        scale: float | None = None,
        divide: bool = False,
    ) -> None:
        super().__init__()
        self.fc = nn.Linear(k, n)
        self.act = act
        self.residual = residual
        self.scale = scale
        self.divide = divide

    def forward(self, x: torch.Tensor, r: torch.Tensor | None = None) -> torch.Tensor:
        y = self.fc(x)
        if self.act is not None:
            y = self.act(y)
        if self.residual:
            y = y + r
        if self.scale is not None:
            y = y / self.scale if self.divide else y * self.scale
        return y


class MatmulAddAct(nn.Module):
    """x @ W + b -> GELU: the matmul + add form of exported graphs."""

    def __init__(self, k: int = 19, n: int = 21) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(k, n) / k**0.5)
        self.b = nn.Parameter(torch.randn(n) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(torch.matmul(x, self.w) + self.b)


class AddmmTanh(nn.Module):
    def __init__(self, k: int = 19, n: int = 21) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(k, n) / k**0.5)
        self.b = nn.Parameter(torch.randn(n) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.addmm(self.b, x, self.w))


class Untraceable(nn.Module):
    """A model whose forward branches on its input's values (torch.fx cannot trace it, with or without the
    example's sizes) and keeps the shape it saw, around traceable blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = ConvBnAct(nn.SiLU(), 3, 8, stride=2)
        self.blocks = nn.ModuleList([ConvBnActAdd(8), ConvBnAddAct(8)])
        self.seen_shape = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.isnan().any():  # data-dependent Python control flow
            raise ValueError("a NaN in the input")
        self.seen_shape = x.shape
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return x
