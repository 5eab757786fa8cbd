"""Quantized weights as data, with no kernel attached (weights/ builds them, the layers in engine/linear/quantized.py
serve them): group codes (GGUF's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and codes fitted at load), super-block codes (GGUF's
Q4_K and Q5_K), sub-block codes (Q6_K), and stacks of these (a fused matrix whose parts are of different types)."""

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
        if self.bits not in (4, 5, 8):
            raise ValueError(f"group codes are 4, 5 or 8 bits, got {self.bits}")
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

        Narrower parts are exact in 8 bits (`widened`); K-quant codes become their groups; a float part is fitted.
        """
        parts = [p.group_codes() if isinstance(p, (SuperBlockCodes, SubBlockCodes)) else p for p in parts]
        bits = max(p.bits for p in parts if isinstance(p, GroupCodes))
        bits = 8 if len({p.bits for p in parts if isinstance(p, GroupCodes)}) > 1 else bits  # 4 beside 5: both in 8
        parts = [(p.widened() if p.bits < bits else p) if isinstance(p, GroupCodes) else cls.fit(p, bits) for p in parts]
        served = tuple(dict.fromkeys(s for p in parts for s in p.served))  # each once, in order
        return cls(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                   torch.cat([p.minimum for p in parts]), bits, served)

    def widened(self) -> "GroupCodes":
        """4- or 5-bit codes as the same weights in 8 bits: with f = 2^(8 − bits), q' = f·q + f/2, scale/f and
        minimum − scale/2 (s'·q' + m' = s·q + m). Spread over the 8-bit range, the codes stay centred where the 8-bit
        kernel centres them (128): kept as they are, q − 128 would meet the inputs' rounding error many times over."""
        f = 2 ** (8 - self.bits)
        return replace(self, codes=self.codes * f + f // 2, scale=self.scale / f, minimum=self.minimum - self.scale / 2,
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
        """(4-bit codes, scale, minimum) whose products sum to this matrix's: itself, or wider codes as 16·high + low.

        torch's int4 kernel computes (q − 8)·scale + zero, zero = minimum + 8·scale rounded to bfloat16; each group's
        minimum goes with the half whose zero is then the smaller (Q8_0's −128·s with the high half's +128·s: 0;
        Q5_0's −16·s with the low half's +8·s: −8·s), so that little is rounded."""
        if self.bits == 4:
            return [(self.codes, self.scale, self.minimum)]
        high = (self.minimum + 128 * self.scale).abs() <= (self.minimum + 8 * self.scale).abs()  # (out, groups)
        zero = torch.zeros_like(self.minimum)
        return [(self.codes >> 4, 16 * self.scale, torch.where(high, self.minimum, zero)),
                (self.codes & 15, self.scale, torch.where(high, zero, self.minimum))]


SUPER_BLOCK = 256  # inputs per K-quant super-block: 8 groups of 32


@dataclass(frozen=True)
class SuperBlockCodes:
    """A weight matrix as GGUF's Q4_K and Q5_K hold it: per super-block of 256 inputs of an output row a float16 scale
    d and minimum scale dmin, per group of 32 a 6-bit scale sc and minimum mn, per input a 4- or 5-bit code q:
    w[o, i] = d[o, b]·sc[o, g]·q[o, i] − dmin[o, b]·mn[o, g],  g = i // 32, b = i // 256."""

    codes: torch.Tensor  # uint8 (out, in), each in [0, 2**bits)
    group_scale: torch.Tensor  # uint8 (out, in // 32), each in [0, 64): sc
    group_minimum: torch.Tensor  # uint8 (out, in // 32), each in [0, 64): mn
    scale: torch.Tensor  # float16 (out, in // 256): d
    minimum_scale: torch.Tensor  # float16 (out, in // 256): dmin
    served: tuple[str, ...] = ()
    bits: int = 4

    def __post_init__(self) -> None:
        out_features, in_features = self.codes.shape
        groups, blocks = (out_features, in_features // GROUP_SIZE), (out_features, in_features // SUPER_BLOCK)
        shapes = [tuple(t.shape) for t in (self.group_scale, self.group_minimum, self.scale, self.minimum_scale)]
        if self.bits not in (4, 5):
            raise ValueError(f"super-block codes are 4 or 5 bits (Q4_K, Q5_K), got {self.bits}")
        if in_features % SUPER_BLOCK or shapes != [groups, groups, blocks, blocks]:
            raise ValueError(f"codes {tuple(self.codes.shape)} need super-blocks of {SUPER_BLOCK} inputs: group scales "
                             f"and minimums {groups}, scales {blocks}; got {shapes}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def group_codes(self) -> GroupCodes:
        """The same weights as groups of the same bits: scale d·sc and minimum −dmin·mn per group (exact in float32;
        the group kernels hold them in float16)."""
        per_group = lambda t: t.float().repeat_interleave(SUPER_BLOCK // GROUP_SIZE, dim=1)  # (out, groups)
        how = f" as {self.bits}-bit groups (d·sc and dmin·mn in float16)"
        return GroupCodes(self.codes, per_group(self.scale) * self.group_scale.float(),
                          -per_group(self.minimum_scale) * self.group_minimum.float(), self.bits,
                          tuple(s.replace(" as stored", how) for s in self.served))

    def dequantize(self) -> torch.Tensor:
        """float32 (out, in)."""
        return self.group_codes().dequantize()

    def columns(self, part: slice) -> "SuperBlockCodes":
        """The matrix of inputs part.start..part.stop, which must be whole super-blocks."""
        blocks, groups = whole(part, SUPER_BLOCK), whole(part, GROUP_SIZE)
        return SuperBlockCodes(self.codes[:, part].contiguous(), self.group_scale[:, groups].contiguous(),
                               self.group_minimum[:, groups].contiguous(), self.scale[:, blocks].contiguous(),
                               self.minimum_scale[:, blocks].contiguous(), self.served, self.bits)

    def map_rows(self, reorder) -> "SuperBlockCodes":
        """The same matrix with its rows reordered by `reorder` (a function of a (rows, ...) tensor)."""
        return replace(self, **{name: reorder(getattr(self, name)) for name in ROW_TENSORS})

    @classmethod
    def cat(cls, parts: list["SuperBlockCodes"]) -> "SuperBlockCodes":
        """The parts' rows one after another (q, k, v -> qkv)."""
        served = tuple(dict.fromkeys(s for p in parts for s in p.served))
        return cls(**{name: torch.cat([getattr(p, name) for p in parts]) for name in ROW_TENSORS}, served=served,
                   bits=parts[0].bits)


ROW_TENSORS = ("codes", "group_scale", "group_minimum", "scale", "minimum_scale")  # each (out, ...)


@dataclass(frozen=True)
class SubBlockCodes:
    """A weight matrix as GGUF's Q6_K holds it: per super-block of 256 inputs of an output row a float16 scale d, per
    sub-block of 16 an int8 scale sc, per input a 6-bit code q: w[o, i] = d[o, i // 256]·sc[o, i // 16]·(q[o, i] − 32)."""

    codes: torch.Tensor  # uint8 (out, in), each in [0, 64)
    scale: torch.Tensor  # int8 (out, in // 16): sc
    block_scale: torch.Tensor  # float16 (out, in // 256): d
    served: tuple[str, ...] = ()
    bits = 6
    SUB_BLOCK = 16

    def __post_init__(self) -> None:
        out_features, in_features = self.codes.shape
        shapes = [tuple(self.scale.shape), tuple(self.block_scale.shape)]
        if in_features % SUPER_BLOCK or shapes != [(out_features, in_features // 16), (out_features, in_features // SUPER_BLOCK)]:
            raise ValueError(f"codes {tuple(self.codes.shape)} need super-blocks of {SUPER_BLOCK} inputs: scales "
                             f"{(out_features, in_features // 16)} and {(out_features, in_features // SUPER_BLOCK)}, got {shapes}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """float32 (out, in)."""
        out_features, in_features = self.shape
        d = self.block_scale.float().repeat_interleave(SUPER_BLOCK // 16, dim=1) * self.scale.float()  # (out, in // 16)
        q = self.codes.float().reshape(out_features, -1, 16) - 32
        return (q * d[..., None]).reshape(out_features, in_features)

    def group_codes(self) -> GroupCodes:
        """The weights fitted to 8-bit groups (a group's two sub-blocks have scales of their own): what torch's
        kernel and a fusion with other types take."""
        served = tuple(s.replace(" as stored", " fitted to 8-bit groups at load") for s in self.served)
        return replace(GroupCodes.fit(self.dequantize(), 8), served=served)

    def columns(self, part: slice) -> "SubBlockCodes":
        """The matrix of inputs part.start..part.stop, which must be whole super-blocks."""
        blocks, subs = whole(part, SUPER_BLOCK), whole(part, 16)
        return SubBlockCodes(self.codes[:, part].contiguous(), self.scale[:, subs].contiguous(),
                             self.block_scale[:, blocks].contiguous(), self.served)

    def map_rows(self, reorder) -> "SubBlockCodes":
        return replace(self, codes=reorder(self.codes), scale=reorder(self.scale), block_scale=reorder(self.block_scale))

    @classmethod
    def cat(cls, parts: list["SubBlockCodes"]) -> "SubBlockCodes":
        served = tuple(dict.fromkeys(s for p in parts for s in p.served))
        return cls(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                   torch.cat([p.block_scale for p in parts]), served)


def whole(part: slice, size: int) -> slice:
    """The blocks of `size` inputs that inputs part.start..part.stop are; ValueError if they are not whole ones."""
    if part.start % size or part.stop % size:
        raise ValueError(f"inputs {part.start}..{part.stop} are not whole blocks of {size}")
    return slice(part.start // size, part.stop // size)


@dataclass(frozen=True)
class StackedCodes:
    """Row-stacked parts of different kinds (q and k in Q4_K above v in Q6_K, as Q4_K_M files hold half their layers'
    attention), each kept as stored: served part by part and concatenated, rather than all fitted to one kind."""

    parts: tuple["GroupCodes | SuperBlockCodes | SubBlockCodes", ...]

    def __post_init__(self) -> None:
        if len(self.parts) < 2 or len({p.shape[1] for p in self.parts}) != 1:
            raise ValueError(f"a stack is two or more parts of one input width, got {[p.shape for p in self.parts]}")

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def served(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s for p in self.parts for s in p.served))

    def group_codes(self) -> GroupCodes:
        """The whole stack as one matrix of group codes (torch's kernel takes no stack)."""
        return GroupCodes.cat(list(self.parts))

    def dequantize(self) -> torch.Tensor:
        """float32 (out, in)."""
        return torch.cat([p.dequantize() for p in self.parts])

    def columns(self, part: slice) -> "StackedCodes":
        return StackedCodes(tuple(p.columns(part) for p in self.parts))

    def map_rows(self, reorder) -> GroupCodes:
        """A row function of the whole matrix (a shard's q, k and v rows) reaches across the parts: the stack becomes
        one matrix of group codes first."""
        return self.group_codes().map_rows(reorder)


QuantizedWeight = GroupCodes | SuperBlockCodes | SubBlockCodes | StackedCodes
QUANTIZED = (GroupCodes, SuperBlockCodes, SubBlockCodes, StackedCodes)  # for isinstance


def fuse(parts: list["QuantizedWeight | torch.Tensor"]) -> "QuantizedWeight | torch.Tensor":
    """Row-stacked parts (q, k, v -> qkv): floats stay floats; quantized parts of one kind and width are one matrix of
    that kind; quantized parts of several kinds a stack of runs of one kind each; quantized parts beside float ones
    group codes, the floats fitted."""
    if not any(isinstance(p, QUANTIZED) for p in parts):
        return torch.cat(parts)
    if not all(isinstance(p, (GroupCodes, SuperBlockCodes, SubBlockCodes)) for p in parts):
        return GroupCodes.cat(parts)
    runs: list[list] = []
    for p in parts:
        if runs and (type(runs[-1][0]), runs[-1][0].bits) == (type(p), p.bits):
            runs[-1].append(p)
        else:
            runs.append([p])
    joined = [run[0] if len(run) == 1 else type(run[0]).cat(run) for run in runs]
    return joined[0] if len(joined) == 1 else StackedCodes(tuple(joined))
