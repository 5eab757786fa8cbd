"""Weight-only int4 quantization of the block projections, for CPU decode.

Each group of 32 input weights of an output row keeps 4-bit codes q in [0, 15] and its own scale
and minimum: w ≈ scale·q + min (the layout of GGUF's Q4_1, so the default model's weights come back
as they were stored). The matmul is torch's int4 CPU kernel, which reads a quarter of bfloat16's bytes.
Activations stay in the model dtype; the LM head and the embedding stay dense.
"""

from __future__ import annotations

import torch
from torch import nn

GROUP_SIZE = 32
LEVELS = 15  # 4 bits: codes 0..15


class Int4Linear(nn.Module):
    def __init__(self, linear: nn.Linear, group_size: int = GROUP_SIZE):
        super().__init__()
        out_features, in_features = linear.weight.shape
        if in_features % group_size:
            raise ValueError(f"int4 needs in_features divisible by {group_size}, got {in_features}")
        groups = linear.weight.detach().float().reshape(out_features, in_features // group_size, group_size)
        low, high = groups.amin(-1), groups.amax(-1)  # (out, groups)
        scale = ((high - low) / LEVELS).clamp(min=torch.finfo(torch.float32).tiny)
        codes = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, LEVELS)
        codes = codes.to(torch.int32).reshape(out_features, in_features)
        # The kernel computes (q - 8)·scale + zero, so zero = min + 8·scale gives scale·q + min.
        scales_and_zeros = torch.stack([scale, low + 8 * scale], dim=-1).transpose(0, 1)  # (groups, out, 2)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2))
        self.register_buffer("scales_and_zeros", scales_and_zeros.contiguous().to(linear.weight.dtype))
        self.bias = linear.bias
        self.group_size = group_size
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # (tokens, in): the kernel takes a matrix
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group_size, self.scales_and_zeros)
        y = y.reshape(*x.shape[:-1], self.out_features)  # (..., out)
        return y if self.bias is None else y + self.bias


def quantize_int4(model: nn.Module) -> nn.Module:
    """Replace every block's q/k/v, output, gate/up and down projections with Int4Linear, in place."""
    for block in model.layers:
        block.self_attn.qkv_proj = Int4Linear(block.self_attn.qkv_proj)
        block.self_attn.o_proj = Int4Linear(block.self_attn.o_proj)
        block.mlp.gate_up_proj = Int4Linear(block.mlp.gate_up_proj)
        block.mlp.down_proj = Int4Linear(block.mlp.down_proj)
    return model
