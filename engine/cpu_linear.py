"""Linear layers on the CPU, each product in the order and dtype that torch's CPU kernels run fastest.

Two forms, from measurements of the default model's layers (bench/README.md has the tables per machine):
- float32, up to 128 rows (every decode step): W·xᵀ rather than x·Wᵀ, one row sent as two. MKL's
  large-N GEMM then reads the weights faster than its GEMV and small-M kernels (1.2-2.5x on AVX2,
  about 2x on AVX-512). Weights under 2^17 elements stay with x·Wᵀ: there the GEMM's fixed cost
  outweighs the faster read.
- bfloat16 on a CPU without bf16 arithmetic, over 64 rows (prefill): torch's emulated bf16 GEMM is
  compute-bound, so the weight is widened to float32 for the product; from about 64 rows the
  conversion costs less than it saves (4x faster at 512 rows). Fewer rows stay in bfloat16, whose
  kernel reads half the bytes.
Everything else is F.linear. Parameters keep nn.Linear's names, so the state dict is unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.device import cpu_has_native_bf16
from engine.packed_linear import PackedLinear, packs_bfloat16

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


def use_fastest_products(model: nn.Module) -> nn.Module:
    """The model as an engine runs it: on the CPU its linear layers become CpuLinear or PackedLinear; elsewhere
    unchanged."""
    if model.embed_tokens.weight.device.type == "cpu":
        use_cpu_products(model, widen_bfloat16=not cpu_has_native_bf16(), pack_bfloat16=packs_bfloat16())
    return model


def use_cpu_products(model: nn.Module, widen_bfloat16: bool, pack_bfloat16: bool) -> nn.Module:
    """Every dense nn.Linear of the model becomes a dense_linear, in place; a tied LM head stays tied (a CpuLinear
    on the embedding itself: packing would copy it).

    Idempotent, and other kinds of layers (int4) are left as they are.
    """
    embedding = model.embed_tokens.weight
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                pack = pack_bfloat16 and child.weight is not embedding
                setattr(parent, name, dense_linear(child.weight, child.bias, widen_bfloat16, pack))
    return model


def dense_linear(weight: torch.Tensor, bias: torch.Tensor | None, widen_bfloat16: bool,
                 pack_bfloat16: bool) -> nn.Module:
    """The fastest dense form of a weight here: bfloat16 prepacked by oneDNN where it computes in bfloat16, else
    CpuLinear."""
    if pack_bfloat16 and weight.dtype == torch.bfloat16:
        return PackedLinear(weight, bias)
    return CpuLinear(weight, bias, widen_bfloat16)
