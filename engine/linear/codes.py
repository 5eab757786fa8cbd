"""Quantized weights as data: the layout of group codes, with no kernel attached (weights/ builds them, the
layers in engine/linear/quantized.py serve them)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

GROUP_SIZE = 32


@dataclass(frozen=True)
class GroupCodes:
    """A weight matrix in groups of `group_size` inputs: w[o, i] = scale[o, g]·codes[o, i] + minimum[o, g], g = i // group_size.

    served: for each source the rows came from, what it was and how it is held, e.g. ("Q4_0 as stored",) or
    ("Q4_K fitted to 4-bit groups at load",): what `/info` reports by GGUF type.
    """

    codes: torch.Tensor  # uint8 (out, in), each in [0, 2**bits)
    scale: torch.Tensor  # float32 (out, in // group_size)
    minimum: torch.Tensor  # float32 (out, in // group_size)
    bits: int
    served: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"group codes are 4 or 8 bits, got {self.bits}")
        out_features, in_features = self.codes.shape
        groups = (out_features, in_features // GROUP_SIZE)
        if in_features % GROUP_SIZE or tuple(self.scale.shape) != groups or tuple(self.minimum.shape) != groups:
            raise ValueError(f"codes {tuple(self.codes.shape)} need {GROUP_SIZE}-input groups: scale and minimum {groups}, "
                             f"got {tuple(self.scale.shape)} and {tuple(self.minimum.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @classmethod
    def fit(cls, weight: torch.Tensor, bits: int, source: str | None = None) -> "GroupCodes":
        """Min/max quantization of float weights (out, in), group by group; `source`: the GGUF type they were
        dequantized from, if any."""
        out_features, in_features = weight.shape
        if in_features % GROUP_SIZE:
            raise ValueError(f"group quantization needs in_features divisible by {GROUP_SIZE}, got {in_features}")
        groups = weight.detach().float().reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
        low, high = groups.amin(-1), groups.amax(-1)  # (out, groups)
        top = 2**bits - 1
        scale = ((high - low) / top).clamp(min=torch.finfo(torch.float32).tiny)
        codes = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, top)
        served = (f"{source} fitted to {bits}-bit groups at load",) if source else ()
        return cls(codes.to(torch.uint8).reshape(out_features, in_features), scale, low, bits, served)

    @classmethod
    def cat(cls, parts: list["GroupCodes | torch.Tensor"]) -> "GroupCodes":
        """The parts' rows one after another (q, k, v -> qkv), in the widest part's bits.

        A 4-bit part is exact in 8 bits (same codes, scale and minimum); a float part is fitted.
        """
        bits = max(p.bits for p in parts if isinstance(p, GroupCodes))
        parts = [p if isinstance(p, GroupCodes) else cls.fit(p, bits) for p in parts]
        served = tuple(dict.fromkeys(s for p in parts for s in p.served))  # each once, in order
        return cls(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                   torch.cat([p.minimum for p in parts]), bits, served)

    def map_rows(self, reorder) -> "GroupCodes":
        """The same matrix with its rows reordered by `reorder` (a function of a (rows, ...) tensor)."""
        return replace(self, codes=reorder(self.codes), scale=reorder(self.scale), minimum=reorder(self.minimum))

    def dequantize(self) -> torch.Tensor:
        """float32 (out, in)."""
        out_features, in_features = self.shape
        groups = self.codes.float().reshape(out_features, -1, GROUP_SIZE)  # (out, groups, 32)
        return (groups * self.scale[..., None] + self.minimum[..., None]).reshape(out_features, in_features)

    def halves(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(4-bit codes, scale, minimum) whose products sum to this matrix's: itself, or 8 bits as 16·high + low."""
        if self.bits == 4:
            return [(self.codes, self.scale, self.minimum)]
        return [(self.codes >> 4, 16 * self.scale, self.minimum), (self.codes & 15, self.scale, torch.zeros_like(self.minimum))]
