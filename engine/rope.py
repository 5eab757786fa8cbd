"""Rotary position embedding in the half-split layout of Hugging Face checkpoints.

Coordinate i is paired with i + d/2 (not with its neighbour); GGUF files permute q/k rows
to the interleaved layout, which `weights/` undoes on import so this one layout serves both.
"""

from __future__ import annotations

import math

import torch

from engine.config import ModelConfig, RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """One frequency per coordinate pair, (head_dim/2,) float32, after any context scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_frequencies(inv_freq, scaling)
    return inv_freq


def _llama3_frequencies(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between blended.
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryTable:
    """cos/sin for every position below `max_seq_len`, computed once in float32: one table per base the layers
    use ("global", and "local" where sliding layers have a base of their own, as Gemma 3's do)."""

    def __init__(self, config: ModelConfig, max_seq_len: int, device: torch.device, dtype: torch.dtype):
        bases = {"global": (config.rope_theta, config.rope_scaling)}
        if config.local_rope_theta is not None:
            bases["local"] = (config.local_rope_theta, RopeScaling())
        self.tables = {name: self._table(inverse_frequencies(config.head_dim, theta, scaling), max_seq_len,
                                         device, dtype) for name, (theta, scaling) in bases.items()}

    @classmethod
    def of(cls, tables: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> "RotaryTable":
        """A table over given (cos, signed sin) tensors by base (a compiled step's own names for the same tensors)."""
        table = cls.__new__(cls)
        table.tables = tables
        return table

    @staticmethod
    def _table(inv_freq: torch.Tensor, max_seq_len: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)  # (T, d/2)
        cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(device=device, dtype=dtype)  # (T, d)
        # rotate_half(x) * sin == roll(x, d/2) * [-sin, sin]: the sign is folded into the table.
        signed_sin = torch.cat([-angles.sin(), angles.sin()], dim=-1).to(device=device, dtype=dtype)  # (T, d)
        return cos, signed_sin

    def lookup(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """positions (b, s) -> per table, cos and sin of shape (b, 1, s, d), broadcast over heads."""
        return {name: (cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
                for name, (cos, sin) in self.tables.items()}


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x (b, heads, s, d) rotated by each position's angle: pair (i, i + d/2) turns as one 2-D vector.

    Equals x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1].
    """
    half = x.shape[-1] // 2
    # roll(x, d/2) as the two halves swapped: inductor reads each half as one vector, where roll's modular
    # index made it load scalar by scalar.
    swapped = torch.cat([x[..., half:], x[..., :half]], dim=-1)
    return x * cos + swapped * signed_sin
