"""Weight-only quantized products, for CPU decode.

Two layouts (activations stay in bfloat16):
- groups (`GroupCodes`): each group of 32 inputs of an output row keeps unsigned codes, one scale and one
  minimum: w = scale·q + minimum. 4-bit codes are GGUF's Q4_0 and Q4_1 blocks, 8-bit codes Q8_0's
  (shifted by 128). kvserve's own kernels (engine/native) run them where they build, as integer dot products
  with the inputs quantized to 8 bits per group, as llama.cpp computes them (`Codes4Linear`,
  `Codes8Linear`). Elsewhere torch's int4 kernel runs both (`GroupLinear`): an 8-bit code is two 4-bit
  halves, 16·high + low, served as two stacked output rows and summed.
- rows (`Int8Linear`): each output row keeps 8-bit codes in [-127, 127] and one scale (int8pack).

What a layer becomes (`quantized_linear`): codes stored by the checkpoint (a GGUF's blocks) are served
as stored whenever quantization is on; float weights are quantized only when asked: "int4" in groups
(the LM head in int8 rows: 4-bit logits flip greedy answers), "int8" in rows. The embedding stays dense.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.native import kernels_run_on
from engine.product_forms import ProductForms, product_forms

GROUP_SIZE = 32
QUANTIZE_MODES = ("auto", "none", "int4", "int8")


@dataclass(frozen=True)
class GroupCodes:
    """A weight matrix in groups of `group_size` inputs: w[o, i] = scale[o, g]·codes[o, i] + minimum[o, g], g = i // group_size."""

    codes: torch.Tensor  # uint8 (out, in), each in [0, 2**bits)
    scale: torch.Tensor  # float32 (out, in // group_size)
    minimum: torch.Tensor  # float32 (out, in // group_size)
    bits: int

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
    def fit(cls, weight: torch.Tensor, bits: int) -> "GroupCodes":
        """Min/max quantization of float weights (out, in), group by group."""
        out_features, in_features = weight.shape
        if in_features % GROUP_SIZE:
            raise ValueError(f"group quantization needs in_features divisible by {GROUP_SIZE}, got {in_features}")
        groups = weight.detach().float().reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
        low, high = groups.amin(-1), groups.amax(-1)  # (out, groups)
        top = 2**bits - 1
        scale = ((high - low) / top).clamp(min=torch.finfo(torch.float32).tiny)
        codes = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, top)
        return cls(codes.to(torch.uint8).reshape(out_features, in_features), scale, low, bits)

    @classmethod
    def cat(cls, parts: list["GroupCodes | torch.Tensor"]) -> "GroupCodes":
        """The parts' rows one after another (q, k, v -> qkv), in the widest part's bits.

        A 4-bit part is exact in 8 bits (same codes, scale and minimum); a float part is fitted.
        """
        bits = max(p.bits for p in parts if isinstance(p, GroupCodes))
        parts = [p if isinstance(p, GroupCodes) else cls.fit(p, bits) for p in parts]
        return cls(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                   torch.cat([p.minimum for p in parts]), bits)

    def map_rows(self, reorder) -> "GroupCodes":
        """The same matrix with its rows reordered by `reorder` (a function of a (rows, ...) tensor)."""
        return GroupCodes(reorder(self.codes), reorder(self.scale), reorder(self.minimum), self.bits)

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

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        """rows (tokens, in) -> (tokens, out), without the bias."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.product(x.reshape(-1, x.shape[-1]))  # (tokens, in): the kernels take a matrix
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

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP_SIZE, self.scales_and_zeros)
        if self.halves == 1:
            return y
        return y.view(-1, self.halves, self.out_features).sum(1)  # (tokens, 2, out): high and low halves -> (tokens, out)


class GroupTiles(WeightOnlyLinear):
    """Group codes through one of kvserve's kernels (engine/native), in tiles of 16 output rows.

    The rows are padded to whole tiles with zero codes and scales; the kernel returns only `out_features`.
    Scales and minimums are float16, as GGUF stores them (exact for its blocks).
    """

    TILE = 16  # output rows per tile
    bits: int

    def __init__(self, weight: GroupCodes, bias: torch.Tensor | None, dtype: torch.dtype = torch.bfloat16,
                 forms: ProductForms | None = None):
        super().__init__()
        if weight.bits != self.bits:
            raise ValueError(f"{type(self).__name__} serves {self.bits}-bit codes, got {weight.bits}-bit ones")
        self.out_features, self.in_features = weight.shape
        pad = -self.out_features % self.TILE
        codes, scale, minimum = (F.pad(t, (0, 0, 0, pad)) for t in (weight.codes, weight.scale, weight.minimum))
        tiles, groups = codes.shape[0] // self.TILE, self.in_features // GROUP_SIZE
        self.register_buffer("packed", self.pack(codes.view(tiles, self.TILE, groups, GROUP_SIZE)).reshape(tiles, -1))
        per_tile = lambda t: t.view(tiles, self.TILE, groups).transpose(1, 2).contiguous().to(torch.float16)  # (tile, group, row)
        self.register_buffer("scale", per_tile(scale))
        self.register_buffer("minimum", per_tile(minimum))
        self.bias = bias
        self.activation_dtype = dtype
        self.forms = forms or product_forms()  # the kernel's form by input rows: by default as measured for this CPU

    @staticmethod
    def pack(codes: torch.Tensor) -> torch.Tensor:
        """codes (tile, row, group, 32) -> the kernel's bytes (tile, group, ...)."""
        raise NotImplementedError

    @property
    def kernel(self):
        """The torch op for these codes, kvserve::codes{bits}_product (registered by engine.native.load_kernels)."""
        return getattr(torch.ops.kvserve, f"codes{self.bits}_product")

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        y = self.kernel(rows.contiguous(), self.packed, self.scale, self.minimum, self.out_features,
                        self.forms.integer_tiles_from, self.forms.bfloat16_tiles_from)
        return y.to(self.activation_dtype)


