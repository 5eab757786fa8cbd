"""Per-step metadata: which cache entries a forward pass writes and which it may read.

The model is called with one of these as an argument; it holds no serving state of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch


@dataclass
class PrefillBatch:
    """A chunk of one sequence's prompt: positions [start, start + length) of cache slot `slot`."""

    slot: int
    start: int
    length: int
    device: torch.device
    mask: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        query_pos = torch.arange(self.start, self.end, device=self.device)
        key_pos = torch.arange(self.end, device=self.device)
        # Query at absolute position p may read keys 0..p: everything earlier in the slot and itself.
        self.mask = (key_pos[None, :] <= query_pos[:, None])[None, None]  # (1, 1, n, end)

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def positions(self) -> torch.Tensor:
        return torch.arange(self.start, self.end, device=self.device)[None]  # (1, n)

    def store(self, keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write k, v (1, h_kv, n, d) into the slot; return its filled part (1, h_kv, end, d)."""
        keys[self.slot, :, self.start:self.end] = k[0]
        values[self.slot, :, self.start:self.end] = v[0]
        rows = slice(self.slot, self.slot + 1)
        return keys[rows, :, : self.end], values[rows, :, : self.end]


@dataclass
class DecodeBatch:
    """One new token for each of `slots`, each at its own position (= tokens the slot already holds)."""

    slots: list[int]
    lengths: list[int]
    device: torch.device
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

    @cached_property
    def contiguous_slots(self) -> slice | None:
        """The slots as one range when they are one (reads are then views, not gathered copies)."""
        lo, hi = self.slots[0], self.slots[-1] + 1
        return slice(lo, hi) if self.slots == list(range(lo, hi)) else None

    def store(self, keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write k, v (b, h_kv, 1, d) at each slot's position; return (b, h_kv, kv_len, d) to attend over."""
        keys[self.slot_index, :, self.positions[:, 0]] = k[:, :, 0]
        values[self.slot_index, :, self.positions[:, 0]] = v[:, :, 0]
        rows = self.contiguous_slots
        if rows is None:  # gathers a copy of only the filled prefix of these slots
            rows = self.slot_index
        return keys[rows, :, : self.kv_len], values[rows, :, : self.kv_len]
