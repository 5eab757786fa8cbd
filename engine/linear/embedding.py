"""The token embedding read from quantized codes: the table held once, as the file stores it.

A GGUF file of a tied model (SmolLM2, Llama 3.2, Gemma 3) holds one quantized table, `token_embd`, for both the
embedding and the head. The head multiplies its codes; the embedding looks rows up. A dense copy for the lookups
would cost the table again in bfloat16 (Gemma 3 270M: 335 MB beside the head's 178 MB of Q8_0), so the lookup
dequantizes the rows it needs from the head's own tiles, to the values the dense table would hold. An untied
file's quantized table (Mistral, Llama 3 8B) is read the same way from a codes layer of its own.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.linear.quantized import GroupTiles, SubBlock6Linear, SuperBlockLinear

ROW_READABLE = (GroupTiles, SuperBlockLinear, SubBlock6Linear)  # the layers whose `rows` read their codes back


class CodesEmbedding(nn.Module):
    def __init__(self, codes: GroupTiles | SuperBlockLinear | SubBlock6Linear, dtype: torch.dtype):
        super().__init__()
        if not isinstance(codes, ROW_READABLE):
            raise TypeError(f"{type(codes).__name__} cannot read its rows back")
        self.codes = codes  # the tied head's layer itself (also model.lm_head), or the table's own: held once
        self.dtype = dtype  # the dense table's dtype, which the blocks compute in

    @property
    def num_embeddings(self) -> int:
        return self.codes.out_features

    @property
    def embedding_dim(self) -> int:
        return self.codes.in_features

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (...) -> (..., hidden): each token's row, dequantized in float32 and rounded to the dtype once."""
        rows = self.codes.rows(tokens.reshape(-1))  # (n, hidden) float32
        return rows.to(self.dtype).view(*tokens.shape, self.embedding_dim)  # (..., hidden)
