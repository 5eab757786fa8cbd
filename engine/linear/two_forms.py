"""A linear layer in two forms, quantized codes for few rows and a dense weight for many, switching where measured.

Torch's weight-only kernels are fastest for a few rows and slower than a dense product for many: they
unpack the codes again for every small block of rows, while a dense product reads its weight once for all
rows. Where the two cross depends on the CPU; the planner (engine/linear/planner.py) gives each TwoForms the
row count measured for this machine (engine/linear/timing.py). Two places have a dense form:
- the LM head of a quantized model with tied embeddings (SmolLM2, Qwen2, Llama 3.2), where its codes cannot
  give the lookups their rows (torch's int4 kernel, int8 rows quantized at load): its dense form is the embedding
  itself, held dense for the lookups anyway, so it costs no memory. Codes that read their rows back serve the
  lookups and the head alone: a dense table beside them would serve only prefill's prompt scoring;
- with `dense_copies`, every quantized layer of the blocks: a bfloat16 copy of its weight, for prefill, at the
  price of that copy's memory (four times int4 codes).
A decode step, at any batch size, takes the codes: a row then gets the same bits whatever runs beside it.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.linear.quantized import WeightOnlyLinear, decoding


class TwoForms(nn.Module):
    def __init__(self, codes: WeightOnlyLinear, dense: nn.Module, dense_from: int | None):
        super().__init__()
        self.codes = codes
        self.dense = dense
        self.dense_from = dense_from  # rows from which the dense form runs; None: never

    @property
    def in_features(self) -> int:
        return self.codes.in_features

    @property
    def out_features(self) -> int:
        return self.codes.out_features

    def form(self, rows: int) -> nn.Module:
        """The form that runs a product of `rows` rows."""
        return self.dense if self.dense_from is not None and rows >= self.dense_from else self.codes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A decode step keeps the codes at any batch size: the dense form rounds otherwise, and a row must get
        # the bits it gets alone (quantized.decoding).
        return (self.codes if decoding(x) else self.form(x.numel() // x.shape[-1]))(x)


@torch.inference_mode()
def dense_weight(layer: WeightOnlyLinear) -> torch.Tensor:
    """The layer's weight (out, in) as its kernel computes with it: the product with the identity, transposed."""
    identity = torch.eye(layer.in_features, dtype=layer.activation_dtype)
    return layer.product(identity).t().contiguous()  # (in, out) -> (out, in)
