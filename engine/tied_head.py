"""An LM head stored as codes whose weight is also the model's dense embedding: two forms for no extra memory.

A quantized model with tied embeddings (SmolLM2, Qwen2, Llama 3.2) keeps the embedding dense, for row
lookups, and its head as codes, for products. Torch's weight-only kernels are fastest for a few rows and
slower than a dense product for many: they unpack the codes again for every small block of rows, while a
dense product reads its weight once for all rows. Where the two cross depends on the CPU, so it is
measured at load, on this head, for the batch sizes the engine can run; the head then takes the codes
below that many rows and the dense weight from it on.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch
from torch import nn

from engine.cpu_linear import CpuLinear
from engine.device import cpu_has_native_bf16
from engine.quantization import WeightOnlyLinear

log = logging.getLogger("kvserve.tied_head")

TIMED_CALLS = 3  # per form and row count, after one warm-up call; the median is kept


class TiedHead(nn.Module):
    def __init__(self, codes: WeightOnlyLinear, dense: nn.Module, dense_from: int | None):
        super().__init__()
        self.codes = codes
        self.dense = dense
        self.dense_from = dense_from  # rows from which the dense form runs; None: never

    @property
    def out_features(self) -> int:
        return self.codes.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if self.dense_from is not None and rows >= self.dense_from:
            return self.dense(x)
        return self.codes(x)


def tie_quantized_head(model: nn.Module, max_rows: int) -> None:
    """On the CPU, a tied model whose head is codes gets a TiedHead, in place, switching where measured faster."""
    head, embedding = model.lm_head, model.embed_tokens.weight
    if not (model.config.tie_word_embeddings and isinstance(head, WeightOnlyLinear) and embedding.device.type == "cpu"):
        return
    dense = CpuLinear(embedding, head.bias, widen_bfloat16=not cpu_has_native_bf16())
    timings = {rows: (seconds(head, rows, embedding.dtype), seconds(dense, rows, embedding.dtype))
               for rows in row_counts(max_rows)}
    model.lm_head = TiedHead(head, dense, dense_from(timings))
    log.info("LM head: codes below %s rows, the dense embedding from there (ms codes/dense by rows: %s)",
             model.lm_head.dense_from or "any number of",
             ", ".join(f"{rows}: {c * 1e3:.1f}/{d * 1e3:.1f}" for rows, (c, d) in timings.items()))


def row_counts(max_rows: int) -> list[int]:
    """Powers of two below max_rows, and max_rows."""
    return sorted({1 << i for i in range(max_rows.bit_length()) if 1 << i < max_rows} | {max_rows})


def dense_from(timings: dict[int, tuple[float, float]]) -> int | None:
    """The fewest measured rows from which the dense form (second) was faster at every larger count, or None."""
    start = None
    for rows in sorted(timings, reverse=True):
        codes, dense = timings[rows]
        if dense >= codes:
            break
        start = rows
    return start


@torch.inference_mode()
def seconds(layer: nn.Module, rows: int, dtype: torch.dtype) -> float:
    x = torch.randn(rows, layer.in_features, dtype=dtype)
    layer(x)
    calls = []
    for _ in range(TIMED_CALLS):
        started = time.perf_counter()
        layer(x)
        calls.append(time.perf_counter() - started)
    return statistics.median(calls)
