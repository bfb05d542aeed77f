"""Transformer encoders: a ViT image classifier and a BERT-style encoder over token embeddings.

ViT (timm's ``vit_tiny_patch16_224`` layout, 5,717,416 parameters at the defaults): a patch embedding
(a strided conv with bias), a class token and learned position embeddings, pre-norm blocks of
LayerNorm -> attention (fused qkv Linear, explicit ``q @ k^T * scale``, softmax, ``@ v``, proj Linear)
-> + residual, LayerNorm -> MLP (Linear -> GELU -> Linear) -> + residual; final LayerNorm and a head
Linear on the class token.

BERT (Google's BERT-tiny sizes by default: 2 layers, hidden 128, 2 heads, MLP 512): takes token
embeddings [B, S, D] (every Linear is a batched 3-D GEMM), adds position embeddings, LayerNorm, then
post-norm layers: separate query/key/value Linears, scores ``q @ k^T / sqrt(d)``, output Linear
+ residual -> LayerNorm, Linear -> GELU (tanh approximation) -> Linear + residual -> LayerNorm.
Returns the last hidden states [B, S, D].

Linear layers keep PyTorch's default init (random, nonzero biases, which a fused bias must get
right); LayerNorm affine parameters are randomized like the BatchNorms of the conv models.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .common import build_seeded


@torch.no_grad()
def randomize_layernorm(module: nn.Module) -> nn.Module:
    """Random LayerNorm gains in [0.5, 1.5] and biases ~ N(0, 0.2^2): a fresh LayerNorm (1, 0) hides
    bugs that mix up normalized and affine values. Returns ``module``."""
    for m in module.modules():
        if isinstance(m, nn.LayerNorm) and m.elementwise_affine:
            m.weight.copy_(torch.rand_like(m.weight) + 0.5)
            m.bias.copy_(torch.randn_like(m.bias) * 0.2)
    return module


class Attention(nn.Module):
    """Multi-head self-attention with one fused qkv projection, written out as matmuls."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not divisible by heads {heads}")
        self.heads = heads
        self.head_dim = dim // heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape[0], x.shape[1], x.shape[2]
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = (q @ k.transpose(-2, -1)) * self.scale
        attn = attn.softmax(dim=-1)
        x = (attn @ v).transpose(1, 2).reshape(b, n, c)
        return self.proj(x)


class Mlp(nn.Module):
    """Linear -> GELU -> Linear."""

    def __init__(self, dim: int, hidden: int, approximate: str = "none") -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU(approximate=approximate)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))

    def declared_chain_heads(self) -> list[str]:
        return ["fc1"]  # fc2's chain depends on what the caller does with the output


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))

    def declared_chain_heads(self) -> list[str]:
        # proj and fc2 feed the residual adds; fc1 feeds the GELU.
        return ["attn.proj", "mlp.fc1", "mlp.fc2"]


@torch.fx.wrap
def _check_image_size(x: torch.Tensor, expected: tuple[int, int]) -> None:
    # Wrapped for torch.fx: traced as one call; checked when the traced graph runs.
    if x.dim() != 4 or tuple(x.shape[-2:]) != expected:
        raise ValueError(
            f"this ViT was built for [B, C, {expected[0]}, {expected[1]}] images (its position embedding "
            f"has one entry per patch); got shape {tuple(x.shape)}. Build it with img_size=(H, W)."
        )


