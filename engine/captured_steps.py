"""Decode steps replayed as CUDA graphs: on a GPU, an eager step of a small model is mostly the CPU launching its
hundreds of kernels one by one; a captured graph launches them all at once.

A graph replays fixed kernels on fixed addresses and shapes. So every input of a step lives in a buffer of this
object's, sized once for the slots, and the shapes come from two short lists:
- batch sizes: powers of two up to the most rows a step runs (the slots, times 1 + drafts where speculative
  decoding verifies them), and that number itself. A batch is padded up to the next one by
  repeating its first row: the copies write the same K/V at the same place as that row, and their logits are
  dropped;
- key lengths: powers of two from 64 up to T, and T. The mask hides the keys past each row's own, so a step's
  cost still follows the filled length (within 2x), not T.

Each (batch size, key length) pair is captured the first time a step needs it, on the thread that steps the
engine: that step runs eagerly on the buffers first (the warm-up a capture needs, and the step's own result),
then its kernels are recorded without running. No step ever reads a scratch cache: the graph's addresses are the
live cache's. All graphs share one memory pool; they replay one at a time, and each step's logits are copied
out before the next.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from engine.kv_cache import KVCache

log = logging.getLogger("kvserve.captured_steps")

SHORTEST_KEYS = 64

# step(tokens (b, 1), slot_index (b,), positions (b, 1), mask (b, 1, 1, kv_len), the cache's groups) -> logits (b, V)
Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]], torch.Tensor]


def padded_sizes(largest: int, smallest: int = 1) -> list[int]:
    """Powers of two from `smallest` below `largest`, then `largest` itself."""
    sizes = []
    size = smallest
    while size < largest:
        sizes.append(size)
        size *= 2
    return sizes + [largest]


def padded_to(sizes: list[int], n: int) -> int:
    """The first size that holds n."""
    return next(size for size in sizes if size >= n)


class CapturedSteps:
    def __init__(self, step: Step, cache: KVCache, rows: int, capture: bool = True):
        device = cache.device
        self.step, self.cache_groups = step, cache.groups
        self.capture = capture  # False: each replay runs the step on the buffers (how the CPU tests the padding)
        self.batch_sizes = padded_sizes(rows)
        self.key_lengths = padded_sizes(cache.max_seq_len, min(SHORTEST_KEYS, cache.max_seq_len))
        # Row r: its token, its slot, its position (= the keys it holds before this step).
        self.inputs = torch.zeros(3, rows, dtype=torch.long, device=device)  # (3, rows)
        self.replays: dict[tuple[int, int], Callable[[], torch.Tensor]] = {}
        self.pool = None  # the graphs' shared memory pool, once the first is captured

    @property
    def captured(self) -> tuple[str, ...]:
        """Each (batch size, key length) captured so far, as "b4·k512"."""
        return tuple(f"b{size}·k{keys}" for size, keys in self.replays)

    def forward(self, tokens: list[int], slots: list[int], lengths: list[int]) -> torch.Tensor:
        """One new token per slot at its length -> next-token logits (b, V) float32, as DecodeExecutor.forward."""
        b = len(tokens)
        size, keys = padded_to(self.batch_sizes, b), padded_to(self.key_lengths, max(lengths) + 1)
        padding = size - b  # rows repeating row 0
        rows = torch.tensor([tokens + tokens[:1] * padding, slots + slots[:1] * padding,
                             lengths + lengths[:1] * padding])  # (3, size), on the host
        self.inputs[:, :size].copy_(rows, non_blocking=True)
        replay = self.replays.get((size, keys))
        if replay is None:
            logits = self._first(size, keys)
        else:
            logits = replay()
        return logits[:b].clone()  # the graph's output buffer is overwritten by the next replay

    def _run(self, size: int, keys: int) -> torch.Tensor:
        """The step on the first `size` rows of the buffers, reading `keys` positions of each slot."""
        tokens, slot_index, positions = self.inputs[0, :size, None], self.inputs[1, :size], self.inputs[2, :size, None]
        mask = torch.arange(keys, device=positions.device) <= positions  # (size, keys): keys up to its own
        return self.step(tokens, slot_index, positions, mask[:, None, None, :], self.cache_groups)

    def _first(self, size: int, keys: int) -> torch.Tensor:
        """This step, eagerly; then its graph, for the next steps of this size."""
        started = time.perf_counter()
        if not self.capture:
            logits = self._run(size, keys)
            self.replays[size, keys] = lambda: self._run(size, keys)
            return logits
        side = torch.cuda.Stream()  # warm-up off the capturing stream, as CUDA graphs require
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # the same K/V written to the same places twice: the cache ends as after one step
                logits = self._run(size, keys)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = self._run(size, keys)  # recorded, not run: the eager step above was this step
        self.pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return output

        self.replays[size, keys] = replay
        log.info("captured the decode step for batch %d, %d keys, as a CUDA graph in %.2f s", size, keys,
                 time.perf_counter() - started)
        return logits
