"""Dense linear layers on the CPU, each product in the order and dtype that torch's or oneDNN's kernels run fastest.

CpuLinear, two forms, from measurements of the default model's layers (bench/README.md has the tables per machine):
- float32, up to 128 rows (every decode step): W·xᵀ rather than x·Wᵀ, one row sent as two. MKL's
  large-N GEMM then reads the weights faster than its GEMV and small-M kernels (1.2-2.5x on AVX2,
  about 2x on AVX-512). Weights under 2^17 elements stay with x·Wᵀ: there the GEMM's fixed cost
  outweighs the faster read.
- bfloat16 on a CPU without bf16 arithmetic, over 64 rows (prefill): torch's emulated bf16 GEMM is
  compute-bound, so the weight is widened to float32 for the product; from about 64 rows the
  conversion costs less than it saves (4x faster at 512 rows). Fewer rows stay in bfloat16, whose
  kernel reads half the bytes.
Everything else is F.linear. Parameters keep nn.Linear's names, so the state dict is unchanged.

PackedLinear: a bfloat16 weight that oneDNN prepacked at load, for CPUs where oneDNN computes in bfloat16.
oneDNN's product over a weight reordered once into its blocked layout streams the weight faster than
`F.linear` over the plain one, at every row count measured (bench/README.md has the figures per machine).
The packed weight is an opaque tensor (no strides): inductor cannot lower oneDNN's own op over it as a
graph input, so the product is a custom op, which a compiled graph calls as it is.

Which of them serves a matrix is the planner's decision (engine/linear/planner.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


WEIGHT_LEFT_MAX_ROWS = 128  # float32: W·xᵀ wins up to 128 rows here, x·Wᵀ from 256
WEIGHT_LEFT_MIN_ELEMENTS = 1 << 17  # and from weights of 512 x 256: at 128 x 64, one row took 38 us vs 15
WIDEN_MIN_ROWS = 64  # bfloat16 without native support: widening to float32 wins from here


class CpuLinear(nn.Module):
    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, widen_bfloat16: bool):
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.widen_bfloat16 = widen_bfloat16

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def activation_dtype(self) -> torch.dtype:
        return self.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, m = self.weight, x.numel() // x.shape[-1]  # m rows of in features
        if weight.dtype == torch.float32 and weight.numel() >= WEIGHT_LEFT_MIN_ELEMENTS:
            out = float32_product(x.reshape(m, -1), weight)
        elif self.widen_bfloat16 and weight.dtype == torch.bfloat16 and m >= WIDEN_MIN_ROWS:
            out = float32_product(x.reshape(m, -1).float(), weight.float()).to(x.dtype)
        else:
            return F.linear(x, weight, self.bias)
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], out.shape[-1])  # (..., out)


def float32_product(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """rows (m, in) · weightᵀ -> (m, out), contiguous, in MKL's fastest order for m."""
    m = rows.shape[0]
    if m > WEIGHT_LEFT_MAX_ROWS:
        return rows @ weight.t()
    if m == 1:
        rows = rows.expand(2, -1).contiguous()  # (2, in): a real two-row matrix, so MKL takes GEMM, not GEMV
    return (weight @ rows.t()).t()[:m].contiguous()  # (out, m) -> (m, out)


@torch.library.custom_op("kvserve::packed_product", mutates_args=())
def packed_product(rows: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """rows (m, in) bfloat16 · the packed weight (out, in)ᵀ -> (m, out)."""
    return torch.ops.mkldnn._linear_pointwise(rows, packed, None, "none", [], "")


@packed_product.register_fake
def _(rows: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], out_features)


def packs_bfloat16() -> bool:
    """Whether oneDNN computes bfloat16 products natively on this CPU (read once, when a model loads)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PackedLinear(nn.Module):
    activation_dtype = torch.bfloat16

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        if weight.dtype != torch.bfloat16:
            raise ValueError(f"PackedLinear packs bfloat16 weights, got {weight.dtype}")
        with torch.no_grad():
            self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1))
        self.bias = bias
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # (tokens, in)
        if torch.compiler.is_compiling():  # the custom op: one opaque call in the graph
            y = packed_product(rows, self.packed, self.out_features)
        else:  # eager: oneDNN's op itself, without the custom op's Python dispatch on every call
            y = torch.ops.mkldnn._linear_pointwise(rows, self.packed, None, "none", [], "")
        y = y.view(*x.shape[:-1], self.out_features)  # (..., out)
        return y if self.bias is None else y + self.bias