class VisionTransformer(nn.Module):
    """ViT classifier for images of exactly ``img_size`` (patches that do not fit are dropped, as the
    strided patch conv does)."""

    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        patch_size: int = 16,
        dim: int = 192,
        depth: int = 12,
        heads: int = 3,
        mlp_ratio: float = 4.0,
        num_classes: int = 1000,
    ) -> None:
        super().__init__()
        self.img_size = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
        grid = (self.img_size[0] // patch_size, self.img_size[1] // patch_size)
        if min(grid) < 1:
            raise ValueError(f"img_size {self.img_size} is smaller than one {patch_size}x{patch_size} patch")
        self.patch_embed = nn.Conv2d(3, dim, patch_size, patch_size)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, grid[0] * grid[1] + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*(Block(dim, heads, mlp_ratio) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_image_size(x, self.img_size)
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


class BertSelfAttention(nn.Module):
    """Multi-head self-attention with separate query, key and value Linears."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not divisible by heads {heads}")
        self.heads = heads
        self.head_dim = dim // heads
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], self.heads, self.head_dim).permute(0, 2, 1, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self._split_heads(self.query(x)), self._split_heads(self.key(x)), self._split_heads(self.value(x))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        context = scores.softmax(dim=-1) @ v
        return context.permute(0, 2, 1, 3).reshape(x.shape)


class BertLayer(nn.Module):
    """Post-norm layer: norm(x + dense(attn(x))), then norm(x + output(gelu_tanh(intermediate(x))))."""

    def __init__(self, dim: int, heads: int, intermediate: int) -> None:
        super().__init__()
        self.attention = BertSelfAttention(dim, heads)
        self.attention_output = nn.Linear(dim, dim)
        self.attention_norm = nn.LayerNorm(dim, eps=1e-12)
        self.intermediate = nn.Sequential(nn.Linear(dim, intermediate), nn.GELU(approximate="tanh"))
        self.output = nn.Linear(intermediate, dim)
        self.output_norm = nn.LayerNorm(dim, eps=1e-12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attention_norm(self.attention_output(self.attention(x)) + x)
        return self.output_norm(self.output(self.intermediate(x)) + x)

    def declared_chain_heads(self) -> list[str]:
        # attention_output and output feed the residual adds; intermediate.0 feeds the GELU.
        return ["attention_output", "intermediate.0", "output"]


@torch.fx.wrap
def _check_embeddings(x: torch.Tensor, dim: int, max_positions: int) -> None:
    if x.dim() != 3 or x.shape[-1] != dim or x.shape[1] > max_positions:
        raise ValueError(
            f"BERT encoder input must be token embeddings [B, S, {dim}] with S <= {max_positions}; "
            f"got shape {tuple(x.shape)}"
        )


class BertEncoder(nn.Module):
    """BERT encoder over token embeddings [B, S, dim] -> hidden states [B, S, dim]."""

    def __init__(
        self, dim: int = 128, depth: int = 2, heads: int = 2, intermediate: int = 512, max_positions: int = 512
    ) -> None:
        super().__init__()
        self.dim = dim
        self.max_positions = max_positions
        self.position_embeddings = nn.Parameter(torch.randn(max_positions, dim) * 0.02)
        self.embedding_norm = nn.LayerNorm(dim, eps=1e-12)
        self.layers = nn.Sequential(*(BertLayer(dim, heads, intermediate) for _ in range(depth)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_embeddings(x, self.dim, self.max_positions)
        x = self.embedding_norm(x + self.position_embeddings[: x.shape[1]])
        return self.layers(x)


def vit(
    img_size: int | tuple[int, int] = 224,
    patch_size: int = 16,
    dim: int = 192,
    depth: int = 12,
    heads: int = 3,
    mlp_ratio: float = 4.0,
    num_classes: int = 1000,
    *,
    seed: int = 0,
) -> VisionTransformer:
    """A ViT (ViT-Tiny/16 by default) with random weights deterministic by ``seed``, in eval mode.
    Input [B, 3, *img_size]; output [B, num_classes] logits."""
    return build_seeded(
        lambda: randomize_layernorm(VisionTransformer(img_size, patch_size, dim, depth, heads, mlp_ratio, num_classes)),
        seed,
    )


def bert(
    dim: int = 128, depth: int = 2, heads: int = 2, intermediate: int = 512, max_positions: int = 512, *, seed: int = 0
) -> BertEncoder:
    """A BERT-style encoder (BERT-tiny sizes by default) with random weights deterministic by ``seed``,
    in eval mode. Input token embeddings [B, S, dim], S <= max_positions; output [B, S, dim]."""
    return build_seeded(lambda: randomize_layernorm(BertEncoder(dim, depth, heads, intermediate, max_positions)), seed)
