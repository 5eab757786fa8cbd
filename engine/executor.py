"""Runs the decode forward: eagerly, or through a graph compiled by torch.compile once one is ready.

A few graphs serve every decode step, each for a range of batch sizes (a bucket): one for a single
sequence (torch specializes size 1, so a batch of one is a graph of its own) and one for any larger
batch. In every graph the batch size and the keys read per row (the filled length, not T) are dynamic
dimensions, so decode cost still follows what the slots hold and no batch is padded. A row's logits are the
same bits eager and in either graph, at every batch size: the layers take no form that depends on the rows
beside it (quantized.decoding), and the norms and attention are kvserve's kernels, which compute each row alone.

Compiling takes from seconds (a tiny model) to minutes (30 layers on 2 cores). `compile()` does it on a
scratch cache of the same layout but a few positions, never on the live one, so it may run on a thread
of its own while the engine keeps decoding eagerly; each graph is used from the first step after it is
ready. Inductor's FX graph cache keeps the generated code on disk, so a restart compiles again
quickly (where the cache lives is the process's setting, TORCHINDUCTOR_CACHE_DIR).

On CUDA the step is not compiled but captured: CUDA graphs of the eager step, padded to a few batch sizes and key
lengths (engine/captured_steps.py).
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass
from typing import Callable

import torch

from engine.models.attention import broadcast_attention, grouped_attention
from engine.batch import DecodeBatch
from engine.captured_steps import CapturedSteps
from engine.heap import release_freed_memory
from engine.kv_cache import KVCache, LayerCache, ring_readable
from engine.models.model import Transformer
from engine.linear.native import kernels_run_on
from engine.rope import RotaryTable

log = logging.getLogger("kvserve.executor")

# The CPU's steps: auto and aot compiled ahead of time into packages, loaded without the compiler (engine/aot_steps.py;
# torch.compile where a model's step cannot be one program); on: torch.compile, inductor in this process. CUDA:
# captured graphs for all three. off: eager.
COMPILE_MODES = ("auto", "on", "off", "aot")


def compile_unsupported(device: torch.device) -> str | None:
    """Why a compiled decode step (CPU) or captured one (CUDA) cannot run here, or None when it can."""
    if device.type == "cuda":
        return None
    if device.type != "cpu":
        return f"compiled decode is implemented for the CPU and CUDA only, not {device.type}"
    compiler = os.environ.get("CXX") or "g++"  # inductor's (torch._inductor.config.cpp.cxx), without importing it
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}) for inductor"
    return None


@dataclass(frozen=True)
class LayerEntries:
    """K (kind 0) or V (kind 1) of one layer, as a place in its group's cache tensor rather than a view of it.

    A compiled graph that writes into a view of its input rebuilds the whole input around the view
    (a copy of the entire cache, every layer, every step); writing into the input itself with one
    index_put_ stays in place.
    """

    data: torch.Tensor  # the layer's group: (2, L_g, B, h_kv, C_g, d)
    kind: int
    layer: int  # in the group

    @property
    def capacity(self) -> int:
        return self.data.shape[4]


class CacheLayers:
    """What Transformer.forward reads of a cache, over group tensors of KVCache's layout (each (2, L_g, B, h_kv, C_g, d):
    the live cache's views, or a scratch cache's)."""

    def __init__(self, groups: tuple[torch.Tensor, ...], cache: KVCache):
        self.groups, self.cache = groups, cache

    def layer(self, index: int) -> LayerCache:
        group, at = self.cache.places[index]
        data = self.groups[group]
        return LayerCache(LayerEntries(data, 0, at), LayerEntries(data, 1, at), self.cache.is_ring(index),
                          self.cache.lookahead)


@dataclass
class GraphDecodeBatch:
    """DecodeBatch as tensors alone, for a compiled step: b and kv_len are shapes, not Python numbers.

    Row r writes its new K/V at positions[r] (a ring: mod C) of slot slot_index[r] and reads keys 0..positions[r]
    (a sliding layer: the window's); mask (b, 1, 1, kv_len) hides the keys past each row's own, which are stale or empty.
    """

    slot_index: torch.Tensor  # (b,)
    positions: torch.Tensor  # (b, 1)
    mask: torch.Tensor  # (b, 1, 1, kv_len) bool
    # (q, keys, values, mask) -> (b, h_q, 1, d); None: kvserve's decode_attention kernel, over the cache itself
    attention: Callable[..., torch.Tensor] | None = broadcast_attention

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerCache,
               window: int | None) -> torch.Tensor:
        keys, values = cache.keys, cache.values
        entries = self.positions % keys.capacity if cache.ring else self.positions  # (b, 1)
        self._write(keys, k, entries)
        self._write(values, v, entries)
        # The kernel reads each row's keys where they lie, once. Compiled without it, the broadcast form reads
        # them in the cache rather than gathering them; eager (a captured CUDA graph), that form would
        # materialize every product, and grouped_attention runs instead.
        if self.attention is None:
            return torch.ops.kvserve.decode_attention(q, keys.data[keys.kind, keys.layer], values.data[values.kind, values.layer],
                                                      self.slot_index, self.positions, window or 0)
        mask = self.mask
        if cache.ring:  # the entries of each row's window (ring_readable); all C read (a slice to
            # min(kv_len, C) would be a guard on which is larger)
            mask = ring_readable(self.positions, keys.capacity, window, cache.lookahead)[:, None, None, :]  # (b, 1, 1, C)
        elif window is not None:  # a sliding layer of full length: of those keys, the window's last ones
            key_pos = torch.arange(mask.shape[-1], device=mask.device)
            mask = mask & (key_pos > self.positions - window)[:, None, None, :]  # (b, 1, 1, kv_len)
        return self.attention(q, self._read(keys, mask.shape[-1]), self._read(values, mask.shape[-1]), mask)

    def _write(self, entries: LayerEntries, new: torch.Tensor, at: torch.Tensor) -> None:
        """Store one step's K or V of every row, row r at entry at[r]."""
        data, rows = entries.data, self.slot_index[:, None]  # rows (b, 1)
        heads = torch.arange(data.shape[3], device=data.device)[None, :]  # (1, h_kv)
        # Every index a tensor, broadcast to (b, h_kv): one index_put_ on the cache tensor itself.
        index = (torch.full_like(rows, entries.kind), torch.full_like(rows, entries.layer), rows, heads, at)
        data.index_put_(index, new[:, :, 0])  # new (b, h_kv, 1, d) -> (b, h_kv, d) at each (slot, head, entry)

    def _read(self, entries: LayerEntries, n: int) -> torch.Tensor:
        """Each row's slot up to n entries (b, h_kv, n, d)."""
        return entries.data[entries.kind, entries.layer, :, :, :n][self.slot_index]


class DecodeExecutor:
    def __init__(self, model: Transformer, rotary: RotaryTable, cache: KVCache, rows: int | None = None):
        self.model, self.rotary, self.cache = model, rotary, cache
        # The most rows a step runs: one per slot, or with speculative decoding one per slot and draft (a row per
        # verified position: Engine._verify).
        self.rows = rows or cache.slots
        self.buckets = batch_buckets(self.rows)
        self.graphs: dict[str, object] = {}  # bucket -> compiled step, filled as each is ready (CPU)
        # attention by kvserve's kernel (CPU, where it loads; its vectors take head widths in 8s)
        self.reads_cache = kernels_run_on(cache.device) and cache.head_dim % 8 == 0
        self.captured: CapturedSteps | None = None  # CUDA graphs, captured as each size is first used (CUDA)

    @property
    def compiles_code(self) -> bool:
        """Whether compile() generates code (inductor, minutes) rather than capturing CUDA graphs (as steps run)."""
        return self.cache.device.type == "cpu"

    @property
    def graph_names(self) -> tuple[str, ...]:
        """The compiled buckets, or the captured (batch size, key length) pairs."""
        return tuple(self.graphs) + (self.captured.captured if self.captured is not None else ())

    def bucket(self, batch_size: int) -> str:
        """The bucket whose range holds batch_size: the last one starting at or below it."""
        return [name for name, smallest in self.buckets.items() if smallest <= batch_size][-1]

    def forward(self, tokens: list[int], slots: list[int], lengths: list[int]) -> torch.Tensor:
        """One new token per row at its length (its position) in its slot -> next-token logits (b, V) float32.

        Rows may share a slot at consecutive positions (drafts being verified): every row's K/V is written before
        any row attends, so each reads its own slot's earlier positions, this step's included."""
        if self.captured is not None:
            return self.captured.forward(tokens, slots, lengths)
        device = self.cache.device
        token_ids = torch.tensor(tokens, device=device)[:, None]  # (b, 1)
        graph = self.graphs.get(self.bucket(len(tokens)))
        if graph is None:
            batch = DecodeBatch(slots, lengths, device, self.reads_cache)
            return self.model.logits(self.model(token_ids, self.rotary, self.cache, batch))[:, 0]  # (b, 1, V) -> (b, V)
        positions = torch.tensor(lengths, device=device)[:, None]  # (b, 1)
        mask = torch.arange(max(lengths) + 1, device=device) <= positions  # (b, kv_len): keys up to its own
        return graph(token_ids, torch.tensor(slots, device=device), positions, mask[:, None, None, :],
                     self.cache.groups)

    def step(self, tokens: torch.Tensor, slot_index: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
             groups: tuple[torch.Tensor, ...], attention: Callable[..., torch.Tensor] | None = None,
             rotary: RotaryTable | None = None) -> torch.Tensor:
        """The function that is compiled (or captured): the decode forward and the LM head, tensors in, logits out.
        attention: as GraphDecodeBatch's; by default kvserve's kernel where it runs, else the broadcast form.
        rotary: the executor's tables, or the same tensors under an exported module's names (aot_steps)."""
        if attention is None and not self.reads_cache:
            attention = broadcast_attention
        batch = GraphDecodeBatch(slot_index, positions, mask, attention)
        hidden = self.model(tokens, rotary or self.rotary, CacheLayers(groups, self.cache), batch)  # (b, 1, hidden)
        return self.model.logits(hidden)[:, 0]  # the head over (b, 1, hidden), a decode step's shape -> (b, V)

    def capture(self, graphs: bool = True) -> None:
        """Decode through CUDA graphs from the next step on, each (batch size, key length) captured at its first use
        (graphs=False: the same padded steps, run eagerly; the CPU tests the padding so)."""
        step = functools.partial(self.step, attention=grouped_attention)
        self.captured = CapturedSteps(step, self.cache, self.rows, capture=graphs)
        log.info("decode steps run as CUDA graphs, each batch size (%s) and key length (%s) captured at first use",
                 ", ".join(map(str, self.captured.batch_sizes)), ", ".join(map(str, self.captured.key_lengths)))

    def load_packages(self) -> None:
        """Every bucket's step from its package compiled ahead of time (blocking; built first where absent: minutes
        on a large model), without torch's compiler in this process once they exist (engine/aot_steps.py)."""
        from engine import aot_steps

        step = aot_steps.StepModule(self)
        first = time.perf_counter()
        for name, (smallest, largest) in ((name, self.sizes(name)) for name in self.buckets):
            self.graphs[name] = aot_steps.load_or_build(step, smallest, largest)
        log.info("decode compiled for every batch size, ahead of time: %d packages ready in %.1f s", len(self.graphs),
                 time.perf_counter() - first)

    @torch.inference_mode()
    def compile(self) -> None:
        """Compile every bucket's graph (blocking), each on a scratch cache; the live cache is never touched."""
        # The model's parameters and buffers are fixed once the engine is built (never replaced, never
        # resized), so the graphs skip dynamo's guards on them: checking hundreds of tensors took about
        # as long, at batch 1, as the step's attention.
        unguarded = torch.compiler.skip_guard_on_all_nn_modules_unsafe
        # cpp_wrapper: the code that calls a step's few hundred kernels is C++ too, not Python (a sixth of a batch-1
        # step of the default model, measured side by side; a cold compile takes longer).
        # emulate_precision_casts: a bfloat16 intermediate is rounded where eager rounds it, also inside a fused
        # kernel. Without it, a fusion that depends on the shapes (the one-row graph fuses a residual add into the
        # norm's sum of squares, which then reads the unrounded float) gives each graph other last bits, enough to
        # flip a near tie; with it, a row's logits are the eager step's bits in every graph, at every batch size
        # (kvserve's kernels compute each row alone), so speculative decoding's verification rows, a batch of 16
        # and a single stream all decode the same tokens.
        compiled = torch.compile(self.step, options={"guard_filter_fn": unguarded, "cpp_wrapper": True,
                                                  "emulate_precision_casts": True})
        first = time.perf_counter()
        for name, (batch_size, largest) in ((name, self.sizes(name)) for name in self.buckets):
            started = time.perf_counter()
            compiled(*self._scratch_step(batch_size, dynamic_batch=largest != batch_size))
            self.graphs[name] = compiled
            log.info("compiled decode step for %s in %.1f s", self.describe(name), time.perf_counter() - started)
        log.info("decode compiled for every batch size: %d graphs in %.1f s", len(self.graphs),
                 time.perf_counter() - first)
        release_freed_memory()  # the compile's temporaries

    def _scratch_step(self, batch_size: int, dynamic_batch: bool) -> tuple[torch.Tensor, ...]:
        """step()'s arguments for batch_size rows on a scratch cache of the live cache's layout, its sizes marked dynamic
        (the batch's only where the bucket holds more than one size).

        The dynamic sizes differ from each other and from 0/1, so that torch keeps each its own symbol (equal
        sizes would share one, and a guard on their equality); one live slot stays one (torch specializes
        size 1, and the live cache would not match a symbol).
        """
        live = self.cache.groups
        device, dtype = self.cache.device, self.cache.dtype
        sizes = (n for n in itertools.count(3) if n != batch_size)
        scratch_slots = next(sizes) if self.cache.slots > 1 else 1
        kv_len = next(sizes)
        lengths = [next(sizes) for _ in live]  # each group's entries per slot
        shapes = [(*g.shape[:2], scratch_slots, g.shape[3], n, g.shape[5]) for g, n in zip(live, lengths)]
        with torch.inference_mode(False):  # made as the live cache is (views of one allocation), so the guards match
            storage = torch.zeros(sum(math.prod(shape) for shape in shapes), dtype=dtype, device=device)
            scratch = tuple(part.view(shape) for part, shape in zip(storage.split([math.prod(s) for s in shapes]), shapes))
        tokens = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
        slot_index = torch.zeros(batch_size, dtype=torch.long, device=device)  # every row in scratch slot 0
        positions = torch.full((batch_size, 1), kv_len - 1, device=device)
        mask = torch.ones(batch_size, 1, 1, kv_len, dtype=torch.bool, device=device)
        batch_dim = [0] if dynamic_batch else []
        marks = [(tokens, batch_dim), (slot_index, batch_dim), (positions, batch_dim), (mask, batch_dim + [3])]
        marks += [(group, [4] + [2] * (scratch_slots > 1)) for group in scratch]
        for tensor, dims in marks:
            for dim in dims:
                torch._dynamo.mark_dynamic(tensor, dim)
        return tokens, slot_index, positions, mask, scratch

    def sizes(self, bucket: str) -> tuple[int, int | None]:
        """The smallest and largest batch a bucket serves (None: no largest)."""
        smallest = self.buckets[bucket]
        following = [n for n in self.buckets.values() if n > smallest]
        if following:
            return smallest, following[0] - 1
        return smallest, smallest if smallest == self.rows else None

    def describe(self, bucket: str) -> str:
        """The batch sizes a bucket serves, in words."""
        smallest, largest = self.sizes(bucket)
        if largest is None:
            return f"batches of {smallest} or more"
        return f"batch {smallest}" if largest == smallest else f"batches of {smallest} to {largest}"


def batch_buckets(rows: int) -> dict[str, int]:
    """Each decode bucket, named by the batch sizes it serves, by the smallest: one row, then every larger batch up
    to `rows` (the most a step runs). No layer changes form with a decode step's batch size (quantized.decoding: a
    row gets the bits it gets alone), so no bucket splits there."""
    if rows == 1:  # one row at most: no larger batch
        return {"1": 1}
    return {"1": 1, "2" if rows == 2 else "2+": 2}
