"""A small Vision Transformer (Dosovitskiy et al. 2021) for 32x32 images.

Patch embedding by a strided convolution (patch 4 -> 8x8 = 64 tokens), a learned class token and
position embedding, pre-norm transformer blocks (LayerNorm, multi-head self-attention, GELU MLP), a
final LayerNorm and a linear head on the class token. Defaults (dim 192, depth 6, 3 heads) keep it
small: 2,693,578 parameters with 10 classes.

Initialisation follows ViT/DeiT: Linear layers and the patch projection (a linear map of flattened
patches) `trunc_normal_(std=0.02)` with zero bias, class token and position embedding
`trunc_normal_(std=0.02)`, LayerNorm weight 1 and bias 0.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freqact import _validate
from freqact.models import check_dropout, init_transformer, register


class Attention(nn.Module):
    """Multi-head self-attention: one Linear for q, k, v, scaled dot-product attention, projection.

    Maps tokens (N, T, dim) to (N, T, dim).
    """

    def __init__(self, dim: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        # (N, T, 3 * D) -> (3, N, heads, T, D / heads)
        q, k, v = self.qkv(x).view(n, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(out.transpose(1, 2).reshape(n, t, d))  # (N, heads, T, D/h) -> (N, T, D)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + Attention(LayerNorm(x)), then x + MLP(LayerNorm(x)).

    The MLP is Linear(dim, mlp_ratio * dim) -> GELU -> Linear(mlp_ratio * dim, dim), with Dropout
    after each Linear when dropout > 0. Maps tokens (N, T, dim) to (N, T, dim).
    """

    # How analyses read the output (freqact.analysis.common.to_channels_first): tokens, no spatial map.
    map_layout = "tokens"

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        hidden = mlp_ratio * dim
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, dropout)
        self.norm2 = nn.LayerNorm(dim)
        mlp: list[nn.Module] = [nn.Linear(dim, hidden), nn.GELU()]
        # No Dropout modules at p = 0, so the engine sees no masks to cache.
        if dropout > 0:
            mlp.append(nn.Dropout(dropout))
        mlp.append(nn.Linear(hidden, dim))
        if dropout > 0:
            mlp.append(nn.Dropout(dropout))
        self.mlp = nn.Sequential(*mlp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """Vision Transformer classifying by its class token.

    Args:
        num_classes: classifier outputs.
        image_size: side of the square input images; a multiple of `patch_size`.
        patch_size: side of the square patches.
        dim: token width; a multiple of `heads`.
        depth: number of transformer blocks.
        heads: attention heads.
        mlp_ratio: MLP hidden width in multiples of `dim`.
        dropout: dropout probability in attention and MLPs (0 adds no Dropout modules).
        in_channels: channels of the input images.

    Input (N, in_channels, image_size, image_size) -> logits (N, num_classes).
    """

    def __init__(self, num_classes: int = 10, *, image_size: int = 32, patch_size: int = 4,
                 dim: int = 192, depth: int = 6, heads: int = 3, mlp_ratio: int = 4,
                 dropout: float = 0.0, in_channels: int = 3) -> None:
        super().__init__()
        for name, value in (("num_classes", num_classes), ("image_size", image_size),
                            ("patch_size", patch_size), ("dim", dim), ("depth", depth),
                            ("heads", heads), ("mlp_ratio", mlp_ratio),
                            ("in_channels", in_channels)):
            _validate.positive_int(name, value)
        if image_size % patch_size:
            raise ValueError(f"image_size: expected a multiple of patch_size={patch_size}, "
                             f"got {image_size}")
        if dim % heads:
            raise ValueError(f"dim: expected a multiple of heads={heads}, got {dim}")
        dropout = check_dropout(dropout)
        self.input_shape = (in_channels, image_size, image_size)

        num_patches = (image_size // patch_size) ** 2
        self.patch_embed = nn.Conv2d(in_channels, dim, patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, 1 + num_patches, dim))
        self.blocks = nn.Sequential(
            *(TransformerBlock(dim, heads, mlp_ratio, dropout) for _ in range(depth))
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        init_transformer(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or tuple(x.shape[1:]) != self.input_shape:
            raise ValueError(f"x: expected shape (N, {', '.join(map(str, self.input_shape))}), "
                             f"got {tuple(x.shape)}")
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # (N, D, h, w) -> (N, h * w, D)
        cls = self.cls_token.expand(x.shape[0], -1, -1)  # (N, 1, D)
        x = torch.cat([cls, x], dim=1) + self.pos_embed  # (N, 1 + h * w, D)
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])  # class token -> (N, num_classes)


@register("vit")
def vit(num_classes: int = 10, *, image_size: int = 32, patch_size: int = 4, dim: int = 192,
        depth: int = 6, heads: int = 3, mlp_ratio: int = 4, dropout: float = 0.0,
        in_channels: int = 3) -> ViT:
    """Small ViT for 32x32 images: patch 4, dim 192, depth 6, 3 heads."""
    return ViT(num_classes, image_size=image_size, patch_size=patch_size, dim=dim, depth=depth,
               heads=heads, mlp_ratio=mlp_ratio, dropout=dropout, in_channels=in_channels)
