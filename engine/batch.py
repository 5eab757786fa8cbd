"""Per-step metadata: which cache entries a forward pass writes and which it may read.

The model is called with one of these as an argument; it holds no serving state of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from engine.models.attention import grouped_attention
from engine.kv_cache import LayerCache, ring_readable


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
    _window_masks: dict[int, torch.Tensor] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        offsets = torch.arange(max(self.lengths), device=self.device)
        starts = torch.tensor(self.starts, device=self.device)[:, None]
        lengths = torch.tensor(self.lengths, device=self.device)[:, None]
        self.positions = starts + torch.minimum(offsets[None], lengths - 1)  # (n, width)
        key_pos = torch.arange(self.kv_len, device=self.device)
        # Query at absolute position p may read keys 0..p of its own slot: earlier chunks and itself.
        self.mask = (key_pos[None, None, :] <= self.positions[:, :, None])[:, None]  # (n, 1, width, kv_len)
        self.real = offsets[None] < lengths  # (n, width): which entries are prompt tokens, not padding
        self.real_rows, self.real_offsets = self.real.nonzero(as_tuple=True)
        self.slot_index = torch.tensor(self.slots, device=self.device)
        self.real_slots = self.slot_index[self.real_rows]
        self.real_positions = self.positions[self.real]

    @cached_property
    def kv_len(self) -> int:
        return max(s + n for s, n in zip(self.starts, self.lengths))

    def last_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, offset) of each row's last real token: the one whose output predicts the next token."""
        rows = torch.arange(len(self.slots), device=self.device)
        return rows, torch.tensor(self.lengths, device=self.device) - 1

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerCache,
               window: int | None) -> torch.Tensor:
        """Write the real entries of k, v (n, h_kv, width, d) into the layer's cache; attend q (n, h_q, width, d)
        over each row's keys (a sliding layer: the window's)."""
        capacity = cache.keys.shape[2]
        if cache.ring and self.kv_len > capacity:  # this pass overwrites entries that its own queries still read
            return self._attend_ring(q, k, v, cache, window)
        index = (self.real_rows, self.real_offsets)
        cache.keys[self.real_slots, :, self.real_positions] = k.transpose(1, 2)[index]  # (real tokens, h_kv, d)
        cache.values[self.real_slots, :, self.real_positions] = v.transpose(1, 2)[index]
        rows = cache_rows(self.slots, self.slot_index)
        keys, values = cache.keys[rows, :, : self.kv_len], cache.values[rows, :, : self.kv_len]
        return grouped_attention(q, keys, values, self.mask if window is None else self.window_mask(window))

    def window_mask(self, window: int) -> torch.Tensor:
        """The mask of a sliding layer: of the keys up to its own, a query at p reads p - window + 1 .. p only."""
        if window not in self._window_masks:
            key_pos = torch.arange(self.kv_len, device=self.device)
            recent = key_pos[None, None, :] > self.positions[:, :, None] - window  # (n, width, kv_len)
            self._window_masks[window] = self.mask & recent[:, None]
        return self._window_masks[window]

    def _attend_ring(self, q, k, v, cache: LayerCache, window: int) -> torch.Tensor:
        """A ring layer whose positions wrap in this pass: the entries held before it (position start - 1 - i back,
        for each entry) and the chunk's own keys, read together by position; then the chunk's last C written."""
        capacity = cache.keys.shape[2]
        starts = torch.tensor(self.starts, device=self.device)[:, None]  # (n, 1)
        entry = torch.arange(capacity, device=self.device)[None, :]  # (1, C)
        held = starts - 1 - torch.remainder(starts - 1 - entry, capacity)  # (n, C): the position entry i holds
        key_pos = torch.cat([held, self.positions], dim=1)  # (n, C + width)
        real = torch.cat([held >= 0, self.real], dim=1)  # (n, C + width): written before, or a prompt token
        query_pos = self.positions[:, :, None]  # (n, width, 1)
        mask = real[:, None] & (key_pos[:, None] <= query_pos) & (key_pos[:, None] > query_pos - window)
        keys = torch.cat([cache.keys[self.slot_index], k], dim=2)  # (n, h_kv, C + width, d)
        values = torch.cat([cache.values[self.slot_index], v], dim=2)
        out = grouped_attention(q, keys, values, mask[:, None])  # mask (n, 1, width, C + width)
        # Of each row's chunk, only the last C positions are kept (earlier ones would land on the same entries).
        lengths = torch.tensor(self.lengths, device=self.device)
        kept = self.real_offsets >= (lengths[self.real_rows] - capacity)
        rows, offsets = self.real_rows[kept], self.real_offsets[kept]
        entries = self.real_positions[kept] % capacity
        cache.keys[self.real_slots[kept], :, entries] = k.transpose(1, 2)[rows, offsets]  # (kept tokens, h_kv, d)
        cache.values[self.real_slots[kept], :, entries] = v.transpose(1, 2)[rows, offsets]
        return out


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
    _ring_entries: dict[int, torch.Tensor] = field(init=False, default_factory=dict)
    _ring_masks: dict[tuple[int, int], torch.Tensor] = field(init=False, default_factory=dict)

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

    def ring_entries(self, capacity: int) -> torch.Tensor:
        """Where each row's position lives in a ring of `capacity` entries (b,): computed once per step, not per layer."""
        if capacity not in self._ring_entries:
            self._ring_entries[capacity] = self.positions[:, 0] % capacity
        return self._ring_entries[capacity]

    def ring_mask(self, capacity: int, window: int, lookahead: int) -> torch.Tensor:
        """(b, 1, 1, C): the entries of each row's window in a ring with a lookahead; once per step, not per layer."""
        if (capacity, window) not in self._ring_masks:
            readable = ring_readable(self.positions, capacity, window, lookahead)
            self._ring_masks[capacity, window] = readable[:, None, None, :]
        return self._ring_masks[capacity, window]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerCache,
               window: int | None) -> torch.Tensor:
        """Write k, v (b, h_kv, 1, d) at each slot's position (a ring: at position mod C); attend q (b, h_q, 1, d)
        over each row's keys."""
        capacity = cache.keys.shape[2]
        entries = self.ring_entries(capacity) if cache.ring else self.positions[:, 0]
        cache.keys[self.slot_index, :, entries] = k[:, :, 0]
        cache.values[self.slot_index, :, entries] = v[:, :, 0]
        if self.reads_cache:  # each row's keys up to its position (within the window) of its slot, read in place
            return torch.ops.kvserve.decode_attention(q, cache.keys, cache.values, self.slot_index, self.positions,
                                                      window or 0)
        rows = cache_rows(self.slots, self.slot_index)
        if cache.ring:  # the entries of each row's window, of the first min(kv_len, C) (later ones unwritten)
            n = min(self.kv_len, capacity)
            if cache.lookahead:  # a ring with a lookahead: it also holds keys older than the window, or drafts
                mask = self.ring_mask(capacity, window, cache.lookahead)[..., :n]  # (b, 1, 1, n)
            else:  # entry i < C holds a key the row may read iff i <= its position: the first C of the mask
                mask = None if self.mask is None else self.mask[..., :n]
            return grouped_attention(q, cache.keys[rows, :, :n], cache.values[rows, :, :n], mask)
        keys, values = cache.keys[rows, :, : self.kv_len], cache.values[rows, :, : self.kv_len]
        if window is None or self.kv_len <= window:
            return grouped_attention(q, keys, values, self.mask)
        key_pos = torch.arange(self.kv_len, device=self.device)
        mask = (key_pos[None, :] <= self.positions) & (key_pos[None, :] > self.positions - window)  # (b, kv_len)
        return grouped_attention(q, keys, values, mask[:, None, None, :])
