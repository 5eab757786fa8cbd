"""A bfloat16 linear layer whose weight oneDNN prepacked at load, for CPUs where oneDNN computes in bfloat16.

oneDNN's product over a weight reordered once into its blocked layout streams the weight faster than
`F.linear` over the plain one, at every row count measured (bench/README.md has the figures per machine).
The packed weight is an opaque tensor (no strides): inductor cannot lower oneDNN's own op over it as a
graph input, so the product is a custom op, which a compiled graph calls as it is.
"""

from __future__ import annotations

import torch
from torch import nn


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
