"""Per-step metadata: which cache entries a forward pass writes and which it may read.

The model is called with one of these as an argument; it holds no serving state of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from engine.attention import grouped_attention


def cache_rows(slots: list[int], slot_index: torch.Tensor) -> slice | torch.Tensor:
    """How to read these slots' rows of the cache: a view when they are one range, else a gathered copy."""
    lo, hi = slots[0], slots[-1] + 1
    return slice(lo, hi) if slots == list(range(lo, hi)) else slot_index


@dataclass
class PrefillBatch:
    """Prompt chunks of one or more sequences in one forward pass.

    Row r holds positions [starts[r], starts[r] + lengths[r]) of cache slot slots[r]. Rows are
    right-padded to the longest chunk; a padded query repeats its row's last real position, so it
    reads only real keys, and its output is discarded. Padded keys are never written to the cache.
    """

    slots: list[int]
    starts: list[int]
    lengths: list[int]
    device: torch.device
    positions: torch.Tensor = field(init=False)
    mask: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        offsets = torch.arange(max(self.lengths), device=self.device)
        starts = torch.tensor(self.starts, device=self.device)[:, None]
        lengths = torch.tensor(self.lengths, device=self.device)[:, None]
        self.positions = starts + torch.minimum(offsets[None], lengths - 1)  # (n, width)
        key_pos = torch.arange(self.kv_len, device=self.device)
        # Query at absolute position p may read keys 0..p of its own slot: earlier chunks and itself.
        self.mask = (key_pos[None, None, :] <= self.positions[:, :, None])[:, None]  # (n, 1, width, kv_len)
        real = offsets[None] < lengths  # (n, width): which entries are prompt tokens, not padding
        self.real_rows, self.real_offsets = real.nonzero(as_tuple=True)
        self.slot_index = torch.tensor(self.slots, device=self.device)
        self.real_slots = self.slot_index[self.real_rows]
        self.real_positions = self.positions[real]

    @cached_property
    def kv_len(self) -> int:
        return max(s + n for s, n in zip(self.starts, self.lengths))

    def last_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, offset) of each row's last real token: the one whose output predicts the next token."""
        rows = torch.arange(len(self.slots), device=self.device)
        return rows, torch.tensor(self.lengths, device=self.device) - 1

    def store(self, keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write the real entries of k, v (n, h_kv, width, d); return the slots' filled parts (n, h_kv, kv_len, d)."""
        index = (self.real_rows, self.real_offsets)
        keys[self.real_slots, :, self.real_positions] = k.transpose(1, 2)[index]  # (real tokens, h_kv, d)
        values[self.real_slots, :, self.real_positions] = v.transpose(1, 2)[index]
        rows = cache_rows(self.slots, self.slot_index)
        return keys[rows, :, : self.kv_len], values[rows, :, : self.kv_len]

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return grouped_attention(q, keys, values, self.mask)


@dataclass
class DecodeBatch:
    """One new token for each of `slots`, each at its own position (= tokens the slot already holds)."""

    slots: list[int]
    lengths: list[int]
    device: torch.device
    reads_cache: bool = False  # attention by kvserve's decode_attention kernel, over the cache where it lies
    slot_index: torch.Tensor = field(init=False)
    positions: torch.Tensor = field(init=False)
    mask: torch.Tensor | None = field(init=False)

    def __post_init__(self) -> None:
        self.slot_index = torch.tensor(self.slots, device=self.device)
        lengths = torch.tensor(self.lengths, device=self.device)
        self.positions = lengths[:, None]  # (b, 1)
        if len(set(self.lengths)) == 1:
            self.mask = None  # every key up to kv_len is real for every row
        else:
            # Slot i holds lengths[i] + 1 keys after this step; later cache entries are stale or empty.
            key_pos = torch.arange(self.kv_len, device=self.device)
            self.mask = (key_pos[None, :] <= lengths[:, None])[:, None, None, :]  # (b, 1, 1, kv_len)

    @cached_property
    def kv_len(self) -> int:
        """Keys read per row: the longest slot's, not the cache's T, so cost follows what is filled."""
        return max(self.lengths) + 1

    def store(self, keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write k, v (b, h_kv, 1, d) at each slot's position; return (b, h_kv, kv_len, d) to attend over (or, for
        the kernel, the layer's whole (B, h_kv, T, d))."""
        keys[self.slot_index, :, self.positions[:, 0]] = k[:, :, 0]
        values[self.slot_index, :, self.positions[:, 0]] = v[:, :, 0]
        if self.reads_cache:
            return keys, values
        rows = cache_rows(self.slots, self.slot_index)
        return keys[rows, :, : self.kv_len], values[rows, :, : self.kv_len]

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        if self.reads_cache:  # each row's keys 0..position of its slot, read in place
            return torch.ops.kvserve.decode_attention(q, keys, values, self.slot_index, self.positions)
        return grouped_attention(q, keys, values, self.mask)
