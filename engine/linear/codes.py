"""Quantized weights as data, with no kernel attached (weights/ builds them, the layers in engine/linear/quantized.py
serve them): group codes (GGUF's Q4_0, Q4_1, Q8_0 and codes fitted at load) and super-block codes (GGUF's Q4_K)."""

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
    def cat(cls, parts: list["GroupCodes | SuperBlockCodes | torch.Tensor"]) -> "GroupCodes":
        """The parts' rows one after another (q, k, v -> qkv), in the widest part's bits.

        A 4-bit part is exact in 8 bits (`widened`); super-block codes become their groups; a float part is fitted.
        """
        parts = [p.group_codes() if isinstance(p, SuperBlockCodes) else p for p in parts]
        bits = max(p.bits for p in parts if isinstance(p, GroupCodes))
        parts = [(p.widened() if p.bits < bits else p) if isinstance(p, GroupCodes) else cls.fit(p, bits) for p in parts]
        served = tuple(dict.fromkeys(s for p in parts for s in p.served))  # each once, in order
        return cls(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                   torch.cat([p.minimum for p in parts]), bits, served)

    def widened(self) -> "GroupCodes":
        """4-bit codes as the same weights in 8 bits: q' = 16·q + 8, scale/16, minimum − scale/2 (s'·q' + m' = s·q + m).
        Spread over the 8-bit range, the codes stay centred where the 8-bit kernel centres them (128): kept as they
        are, q − 128 would meet the inputs' rounding error fifteen times over."""
        if self.bits != 4:
            raise ValueError(f"only 4-bit codes widen, these are {self.bits}-bit")
        return replace(self, codes=self.codes * 16 + 8, scale=self.scale / 16, minimum=self.minimum - self.scale / 2,
                       bits=8)

    def map_rows(self, reorder) -> "GroupCodes":
        """The same matrix with its rows reordered by `reorder` (a function of a (rows, ...) tensor)."""
        return replace(self, codes=reorder(self.codes), scale=reorder(self.scale), minimum=reorder(self.minimum))

    def columns(self, part: slice) -> "GroupCodes":
        """The matrix of inputs part.start..part.stop, which must be whole groups."""
        groups = whole(part, GROUP_SIZE)
        return replace(self, codes=self.codes[:, part].contiguous(), scale=self.scale[:, groups].contiguous(),
                       minimum=self.minimum[:, groups].contiguous())

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


SUPER_BLOCK = 256  # inputs per K-quant super-block: 8 groups of 32


@dataclass(frozen=True)
class SuperBlockCodes:
    """A weight matrix as GGUF's Q4_K holds it: per super-block of 256 inputs of an output row a float16 scale d
    and minimum scale dmin, per group of 32 a 6-bit scale sc and minimum mn, per input a 4-bit code q:
    w[o, i] = d[o, b]·sc[o, g]·q[o, i] − dmin[o, b]·mn[o, g],  g = i // 32, b = i // 256."""

    codes: torch.Tensor  # uint8 (out, in), each in [0, 16)
    group_scale: torch.Tensor  # uint8 (out, in // 32), each in [0, 64): sc
    group_minimum: torch.Tensor  # uint8 (out, in // 32), each in [0, 64): mn
    scale: torch.Tensor  # float16 (out, in // 256): d
    minimum_scale: torch.Tensor  # float16 (out, in // 256): dmin
    served: tuple[str, ...] = ()
    bits = 4

    def __post_init__(self) -> None:
        out_features, in_features = self.codes.shape
        groups, blocks = (out_features, in_features // GROUP_SIZE), (out_features, in_features // SUPER_BLOCK)
        shapes = [tuple(t.shape) for t in (self.group_scale, self.group_minimum, self.scale, self.minimum_scale)]
        if in_features % SUPER_BLOCK or shapes != [groups, groups, blocks, blocks]:
            raise ValueError(f"codes {tuple(self.codes.shape)} need super-blocks of {SUPER_BLOCK} inputs: group scales "
                             f"and minimums {groups}, scales {blocks}; got {shapes}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def group_codes(self) -> GroupCodes:
        """The same weights as 4-bit groups: scale d·sc and minimum −dmin·mn per group (exact in float32; the group
        kernels hold them in float16)."""
        per_group = lambda t: t.float().repeat_interleave(SUPER_BLOCK // GROUP_SIZE, dim=1)  # (out, groups)
        served = tuple(s.replace(" as stored", " as 4-bit groups (d·sc and dmin·mn in float16)") for s in self.served)
        return GroupCodes(self.codes, per_group(self.scale) * self.group_scale.float(),
                          -per_group(self.minimum_scale) * self.group_minimum.float(), 4, served)

    def dequantize(self) -> torch.Tensor:
        """float32 (out, in)."""
        return self.group_codes().dequantize()

    def columns(self, part: slice) -> "SuperBlockCodes":
        """The matrix of inputs part.start..part.stop, which must be whole super-blocks."""
        blocks, groups = whole(part, SUPER_BLOCK), whole(part, GROUP_SIZE)
        return SuperBlockCodes(self.codes[:, part].contiguous(), self.group_scale[:, groups].contiguous(),
                               self.group_minimum[:, groups].contiguous(), self.scale[:, blocks].contiguous(),
                               self.minimum_scale[:, blocks].contiguous(), self.served)

    def map_rows(self, reorder) -> "SuperBlockCodes":
        """The same matrix with its rows reordered by `reorder` (a function of a (rows, ...) tensor)."""
        return replace(self, **{name: reorder(getattr(self, name)) for name in ROW_TENSORS})

    @classmethod
    def cat(cls, parts: list["SuperBlockCodes"]) -> "SuperBlockCodes":
        """The parts' rows one after another (q, k, v -> qkv)."""
        served = tuple(dict.fromkeys(s for p in parts for s in p.served))
        return cls(**{name: torch.cat([getattr(p, name) for p in parts]) for name in ROW_TENSORS}, served=served)


ROW_TENSORS = ("codes", "group_scale", "group_minimum", "scale", "minimum_scale")  # each (out, ...)


def whole(part: slice, size: int) -> slice:
    """The blocks of `size` inputs that inputs part.start..part.stop are; ValueError if they are not whole ones."""
    if part.start % size or part.stop % size:
        raise ValueError(f"inputs {part.start}..{part.stop} are not whole blocks of {size}")
    return slice(part.start // size, part.stop // size)


QuantizedWeight = GroupCodes | SuperBlockCodes
QUANTIZED = (GroupCodes, SuperBlockCodes)  # for isinstance


def fuse(parts: list["QuantizedWeight | torch.Tensor"]) -> "QuantizedWeight | torch.Tensor":
    """Row-stacked parts (q, k, v -> qkv): floats stay floats; super-block codes of one kind stay so; any other
    quantized part makes the whole group codes."""
    if all(isinstance(p, SuperBlockCodes) for p in parts):
        return SuperBlockCodes.cat(parts)
    if any(isinstance(p, QUANTIZED) for p in parts):
        return GroupCodes.cat(parts)
    return torch.cat(parts)
