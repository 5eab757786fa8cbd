"""Weight-only quantization of the matrix products, for CPU decode.

int4: each group of 32 input weights of an output row keeps 4-bit codes q in [0, 15] and its own
scale and minimum: w ≈ scale·q + min (the layout of GGUF's Q4_1). int8: each output row keeps
8-bit codes in [-127, 127] and one scale. The products are torch's weight-only CPU kernels, which
read a quarter (int4) or half (int8) of bfloat16's bytes. Activations stay in bfloat16. The LM head,
the largest single product of a step, is quantized too, always to int8; the embedding stays dense.
"""

from __future__ import annotations

import torch
from torch import nn

GROUP_SIZE = 32
LEVELS = 15  # 4 bits: codes 0..15


class WeightOnlyLinear(nn.Module):
    """A linear layer whose weight is stored quantized; subclasses hold the codes and run one kernel."""

    bias: torch.Tensor | None
    out_features: int

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        """rows (tokens, in) -> (tokens, out), without the bias."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.product(x.reshape(-1, x.shape[-1]))  # (tokens, in): the kernels take a matrix
        y = y.reshape(*x.shape[:-1], self.out_features)  # (..., out)
        return y if self.bias is None else y + self.bias


class Int4Linear(WeightOnlyLinear):
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

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group_size, self.scales_and_zeros)


class Int8Linear(WeightOnlyLinear):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()  # (out, in)
        scale = (weight.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)  # (out,)
        self.register_buffer("codes", torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scale.to(linear.weight.dtype))
        self.bias = linear.bias
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(rows, self.codes, self.scales)


QUANTIZED = {"int4": Int4Linear, "int8": Int8Linear}


def quantize(model: nn.Module, kind: str) -> nn.Module:
    """Replace every block's q/k/v, output, gate/up and down projections and the LM head, in place."""
    layer = QUANTIZED[kind]
    for block in model.layers:
        block.self_attn.qkv_proj = layer(block.self_attn.qkv_proj)
        block.self_attn.o_proj = layer(block.self_attn.o_proj)
        block.mlp.gate_up_proj = layer(block.mlp.gate_up_proj)
        block.mlp.down_proj = layer(block.mlp.down_proj)
    # int8 whatever `kind`: the LM head picks the token, and 4-bit logits flip greedy answers (the default
    # model's GGUF itself stores this matrix in 8 bits, Q8_0). A copy of its own when tied; the embedding stays dense.
    model.lm_head = Int8Linear(model.lm_head)
    return model
