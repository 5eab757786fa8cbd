"""Linear layers over quantized weights (weight-only: activations stay in bfloat16), for CPU decode.

Four layouts:
- groups (`GroupCodes`): each group of 32 inputs of an output row keeps unsigned codes, one scale and one
  minimum: w = scale·q + minimum. 4-bit codes are GGUF's Q4_0 and Q4_1 blocks, 5-bit codes Q5_0's and Q5_1's,
  8-bit codes Q8_0's (shifted by 128). kvserve's own kernels (engine/linear/native) run them where they build, as
  integer dot products with the inputs quantized to 8 bits per group, as llama.cpp computes them (`Codes4Linear`,
  `Codes5Linear`, `Codes8Linear`). Elsewhere torch's int4 kernel runs both (`GroupLinear`): an 8-bit code is two 4-bit
  halves, 16·high + low, served as two stacked output rows and summed.
- super-blocks (`SuperBlockCodes`): GGUF's Q4_K and Q5_K as stored, 256 inputs with a float16 scale and minimum
  scale, each group of 32 in them a 6-bit scale and minimum of those: `SuperBlockLinear` on kvserve's kernel, each
  group multiplied as a group of scale d·sc and minimum −dmin·mn.
- sub-blocks (`SubBlockCodes`): GGUF's Q6_K as stored, 6-bit codes with an int8 scale per 16 inputs and a float16
  one per 256: `SubBlock6Linear` on kvserve's kernel.
- rows (`Int8Linear`): each output row keeps 8-bit codes in [-127, 127] and one scale (int8pack).
A matrix fused from parts of different layouts (q, k and v of different GGUF types) is a `StackedLinear` of them.

Which of them serves a given matrix is the planner's decision (engine/linear/planner.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.linear.codes import GROUP_SIZE, SUPER_BLOCK, GroupCodes, SubBlockCodes, SuperBlockCodes
from engine.linear.timing import NEVER, ProductForms


def decoding(x: torch.Tensor) -> bool:
    """Whether x (b, 1, in) holds one position per sequence: a decode step, in which every row must get the bits it
    gets alone, so that a request's tokens never depend on what else is decoded beside it (nor a verified draft's
    on the drafts after it: engine/engine.py's _verify)."""
    return x.dim() == 3 and x.shape[1] == 1


class WeightOnlyLinear(nn.Module):
    """A linear layer whose weight is stored quantized; subclasses hold the codes and run one kernel."""

    bias: torch.Tensor | None
    in_features: int
    out_features: int
    activation_dtype: torch.dtype  # what the layer takes and returns

    @property
    def compute_dtype(self) -> torch.dtype:
        """What the kernel itself takes: inputs in another dtype are converted first (in a compiled graph, by the
        kernel that made them)."""
        return self.activation_dtype

    def product(self, rows: torch.Tensor, alone: bool = False) -> torch.Tensor:
        """rows (tokens, in) -> (tokens, out), without the bias. alone: every row gets the bits it gets in a product
        of its own, whatever the number of rows (a form that rounds differently for many rows is not taken)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.product(x.reshape(-1, x.shape[-1]), alone=decoding(x))  # (tokens, in): the kernels take a matrix
        y = y.reshape(*x.shape[:-1], self.out_features)  # (..., out)
        return y if self.bias is None else y + self.bias


class GroupLinear(WeightOnlyLinear):
    """Group codes through torch's int4 kernel, which computes (q - 8)·scale + zero per group."""

    def __init__(self, weight: GroupCodes, bias: torch.Tensor | None, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        halves = weight.halves()
        codes = torch.cat([q for q, _, _ in halves]).to(torch.int32)  # (halves·out, in)
        scale = torch.cat([s for _, s, _ in halves])  # (halves·out, groups)
        zero = torch.cat([m for _, _, m in halves]) + 8 * scale  # zero = minimum + 8·scale gives scale·q + minimum
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2))
        scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1)  # (groups, halves·out, 2)
        self.register_buffer("scales_and_zeros", scales_and_zeros.contiguous().to(dtype))
        self.bias = bias
        self.halves = len(halves)
        self.out_features, self.in_features = weight.shape
        self.activation_dtype = dtype

    def product(self, rows: torch.Tensor, alone: bool = False) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP_SIZE, self.scales_and_zeros)
        if self.halves == 1:
            return y
        return y.view(-1, self.halves, self.out_features).sum(1)  # (tokens, 2, out): high and low halves -> (tokens, out)


