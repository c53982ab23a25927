"""Norm inputs decoded onto each token's exact mean and standard deviation.

LayerNorm's backward normalises the saved input with the exact saved statistics, (x - mean) * rstd,
and RMSNorm's with its exact rsqrt(mean(x^2) + eps): a decode error e on a token becomes e * rstd.
A token whose own spread is far below its neighbours' (a zero-initialised class token at a
model's first LayerNorm: HF DeiT, BEiT, YOLOS, ViTMAE from their configs) has rstd up to
1/sqrt(eps) = 1e6, while the `tile/tok` layout's block means are shared with 7 neighbouring
tokens, so its residual's range, and the noise it decodes with, is theirs: relative gradient
errors of 1e6-1e9 (eager and compiled). Holding each token's exact mean and standard deviation
(2 x float32 per token: 8 bytes, 8/(4 F) of the input) and moving the decode onto them,
x~ = mean + (x^ - mean^) * std / std^ per token (mean^, std^ the decode's own), makes both
statistics exact: a constant token decodes exactly, and no token's normalised decode has more
than unit spread, whatever its rstd. The moments are float32 whatever x's dtype: a bf16 mean
would itself be an error of 2^-9 |mean| that rstd multiplies.

On the CPU, eager `NormLayout` holds them only for a tensor with a flat token, one whose whole
range (max - min) is below its quantisation step, so that its decode noise (up to a step) exceeds
its own spread (a typical token of 128 features spans about 3 steps): elsewhere the layout alone,
without the moments' bytes and their passes at pack and unpack (5-8 % of the zoo's small
transformers' steps when always held). The range check is one pass of C (`cpu.token_flat`, 10-60
us a tensor here; torch's amax and amin over a short last dim took up to 7 times longer, 180 us on
(16, 256, 48)). Deciding reads a value (a device sync on a GPU), so on other devices, and in
compiled graphs (static forms), they are always held.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from freqact.engine.layouts import LayoutPacked, TokenLayout
from freqact.kernels import cpu, reference

__all__ = ["MomentsPacked", "NormLayout", "token_moments", "with_moments"]


def _centred(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean, x - mean, std) over the last dim of float32 x, mean and std keeping that dim
    (two passes, ~8x faster than `torch.var_mean` on (16, 64, 128) here: 68 vs 560 us)."""
    mean = x.mean(-1, keepdim=True)
    centred = x - mean
    std = torch.linalg.vector_norm(centred, dim=-1, keepdim=True) / math.sqrt(x.shape[-1])
    return mean, centred, std


def token_moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's mean and standard deviation (population) over the last dim, in float32.

    Args:
        x: (..., F) floating.

    Returns:
        (mean, std), each float32 of shape x.shape[:-1].
    """
    mean, _, std = _centred(x.float())
    return mean.squeeze(-1), std.squeeze(-1)


def with_moments(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """x moved per token onto (mean, std): mean + (x - mean(x)) * std / std(x), computed in
    float32 and returned in x's dtype; a token of x without spread (or of std 0) becomes mean.

    Args:
        x: (..., F) floating, the decode; mean, std: float32 of shape x.shape[:-1].
    """
    _, centred, own_std = _centred(x.float())
    scale = torch.where(own_std > 0, std.unsqueeze(-1) / own_std, 0.0)
    return centred.mul_(scale).add_(mean.unsqueeze(-1)).to(x.dtype)


@dataclass(frozen=True)
class MomentsPacked:
    """A norm input in a token layout and its tokens' exact moments.

    Attributes:
        layout: the `TokenLayout` form of the encoded view (M, T, F).
        mean, std: float32 (M, T): each token's mean and standard deviation over its F features.
    """

    layout: LayoutPacked
    mean: torch.Tensor
    std: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes + self.mean.nbytes + self.std.nbytes


class NormLayout(TokenLayout):
    """A `TokenLayout` whose decode holds each token's exact mean and standard deviation (the
    module docstring): the route of per-token normalisations' inputs."""

    def encode(self, x: torch.Tensor, noise: torch.Tensor | None = None,
               seed: int | None = None, view: tuple[int, ...] | None = None
               ) -> MomentsPacked | LayoutPacked:
        """`TokenLayout.encode` (same arguments) and the moments of the encoded view; on the CPU
        without a flat token, the layout's form alone (module docstring)."""
        packed = super().encode(x, noise, seed, view)
        tokens = x.reshape(packed.shape)
        if x.device.type == "cpu" and self.stats == "tok":
            step = packed.quant.step  # (M, T): one map per token
            fused = tokens.dtype == torch.float32 and tokens.dim() == 3 and self._fused(tokens)
            flat = cpu.token_flat if fused else reference.token_flat
            if not flat(tokens, step):
                return packed
        return MomentsPacked(packed, *token_moments(tokens))

    def decode(self, packed: MomentsPacked | LayoutPacked) -> torch.Tensor:
        """Returns: the layout's decode (moved onto the held moments), of the view's shape."""
        if isinstance(packed, LayoutPacked):
            return super().decode(packed)
        if not isinstance(packed, MomentsPacked):
            raise TypeError(f"packed: expected a MomentsPacked or LayoutPacked, got "
                            f"{type(packed).__name__}")
        return with_moments(super().decode(packed.layout), packed.mean, packed.std)

    def nbytes_for(self, shape: tuple[int, ...]) -> int:
        """Bytes of the packed form of a view of `shape` with the moments: the layout's and 8
        per token (at most what it holds)."""
        return super().nbytes_for(shape) + 8 * math.prod(shape[:-1])
