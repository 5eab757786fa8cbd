"""Few-row float32 products on the CPU, computed as W·xᵀ instead of x·Wᵀ.

A decode step multiplies a few rows (one per sequence) by every weight matrix. With MKL on an
AVX2 CPU, x·Wᵀ for 1-128 rows lands on kernels that read the weights at 5-7 GB/s; the same
product with the weight as the left operand runs MKL's large-N GEMM and reads them 1.2-2.5x
faster (bench/README.md has the figures). One row goes in as two identical rows: one column is
MKL's slow GEMV path. Above `max_rows` (a long prefill) x·Wᵀ is the faster order again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 128  # measured crossover on this project's CPU: W·xᵀ wins up to 128 rows, loses from 256


class WeightLeftLinear(nn.Module):
    """The same weight and bias as the nn.Linear it replaces (same names, so the same state dict)."""

    def __init__(self, linear: nn.Linear, max_rows: int = MAX_ROWS):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.max_rows = max_rows

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # (m, in)
        m = rows.shape[0]
        if m > self.max_rows:
            return F.linear(x, self.weight, self.bias)
        if m == 1:
            rows = rows.expand(2, -1).contiguous()  # (2, in): a real two-row matrix, so MKL takes GEMM, not GEMV
        out = (self.weight @ rows.t()).t()[:m].contiguous()  # (out, m) -> (m, out)
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], out.shape[-1])  # (..., out)


def use_weight_left_products(model: nn.Module) -> nn.Module:
    """Every block projection and the LM head become WeightLeftLinear, in place (tied weights stay tied)."""
    for block in model.layers:
        attention, mlp = block.self_attn, block.mlp
        attention.qkv_proj, attention.o_proj = WeightLeftLinear(attention.qkv_proj), WeightLeftLinear(attention.o_proj)
        mlp.gate_up_proj, mlp.down_proj = WeightLeftLinear(mlp.gate_up_proj), WeightLeftLinear(mlp.down_proj)
    model.lm_head = WeightLeftLinear(model.lm_head)
    return model