class GroupTiles(WeightOnlyLinear):
    """Group codes through one of kvserve's kernels (engine/linear/native), in tiles of 16 output rows.

    The rows are padded to whole tiles with zero codes and scales; the kernel returns only `out_features`.
    Scales and minimums are float16, as GGUF stores them (exact for its blocks); centred codes (Q4_0, Q5_0, Q8_0:
    minimum = −centre·scale) hold no minimums.
    """

    TILE = 16  # output rows per tile
    bits: int

    def __init__(self, weight: GroupCodes, bias: torch.Tensor | None, dtype: torch.dtype,
                 forms: ProductForms = ProductForms()):
        super().__init__()
        if weight.bits != self.bits:
            raise ValueError(f"{type(self).__name__} serves {self.bits}-bit codes, got {weight.bits}-bit ones")
        self.out_features, self.in_features = weight.shape
        pad = -self.out_features % self.TILE
        codes = F.pad(weight.codes, (0, 0, 0, pad))
        tiles, groups = codes.shape[0] // self.TILE, self.in_features // GROUP_SIZE
        self.register_buffer("packed", self.pack(codes.view(tiles, self.TILE, groups, GROUP_SIZE)).reshape(tiles, -1))
        scale = tiles_of(weight.scale, self.TILE).to(torch.float16)
        minimum = tiles_of(weight.minimum, self.TILE).to(torch.float16)
        if torch.equal(minimum, -self.centre * scale):  # Q4_0, Q5_0, Q8_0: w = s·(q − centre), no minimum to hold
            minimum = minimum.new_empty(0)
        self.register_buffer("scale", scale)
        self.register_buffer("minimum", minimum)  # empty for centred codes: the kernel then reads scales alone
        self.bias = bias
        self.activation_dtype = dtype
        self.forms = forms  # the kernel's form by input rows: as measured for this CPU (the planner), else dot products

    @staticmethod
    def pack(codes: torch.Tensor) -> torch.Tensor:
        """codes (tile, row, group, 32) -> the kernel's bytes (tile, group, ...)."""
        raise NotImplementedError

    @property
    def centre(self) -> int:
        """Where the kernel centres the codes: 8, 16 or 128."""
        return 2 ** (self.bits - 1)

    @property
    def kernel(self):
        """The torch op for these codes, kvserve::codes{bits}_product (registered by engine.linear.native.load_kernels)."""
        return getattr(torch.ops.kvserve, f"codes{self.bits}_product")

    def product(self, rows: torch.Tensor, alone: bool = False) -> torch.Tensor:
        # Dot products and integer tiles give a row the same bits at any row count; bfloat16 tiles, which take the
        # inputs unquantized, do not.
        y = self.kernel(rows.contiguous(), self.packed, self.scale, self.minimum, self.out_features,
                        self.forms.integer_tiles_from, NEVER if alone else self.forms.bfloat16_tiles_from)
        return y.to(self.activation_dtype)

    @staticmethod
    def row_codes(packed: torch.Tensor, tile: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        """The codes of row `row` of tile `tile` (each (n,)) from `pack`'s bytes: (n, in) uint8."""
        raise NotImplementedError

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The weights of output rows `ids` (n,), as the codes hold them: (n, in) float32 (an embedding's lookup).
        Sizes as ids.shape[0], not len(ids): traced for a compiled step, a batch's size stays symbolic."""
        tile, row = ids // self.TILE, ids % self.TILE
        codes = self.row_codes(self.packed, tile, row).float().view(ids.shape[0], -1, GROUP_SIZE)  # (n, group, 32)
        scale = self.scale[tile, :, row].float()[..., None]  # (n, group, 1)
        if self.minimum.numel() == 0:  # centred: s·(q − centre)
            return ((codes - self.centre) * scale).view(ids.shape[0], self.in_features)
        return (codes * scale + self.minimum[tile, :, row].float()[..., None]).view(ids.shape[0], self.in_features)


class Codes4Linear(GroupTiles):
    """4-bit codes (Q4_0, Q4_1): integer dot products with the inputs quantized to 8 bits per group, the codes
    centred on 8 (engine/linear/native/codes4_product.cpp)."""

    bits = 4

    @staticmethod
    def pack(codes: torch.Tensor) -> torch.Tensor:
        tiles, rows, groups, _ = codes.shape
        q = codes.view(tiles, rows, groups, 4, 2, 4)  # (tile, row, group, run k, nibble, input 8k + 4·nibble + i)
        q = q.permute(0, 2, 3, 1, 5, 4)  # (tile, group, run, row, input, nibble): the kernel's byte order
        return (q[..., 0] | q[..., 1] << 4).contiguous()

    @staticmethod
    def row_codes(packed: torch.Tensor, tile: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        return nibbles(packed.view(packed.shape[0], -1, 4, Codes4Linear.TILE, 4)[tile, :, :, row])


class Codes5Linear(GroupTiles):
    """5-bit codes (Q5_0, Q5_1): Codes4Linear's products with the codes centred on 16, the low 4 bits packed as
    Codes4Linear packs them and the fifth bits after them (engine/linear/native/codes5_product.cpp)."""

    bits = 5

    @staticmethod
    def pack(codes: torch.Tensor) -> torch.Tensor:
        tiles, rows, groups, _ = codes.shape
        low = Codes4Linear.pack(codes & 15).reshape(tiles, groups, 256)
        fifth = (codes >> 4).view(tiles, rows, groups, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)  # as Codes4Linear's bytes
        pairs = (fifth[..., 0] | fifth[..., 1] << 1).reshape(tiles, groups, 4, 4, 16)  # run byte 16t + c: (t, c)
        shifts = torch.arange(0, 8, 2, dtype=torch.uint8).view(4, 1)  # byte c holds run byte 16t + c at bits 2t, 2t+1
        plane = (pairs << shifts).sum(3, dtype=torch.uint8)  # (tile, group, run, 16): disjoint bits, so sum = or
        return torch.cat([low, plane.reshape(tiles, groups, 64)], dim=-1).contiguous()

    @staticmethod
    def row_codes(packed: torch.Tensor, tile: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        per_group = packed.view(packed.shape[0], -1, 320)  # (tile, group, 256 bytes of low bits + 64 of fifth bits)
        low = Codes4Linear.row_codes(per_group[..., :256], tile, row)
        # Row r's input i of a run is run byte 4r + i = 16t + c: plane byte c = 4·(r mod 4) + i, bits 2t and 2t + 1.
        plane = per_group[..., 256:].reshape(packed.shape[0], -1, 4, 4, 4)[tile, :, :, row % 4]  # (n, group, run, 4)
        pairs = plane >> (2 * (row // 4)).to(torch.uint8).view(-1, 1, 1, 1) & 3
        fifth = torch.stack([pairs & 1, pairs >> 1], dim=-2)  # (n, group, run, nibble, input): as `nibbles` orders
        return low | fifth.reshape(low.shape) << 4


class Codes8Linear(GroupTiles):
    """8-bit codes (Q8_0): integer dot products with the inputs quantized to 8 bits per group, the codes centred
    on 128 (engine/linear/native/codes8_product.cpp)."""

    bits = 8

    @staticmethod
    def pack(codes: torch.Tensor) -> torch.Tensor:
        tiles, rows, groups, _ = codes.shape
        q = codes.view(tiles, rows, groups, 8, 4)  # (tile, row, group, run k, input 4k + i)
        return q.permute(0, 2, 3, 1, 4).contiguous()  # (tile, group, run, row, input): the kernel's byte order

    @staticmethod
    def row_codes(packed: torch.Tensor, tile: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        picked = packed.view(packed.shape[0], -1, 8, Codes8Linear.TILE, 4)[tile, :, :, row]  # (n, group, run, input)
        return picked.reshape(tile.shape[0], -1)


class SuperBlockLinear(WeightOnlyLinear):
    """GGUF's Q4_K and Q5_K as stored, through kvserve's kernel (engine/linear/native/superblock_product.cpp): the
    codes packed as Codes4Linear or Codes5Linear packs them, in tiles of 16 output rows, beside each tile's 6-bit group
    scales and minimums (a byte each) and its super-blocks' float16 d and dmin. Each group is then a group of scale
    d·sc and minimum −dmin·mn, multiplied as Codes4Linear and Codes5Linear multiply one. From `forms`'
    integer_tiles_from rows, where the CPU has AMX, each whole 16 input rows go through integer tiles: the same integer
    sums as the dot products, so a row gets the same bits at any row count."""

    TILE = 16

    def __init__(self, weight: SuperBlockCodes, bias: torch.Tensor | None, dtype: torch.dtype,
                 forms: ProductForms = ProductForms()):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        tiled = lambda t: tiles_of(t, self.TILE)  # (tile, column, row)
        codes = F.pad(weight.codes, (0, 0, 0, -self.out_features % self.TILE))
        tiles, groups = codes.shape[0] // self.TILE, self.in_features // GROUP_SIZE
        packing = Codes5Linear if weight.bits == 5 else Codes4Linear
        self.register_buffer("packed", packing.pack(codes.view(tiles, self.TILE, groups, GROUP_SIZE)).reshape(tiles, -1))
        self.bits = weight.bits
        self.register_buffer("group_scale", tiled(weight.group_scale))
        self.register_buffer("group_minimum", tiled(weight.group_minimum))
        self.register_buffer("scale", tiled(weight.scale))
        self.register_buffer("minimum_scale", tiled(weight.minimum_scale))
        self.bias = bias
        self.activation_dtype = dtype
        self.forms = forms  # only integer_tiles_from counts: bfloat16 tiles would give a row other bits

    def product(self, rows: torch.Tensor, alone: bool = False) -> torch.Tensor:  # every form: each row alone
        kernel = getattr(torch.ops.kvserve, f"superblock{self.bits}_product")
        y = kernel(rows.contiguous(), self.packed, self.group_scale, self.group_minimum, self.scale, self.minimum_scale,
                   self.out_features, self.forms.integer_tiles_from)
        return y.to(self.activation_dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The weights of output rows `ids` (n,), as the codes hold them: (n, in) float32 (an embedding's lookup)."""
        tile, row = ids // self.TILE, ids % self.TILE
        packing = Codes5Linear if self.bits == 5 else Codes4Linear
        codes = packing.row_codes(self.packed, tile, row).float().view(ids.shape[0], -1, GROUP_SIZE)  # (n, group, 32)
        per_group = lambda t: t[tile, :, row].float().repeat_interleave(SUPER_BLOCK // GROUP_SIZE, dim=1)  # (n, group)
        scale = per_group(self.scale) * self.group_scale[tile, :, row].float()  # d·sc
        minimum = per_group(self.minimum_scale) * self.group_minimum[tile, :, row].float()  # dmin·mn
        return (codes * scale[..., None] - minimum[..., None]).view(ids.shape[0], self.in_features)


class SubBlock6Linear(WeightOnlyLinear):
    """GGUF's Q6_K as stored, through kvserve's kernel (engine/linear/native/subblock6_product.cpp): in tiles of 16
    output rows, each group's low 4 bits of the codes packed as Codes4Linear packs codes, then their high 2 bits; each
    tile's int8 sub-block scales and its super-blocks' float16 d beside them. 6.56 bits per weight, as the file.
    From `forms`' integer_tiles_from rows, where the CPU has AMX, each whole 16 input rows go through integer tiles
    (a tile product per sub-block): the same integer sums, so a row gets the same bits at any row count."""

    TILE = 16

    def __init__(self, weight: SubBlockCodes, bias: torch.Tensor | None, dtype: torch.dtype,
                 forms: ProductForms = ProductForms()):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        codes = F.pad(weight.codes, (0, 0, 0, -self.out_features % self.TILE))
        tiles, groups = codes.shape[0] // self.TILE, self.in_features // GROUP_SIZE
        codes = codes.view(tiles, self.TILE, groups, GROUP_SIZE)
        low = Codes4Linear.pack(codes & 15).view(tiles, groups, 4 * 64)
        high = (codes >> 4).view(tiles, self.TILE, groups, 4, 2, 4)  # (tile, row, group, run k, nibble, input)
        high = high.permute(0, 2, 3, 1, 5, 4)  # (tile, group, run, row, input, nibble): a run's byte order
        high = (high[..., 0] | high[..., 1] << 2).reshape(tiles, groups, 2, 2, 64)  # a run byte's 4 high bits
        high = high[:, :, :, 0] | high[:, :, :, 1] << 4  # (tile, group, plane j, 64): runs 2j and 2j + 1, byte by byte
        self.register_buffer("packed", torch.cat([low, high.reshape(tiles, groups, 128)], dim=-1).reshape(tiles, -1))
        self.register_buffer("scale", tiles_of(weight.scale, self.TILE))  # (tile, group · 2, row)
        self.register_buffer("block_scale", tiles_of(weight.block_scale, self.TILE))  # (tile, block, row)
        self.bias = bias
        self.activation_dtype = dtype
        self.forms = forms  # only integer_tiles_from counts: bfloat16 tiles would give a row other bits

    def product(self, rows: torch.Tensor, alone: bool = False) -> torch.Tensor:  # every form: each row alone
        y = torch.ops.kvserve.subblock6_product(rows.contiguous(), self.packed, self.scale, self.block_scale,
                                                self.out_features, self.forms.integer_tiles_from)
        return y.to(self.activation_dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The weights of output rows `ids` (n,), as the codes hold them: (n, in) float32 (an embedding's lookup)."""
        tile, row = ids // self.TILE, ids % self.TILE
        per_group = self.packed.view(self.packed.shape[0], -1, 384)  # (tile, group, 256 bytes of low bits + 128 of high)
        low = Codes4Linear.row_codes(per_group[..., :256], tile, row)
        # Row r's input i of a run is run byte 4r + i: byte 4r + i of its plane, runs 2j and 2j + 1 at bits 0 and 4.
        high = per_group[..., 256:].reshape(self.packed.shape[0], -1, 2, 16, 4)[tile, :, :, row]  # (n, group, plane, 4)
        high = torch.stack([high & 15, high >> 4], dim=-2)  # (n, group, run, 4): a run byte's 4 high bits
        high = torch.stack([high & 3, high >> 2], dim=-2).reshape(low.shape)  # (n, in): as `nibbles` orders
        codes = (low | high << 4).float().view(ids.shape[0], -1, SubBlockCodes.SUB_BLOCK) - 32  # (n, sub-block, 16)
        scale = self.block_scale[tile, :, row].float().repeat_interleave(SUPER_BLOCK // SubBlockCodes.SUB_BLOCK, dim=1)
        scale = scale * self.scale[tile, :, row].float()  # d·sc, (n, sub-block)
        return (codes * scale[..., None]).view(ids.shape[0], self.in_features)


class StackedLinear(WeightOnlyLinear):
    """Row-stacked layers of different kinds as one (a Q4_K_M file's q and k in Q4_K above its v in Q6_K): each part's
    kernel on the same input rows, the outputs side by side."""

    def __init__(self, parts: list[WeightOnlyLinear], bias: torch.Tensor | None):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.bias = bias
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.activation_dtype = parts[0].activation_dtype

    def product(self, rows: torch.Tensor, alone: bool = False) -> torch.Tensor:
        return torch.cat([p.product(rows, alone) for p in self.parts], dim=1)  # (tokens, out): the parts' rows in order


def nibbles(runs: torch.Tensor) -> torch.Tensor:
    """(n, group, run, 4) bytes of one row, as Codes4Linear packs them -> (n, in) codes: input 8k + 4·nibble + i."""
    return torch.stack([runs & 15, runs >> 4], dim=-2).reshape(runs.shape[0], -1)  # (n, group, run, nibble, input)


def tiles_of(t: torch.Tensor, tile: int) -> torch.Tensor:
    """(rows, n) -> (tiles, n, tile), contiguous: the rows padded with zeros to whole tiles, each tile's rows last."""
    padded = F.pad(t, (0, 0, 0, -t.shape[0] % tile))
    return padded.view(-1, tile, t.shape[1]).transpose(1, 2).contiguous()


class Int8Linear(WeightOnlyLinear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        weight = weight.detach().float()  # (out, in)
        scale = (weight.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)  # (out,)
        self.register_buffer("codes", torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scale.to(dtype))
        self.bias = bias
        self.out_features, self.in_features = weight.shape
        self.activation_dtype = dtype

    def product(self, rows: torch.Tensor, alone: bool = False) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(rows, self.codes, self.scales)
