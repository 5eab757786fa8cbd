"""A linear layer in two forms, quantized codes for few rows and a dense weight for many, switching where measured.

Torch's weight-only kernels are fastest for a few rows and slower than a dense product for many: they
unpack the codes again for every small block of rows, while a dense product reads its weight once for all
rows. Where the two cross depends on the CPU, so it is measured at load, for the row counts the engine
runs; the layer then takes the codes below that many rows and the dense weight from it on.

Two places have a dense form:
- the LM head of a quantized model with tied embeddings (SmolLM2, Qwen2, Llama 3.2): its dense form is
  the embedding itself, which stays dense for row lookups, so it costs no memory;
- with `dense_copies`, every quantized layer of the blocks: a bfloat16 copy of its weight, for prefill
  and large batches, at the price of that copy's memory (four times int4 codes); the tied head's dense
  form is then a copy too, prepacked where oneDNN computes in bfloat16 (the figures per machine are in
  bench/README.md).
"""

from __future__ import annotations

import logging
import statistics

import torch
from torch import nn

from engine.cpu_linear import CpuLinear, dense_linear
from engine.device import cpu_has_native_bf16
from engine.packed_linear import PackedLinear, packs_bfloat16
from engine.product_forms import call_seconds
from engine.quantization import WeightOnlyLinear

log = logging.getLogger("kvserve.two_forms")

TIMED_CALLS = 3  # per form and row count, after one warm-up call; the median is kept


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
        return self.form(x.numel() // x.shape[-1])(x)


def tie_quantized_head(model: nn.Module, max_rows: int, copy: bool = False) -> None:
    """On the CPU, a tied model whose head is codes gets TwoForms with the embedding, in place.

    copy: where oneDNN computes in bfloat16, the dense form is the embedding prepacked (a copy, as the blocks'
    dense copies are) rather than the embedding itself, which costs no memory but streams slower; kept only
    if it runs at some row count.
    """
    head, embedding = model.lm_head, model.embed_tokens.weight
    if not (model.config.tie_word_embeddings and isinstance(head, WeightOnlyLinear) and embedding.device.type == "cpu"):
        return
    widen = not cpu_has_native_bf16()
    dense = dense_linear(embedding, head.bias, widen, pack_bfloat16=copy and packs_bfloat16())  # packing copies
    timings = {rows: (seconds([head], rows), seconds([dense], rows)) for rows in row_counts(max_rows)}
    switch = dense_from(timings)
    packed = isinstance(dense, PackedLinear)
    if switch is None and packed:  # a copy that never runs would only take memory
        dense = CpuLinear(embedding, head.bias, widen)
    model.lm_head = TwoForms(head, dense, switch)
    dense_name = "packed embedding" if packed else "embedding"
    where = f"codes below {switch} rows, the {dense_name} from there" if switch else "codes at every row count"
    log.info("LM head: %s (ms codes/%s by rows: %s)", where, dense_name, described(timings))


def keep_dense_copies(model: nn.Module, max_rows: int) -> None:
    """Every quantized layer of the blocks gets TwoForms with a dense copy of its weight, in place, where the
    copies measured faster from some row count on.

    One switch for all of them: the blocks repeat the same shapes, so the first block's layers are timed
    together and the count found there holds for every block.
    """
    first = [child for block, _, _, child in quantized_layers(model) if block == 0]
    if not first:
        return
    copies = [dense_copy(layer) for layer in first]
    timings = {rows: (seconds(first, rows), seconds(copies, rows)) for rows in row_counts(max_rows)}
    switch = dense_from(timings)
    if switch is None:  # a copy that never runs would only take memory
        log.info("no dense copies: the codes were faster at every row count (ms codes/dense of one block by rows: %s)",
                 described(timings))
        return
    attach_dense_copies(model, switch, made=dict(zip(map(id, first), copies)))
    log.info("dense copies of the quantized layers: codes below %d rows, the copies from there "
             "(ms codes/dense of one block by rows: %s)", switch, described(timings))


def attach_dense_copies(model: nn.Module, dense_from: int, made: dict[int, nn.Module] | None = None) -> None:
    """Every quantized layer of the blocks becomes TwoForms with a dense copy, switching at `dense_from` rows.

    made: copies already made, by id of their layer (the first block's, timed), reused rather than made again.
    """
    made = made or {}
    for _, parent, name, child in quantized_layers(model):
        copy = made[id(child)] if id(child) in made else dense_copy(child)
        setattr(parent, name, TwoForms(child, copy, dense_from))


def quantized_layers(model: nn.Module) -> list[tuple[int, nn.Module, str, WeightOnlyLinear]]:
    """(block index, parent module, attribute name, layer) of every quantized layer in the blocks."""
    return [(block, parent, name, child) for block, layer in enumerate(model.layers) for parent in layer.modules()
            for name, child in parent.named_children() if isinstance(child, WeightOnlyLinear)]


def dense_copy(layer: WeightOnlyLinear) -> nn.Module:
    return dense_linear(nn.Parameter(dense_weight(layer), requires_grad=False), layer.bias,
                        widen_bfloat16=not cpu_has_native_bf16(), pack_bfloat16=packs_bfloat16())


@torch.inference_mode()
def dense_weight(layer: WeightOnlyLinear) -> torch.Tensor:
    """The layer's weight (out, in) as its kernel computes with it: the product with the identity, transposed."""
    identity = torch.eye(layer.in_features, dtype=layer.activation_dtype)
    return layer.product(identity).t().contiguous()  # (in, out) -> (out, in)


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


def described(timings: dict[int, tuple[float, float]]) -> str:
    return ", ".join(f"{rows}: {c * 1e3:.1f}/{d * 1e3:.1f}" for rows, (c, d) in timings.items())


@torch.inference_mode()
def seconds(layers: list[nn.Module], rows: int) -> float:
    """The median time of one product of `rows` rows through each of the layers in turn."""
    inputs = [torch.randn(rows, layer.in_features, dtype=layer.activation_dtype) for layer in layers]

    def run() -> None:
        for layer, x in zip(layers, inputs):
            layer(x)

    return statistics.median(call_seconds(run, TIMED_CALLS))


