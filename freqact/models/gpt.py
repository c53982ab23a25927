"""A small GPT/Llama-style decoder-only language model (Radford et al. 2019; Touvron et al. 2023).

Token embedding, pre-norm decoder blocks (RMSNorm, causal multi-head self-attention with rotary
position embedding, RMSNorm, SwiGLU MLP), a final RMSNorm and an untied linear head. The code is
written the way Llama's reference implementation and Hugging Face's `LlamaModel` write it, since
those are the idioms a compressor meets in practice: RMSNorm is functional inside its module
(`x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)`, in float32), attention is
`F.scaled_dot_product_attention(..., is_causal=True)` on q/k/v from separate bias-free Linear
layers, the MLP is `down(SiLU(gate(x)) * up(x))` with an `nn.SiLU` module.

Sizes: in this zoo `num_classes` is the vocabulary size V (the logits classify every position
into V tokens), so `get("gpt", num_classes=256)` is a byte-level model. `input_shape` is (T,),
the context length; the input is int64 token ids in [0, V) of shape (N, T') with T' <= T, and
the output is logits (N, T', V). Defaults: dim 128, depth 4, 4 heads, context 64, MLP width
ceil(8/3 dim) rounded up to 32 (Llama's rule: 352).

Initialisation as GPT-2: Linear and embedding weights `normal_(std=0.02)`, the output
projections of attention and MLP with std 0.02 / sqrt(2 depth), RMSNorm weights 1.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from freqact import _validate
from freqact.models import check_dropout, register


class RMSNorm(nn.Module):
    """Root-mean-square normalisation over the last dim with a learned scale (Llama's code).

    Maps (..., dim) to (..., dim) in the input's dtype.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotary_tables(context: int, head_dim: int, base: float = 10000.0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each (context, head_dim): rotation angles t / base**(2i / head_dim)."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(context, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)  # Hugging Face's half-split layout
    return angles.cos().float(), angles.sin().float()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of (N, heads, T, head_dim) with cos/sin (T, head_dim)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class CausalSelfAttention(nn.Module):
    """Causal multi-head self-attention with rotary positions; (N, T, dim) -> (N, T, dim)."""

    def __init__(self, dim: int, heads: int, context: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)
        cos, sin = _rotary_tables(context, dim // heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = (proj(x).view(n, t, self.heads, d // self.heads).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))  # (N, heads, T, d/h)
        cos, sin = self.cos[:t], self.sin[:t]
        out = F.scaled_dot_product_attention(
            _rotate(q, cos, sin), _rotate(k, cos, sin), v, is_causal=True,
            dropout_p=self.dropout if self.training else 0.0,
        )
        return self.o_proj(out.transpose(1, 2).reshape(n, t, d))


class SwiGLU(nn.Module):
    """down(SiLU(gate(x)) * up(x)), bias-free; (N, T, dim) -> (N, T, dim)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.act = nn.SiLU()
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderBlock(nn.Module):
    """Pre-norm decoder block: x + Attention(RMSNorm(x)), then x + SwiGLU(RMSNorm(x)).

    Maps tokens (N, T, dim) to (N, T, dim).
    """

    # How analyses read the output (freqact.analysis.common.to_channels_first): tokens, no spatial map.
    map_layout = "tokens"

    def __init__(self, dim: int, heads: int, context: int, hidden: int,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.input_norm = RMSNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, context, dropout)
        self.post_attention_norm = RMSNorm(dim)
        self.mlp = SwiGLU(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x))
        return x + self.mlp(self.post_attention_norm(x))


class GPT(nn.Module):
    """Decoder-only language model.

    Args:
        num_classes: vocabulary size V (token ids and logits).
        context: longest input length T (rotary tables are built for it).
        dim: token width; a multiple of `heads` with an even head width.
        depth: number of decoder blocks.
        heads: attention heads.
        dropout: dropout probability inside attention.

    Input int64 token ids (N, T') with 1 <= T' <= context -> logits (N, T', V).
    """

    def __init__(self, num_classes: int = 256, *, context: int = 64, dim: int = 128,
                 depth: int = 4, heads: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        for name, value in (("num_classes", num_classes), ("context", context), ("dim", dim),
                            ("depth", depth), ("heads", heads)):
            _validate.positive_int(name, value)
        if dim % heads or (dim // heads) % 2:
            raise ValueError(f"dim: expected a multiple of 2 * heads={2 * heads}, got {dim}")
        dropout = check_dropout(dropout)
        self.input_shape = (context,)
        self.vocab_size = num_classes
        hidden = 32 * math.ceil(8 * dim / 3 / 32)

        self.embed = nn.Embedding(num_classes, dim)
        self.blocks = nn.Sequential(
            *(DecoderBlock(dim, heads, context, hidden, dropout) for _ in range(depth))
        )
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, num_classes, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
        for block in self.blocks:
            for out_proj in (block.attn.o_proj, block.mlp.down_proj):
                nn.init.normal_(out_proj.weight, std=0.02 / math.sqrt(2 * depth))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() != 2 or ids.dtype != torch.int64 or not 1 <= ids.shape[1] <= \
                self.input_shape[0]:
            raise ValueError(f"ids: expected int64 token ids of shape (N, T) with "
                             f"1 <= T <= {self.input_shape[0]}, got {ids.dtype} "
                             f"{tuple(ids.shape)}")
        return self.head(self.norm(self.blocks(self.embed(ids))))  # (N, T, V)


@register("gpt")
def gpt(num_classes: int = 256, *, context: int = 64, dim: int = 128, depth: int = 4,
        heads: int = 4, dropout: float = 0.0) -> GPT:
    """Small Llama-style decoder: dim 128, depth 4, 4 heads, context 64; V = num_classes."""
    return GPT(num_classes, context=context, dim=dim, depth=depth, heads=heads, dropout=dropout)