class Codes4Linear(GroupTiles):
    """4-bit codes (Q4_0, Q4_1): integer dot products with the inputs quantized to 8 bits per group, the codes
    centred on 8 (engine/native/codes4_product.cpp)."""

    bits = 4

    @staticmethod
    def pack(codes: torch.Tensor) -> torch.Tensor:
        tiles, rows, groups, _ = codes.shape
        q = codes.view(tiles, rows, groups, 4, 2, 4)  # (tile, row, group, run k, nibble, input 8k + 4·nibble + i)
        q = q.permute(0, 2, 3, 1, 5, 4)  # (tile, group, run, row, input, nibble): the kernel's byte order
        return (q[..., 0] | q[..., 1] << 4).contiguous()


class Codes8Linear(GroupTiles):
    """8-bit codes (Q8_0): integer dot products with the inputs quantized to 8 bits per group, the codes centred
    on 128 (engine/native/codes8_product.cpp)."""

    bits = 8

    @staticmethod
    def pack(codes: torch.Tensor) -> torch.Tensor:
        tiles, rows, groups, _ = codes.shape
        q = codes.view(tiles, rows, groups, 8, 4)  # (tile, row, group, run k, input 4k + i)
        return q.permute(0, 2, 3, 1, 4).contiguous()  # (tile, group, run, row, input): the kernel's byte order


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

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(rows, self.codes, self.scales)


def quantized_linear(weight: torch.Tensor | GroupCodes, bias: torch.Tensor | None, mode: str, head: bool,
                     dtype: torch.dtype = torch.bfloat16) -> WeightOnlyLinear | None:
    """The module that serves one linear layer in `mode` (auto/int4/int8; "none" is resolved before), or None: dense."""
    bias = None if bias is None else bias.to(dtype)
    if isinstance(weight, GroupCodes):
        kind = group_layer(weight.bits, weight.codes.device)
        return kind(weight, bias, torch.float32 if head and kind is not GroupLinear else dtype)  # logits are float32
    if mode == "int8" or (mode == "int4" and head):
        return Int8Linear(weight, bias, dtype)
    if mode == "int4":
        return quantized_linear(GroupCodes.fit(weight, 4), bias, mode, head, dtype)
    return None  # auto: float weights stay dense


def group_layer(bits: int, device: torch.device) -> type[WeightOnlyLinear]:
    """The layer that serves group codes of `bits` on `device`: kvserve's kernels where they build, else torch's."""
    if kernels_run_on(device):
        return Codes8Linear if bits == 8 else Codes4Linear
    return GroupLinear


def weights_bytes(model: nn.Module) -> int:
    """The bytes of every parameter and buffer, each tensor once (tied weights share one)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())
