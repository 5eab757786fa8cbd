"""Runs the decode forward: eagerly, or through a graph compiled by torch.compile once one is ready.

Two graphs serve every decode step: one for a single sequence and one for any larger batch (torch
specializes size 1, so a batch of one is a graph of its own). In both, the batch size and the keys
read per row (the filled length, not T) are dynamic dimensions, so decode cost still follows what the
slots hold and no batch is padded.

Compiling takes from seconds (a tiny model) to minutes (30 layers on 2 cores). `compile()` does it on a
scratch cache of the same layout but a few positions, never on the live one, so it may run on a thread
of its own while the engine keeps decoding eagerly; each graph is used from the first step after it is
ready. Inductor's FX graph cache keeps the generated code on disk, so a restart compiles again
quickly (where the cache lives is the process's setting, TORCHINDUCTOR_CACHE_DIR).
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass

import torch

from engine.batch import DecodeBatch
from engine.kv_cache import KVCache
from engine.model import Transformer
from engine.rope import RotaryTable

log = logging.getLogger("kvserve.executor")

COMPILE_MODES = ("auto", "on", "off")


def compile_unsupported(device: torch.device) -> str | None:
    """Why a compiled decode step cannot run here, or None when it can."""
    if device.type != "cpu":
        return f"compiled decode is implemented for the CPU only so far, not {device.type}"
    from torch._inductor import config as inductor_config

    compiler = inductor_config.cpp.cxx[-1] or "g++"
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}) for inductor"
    return None


@dataclass(frozen=True)
class LayerEntries:
    """K (kind 0) or V (kind 1) of one layer, as a place in the whole cache tensor rather than a view of it.

    A compiled graph that writes into a view of its input rebuilds the whole input around the view
    (a copy of the entire cache, every layer, every step); writing into the input itself with one
    index_put_ stays in place.
    """

    data: torch.Tensor  # (2, L, B, h_kv, T, d)
    kind: int
    layer: int


class CacheLayers:
    """What Transformer.forward reads of a cache, over any tensor of KVCache's layout (2, L, B, h_kv, T, d)."""

    def __init__(self, data: torch.Tensor):
        self.data = data

    def layer(self, index: int) -> tuple[LayerEntries, LayerEntries]:
        return LayerEntries(self.data, 0, index), LayerEntries(self.data, 1, index)


@dataclass
class GraphDecodeBatch:
    """DecodeBatch as tensors alone, for a compiled step: b and kv_len are shapes, not Python numbers.

    Row r writes its new K/V at positions[r] of slot slot_index[r] and reads keys 0..positions[r];
    mask (b, 1, 1, kv_len) hides the keys past each row's own, which are stale or empty.
    """

    slot_index: torch.Tensor  # (b,)
    positions: torch.Tensor  # (b, 1)
    mask: torch.Tensor  # (b, 1, 1, kv_len) bool

    def store(self, keys: LayerEntries, values: LayerEntries, k: torch.Tensor, v: torch.Tensor):
        """Write k, v (b, h_kv, 1, d); return the rows' first kv_len positions (b, h_kv, kv_len, d)."""
        return self._write(keys, k), self._write(values, v)

    def _write(self, entries: LayerEntries, new: torch.Tensor) -> torch.Tensor:
        """Store one step's K or V of every row, then read each row's slot up to kv_len."""
        data, rows = entries.data, self.slot_index[:, None]  # rows (b, 1)
        heads = torch.arange(data.shape[3], device=data.device)[None, :]  # (1, h_kv)
        # Every index a tensor, broadcast to (b, h_kv): one index_put_ on the cache tensor itself.
        index = (torch.full_like(rows, entries.kind), torch.full_like(rows, entries.layer), rows, heads, self.positions)
        data.index_put_(index, new[:, :, 0])  # new (b, h_kv, 1, d) -> (b, h_kv, d) at each (slot, head, position)
        return data[entries.kind, entries.layer, :, :, : self.mask.shape[-1]][self.slot_index]


class DecodeExecutor:
    def __init__(self, model: Transformer, rotary: RotaryTable, cache: KVCache):
        self.model, self.rotary, self.cache = model, rotary, cache
        self.graphs: dict[str, object] = {}  # "one" / "many" -> compiled step, filled as each is ready

    @staticmethod
    def bucket(batch_size: int) -> str:
        return "one" if batch_size == 1 else "many"

    def forward(self, tokens: list[int], slots: list[int], lengths: list[int]) -> torch.Tensor:
        """One new token per slot at its length -> next-token logits (b, V) float32."""
        device = self.cache.data.device
        token_ids = torch.tensor(tokens, device=device)[:, None]  # (b, 1)
        graph = self.graphs.get(self.bucket(len(tokens)))
        if graph is None:
            batch = DecodeBatch(slots, lengths, device)
            return self.model.logits(self.model(token_ids, self.rotary, self.cache, batch)[:, 0])
        positions = torch.tensor(lengths, device=device)[:, None]  # (b, 1)
        mask = torch.arange(max(lengths) + 1, device=device) <= positions  # (b, kv_len): keys up to its own
        return graph(token_ids, torch.tensor(slots, device=device), positions, mask[:, None, None, :],
                     self.cache.data)

    def step(self, tokens: torch.Tensor, slot_index: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
             cache_data: torch.Tensor) -> torch.Tensor:
        """The function that is compiled: the decode forward and the LM head, tensors in, logits out."""
        batch = GraphDecodeBatch(slot_index, positions, mask)
        hidden = self.model(tokens, self.rotary, CacheLayers(cache_data), batch)  # (b, 1, hidden)
        return self.model.logits(hidden[:, 0])

    @torch.inference_mode()
    def compile(self) -> None:
        """Compile both graphs (blocking), each on a scratch cache; the live cache is never touched."""
        compiled = torch.compile(self.step)
        data = self.cache.data
        # Sizes that differ from each other and from 0/1, so that torch keeps every dimension symbolic;
        # one slot stays one (torch specializes size 1, and the live cache would not match a symbol).
        scratch_slots, scratch_len = (3 if data.shape[2] > 1 else 1), 7
        with torch.inference_mode(False):  # made as the live cache is, so the graph's guards match it
            scratch = torch.zeros(*data.shape[:2], scratch_slots, data.shape[3], scratch_len, data.shape[5],
                                  dtype=data.dtype, device=data.device)
        for name, batch_size in (("one", 1), ("many", 2)):
            started = time.perf_counter()
            tokens = torch.zeros(batch_size, 1, dtype=torch.long, device=data.device)
            slot_index = torch.arange(batch_size, device=data.device)
            positions = torch.full((batch_size, 1), 4, device=data.device)
            mask = torch.ones(batch_size, 1, 1, 5, dtype=torch.bool, device=data.device)
            batch_dim = [0] if batch_size > 1 else []
            for tensor, dims in ((tokens, batch_dim), (slot_index, batch_dim), (positions, batch_dim),
                                 (mask, batch_dim + [3]), (scratch, [4] + [2] * (scratch_slots > 1))):
                for dim in dims:
                    torch._dynamo.mark_dynamic(tensor, dim)
            compiled(tokens, slot_index, positions, mask, scratch)
            self.graphs[name] = compiled
            log.info("compiled decode step for %s in %.1f s", "batch 1" if name == "one" else "batches of 2 or more",
                     time.perf_counter() - started)
