"""The KV cache: one allocation, made once, never grown (on the CPU, resident as its positions are first written)."""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import torch

from engine.config import ModelConfig


@dataclass(frozen=True)
class LayerCache:
    """One layer's K and V entries, each (B, h_kv, C, d_h), and whether they are a ring (position p at entry p mod C,
    C = the layer's window W plus the lookahead K: the keys its queries may read, and room for the K positions a
    step verifying drafts writes past the newest token) or one entry per position."""

    keys: torch.Tensor
    values: torch.Tensor
    ring: bool
    lookahead: int = 0  # K: a ring's entries past its window (a Python number, never a traced shape)


def zeroed(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`numel` zeros. On the CPU, in an anonymous mapping of their own, whose pages the system supplies as they are
    first written: a slot's positions cost resident memory once used, not for the whole capacity up front (as
    llama.cpp's cache). The mapping lives as long as the tensor (torch.frombuffer holds it)."""
    if device.type != "cpu":
        return torch.zeros(numel, device=device, dtype=dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    pages = mmap.mmap(-1, max(1, numel * itemsize), flags=mmap.MAP_PRIVATE)  # anonymous: every page zero until written
    return torch.frombuffer(pages, dtype=dtype, count=numel)


def layer_capacities(config: ModelConfig, max_seq_len: int, full_windows: bool = False,
                     lookahead: int = 0) -> tuple[int, ...]:
    """Entries per slot of each layer: T for a global layer, min(W + K, T) for a sliding one (T with full_windows),
    K = `lookahead`: the positions past its newest token one step writes (speculative decoding's drafts). A step
    writing positions p..p+K overwrites the entries of p+K-C and before: with C >= W + K, keys no query of the
    step, nor any later one, reads (the oldest reads p-W+1)."""
    return tuple(max_seq_len if (w := config.window(i)) is None or full_windows else min(w + lookahead, max_seq_len)
                 for i in range(config.num_layers))


def ring_readable(positions: torch.Tensor, capacity: int, window: int, lookahead: int) -> torch.Tensor:
    """positions (b, 1) -> (b, C) bool: which of a ring's C entries a query at position p reads. Entry e holds
    p - ((p - e) mod C) if that is p or older (e <= p once the ring has wrapped, p >= C); a key of its window iff
    less than W back. An entry that holds a newer position (a draft of this step, or one rejected before) holds
    p + j for some 0 < j <= K, whose back is C - j >= W: never read. Without a lookahead (C <= W) every written
    entry is read. (`lookahead`, not C against W, decides: a compiled step traces C as a symbol.)"""
    entry = torch.arange(capacity, device=positions.device)[None, :]  # (1, C)
    written = entry <= positions  # (b, C)
    if lookahead == 0:
        return written
    return written & (torch.remainder(positions - entry, capacity) < window)


class KVCache:
    """K and V for `slots` sequences, every layer, in one allocation.

    Layer l holds C_l entries per slot (layer_capacities): T positions for a global layer, only the window for a
    sliding one, whose entries are a ring. Layers of one capacity are a group: a view (2, L_g, B, h_kv, C_g, d_h)
    of the allocation, each layer's K or V a view of it, each slot a contiguous block, and (for C = T) a slot's
    first n entries exactly what attention reads. Only the h_kv shared heads are stored; query heads are grouped
    onto them at attention time, never repeated here. The allocation holds
    Σ_l 2·B·C_l·h_kv·d_h·itemsize bytes: 2·B·L·T·h_kv·d_h·itemsize where every layer is global.
    """

    def __init__(self, config: ModelConfig, slots: int, max_seq_len: int, device: torch.device, dtype: torch.dtype,
                 full_windows: bool = False, lookahead: int = 0):
        if slots <= 0 or max_seq_len <= 0:
            raise ValueError(f"KV cache needs positive slots and max_seq_len, got {slots} and {max_seq_len}")
        self.num_layers = config.num_layers
        self.num_kv_heads = config.num_kv_heads
        self.num_q_heads = config.num_heads
        self.head_dim = config.head_dim
        self.slots = slots
        self.max_seq_len = max_seq_len
        self.lookahead = lookahead
        self.capacities = layer_capacities(config, max_seq_len, full_windows, lookahead)
        self.windows = tuple(config.window(i) for i in range(config.num_layers))
        shape = (slots, config.num_kv_heads)
        members = {c: [i for i, ci in enumerate(self.capacities) if ci == c]
                   for c in sorted(set(self.capacities), reverse=True)}  # T's group first
        sizes = [2 * len(layers) * slots * config.num_kv_heads * c * config.head_dim for c, layers in members.items()]
        self.storage = zeroed(sum(sizes), dtype, device)
        self.groups: tuple[torch.Tensor, ...] = tuple(
            part.view(2, len(layers), *shape, c, config.head_dim)  # (2, L_g, B, h_kv, C_g, d_h)
            for part, (c, layers) in zip(self.storage.split(sizes), members.items()))
        # layer -> (its group, its index in the group)
        places = {i: (g, at) for g, layers in enumerate(members.values()) for at, i in enumerate(layers)}
        self.places = tuple(places[i] for i in range(config.num_layers))

    def is_ring(self, index: int) -> bool:
        """Whether layer `index` keeps only its window (and lookahead), position p at entry p mod C (C < T)."""
        return self.windows[index] is not None and self.capacities[index] < self.max_seq_len

    def layer(self, index: int) -> LayerCache:
        group, at = self.places[index]
        data = self.groups[group]
        return LayerCache(data[0, at], data[1, at], self.is_ring(index), self.lookahead)

    @property
    def ring_capacity(self) -> int | None:
        """The fewest positions a ring layer holds (a slot that wrote more has lost its first ones there), or None
        where every layer holds every position."""
        return min((c for i, c in enumerate(self.capacities) if c < self.max_seq_len), default=None)

    @property
    def ring_window(self) -> int | None:
        """The most positions a slot can hold and still have lost none of them from a ring: its capacity less the
        lookahead (a step verifying drafts may write K positions past the newest, wrapping onto the first ones);
        None where every layer holds every position."""
        return None if self.ring_capacity is None else self.ring_capacity - self.lookahead

    def copy_prefix(self, source: int, target: int, positions: int) -> None:
        """Slot `target`'s first `positions` entries become slot `source`'s, in every layer (a ring: all of its
        entries once the positions fill it); one copy per group."""
        for data in self.groups:
            entries = min(positions, data.shape[4])
            data[:, :, target, :, :entries] = data[:, :, source, :, :entries]

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    @property
    def device(self) -> torch.device:
        return self.storage.device

    @property
    def itemsize(self) -> int:
        return self.storage.element_size()

    def used_bytes(self, tokens: int) -> int:
        """What one slot's first `tokens` positions occupy: each layer's min(tokens, C_l) entries."""
        return 2 * sum(min(tokens, c) for c in self.capacities) * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def capacity_bytes(self) -> int:
        """Σ_l 2·B·C_l·h_kv·d_h·itemsize: the whole allocation."""
        return self.storage.numel() * self.itemsize

    @property
    def full_length_bytes(self) -> int:
        """What the same cache would take with every layer holding T positions: 2·B·L·T·h_kv·d_h·itemsize."""
        return 2 * self.slots * self.num_layers * self.max_seq_len * self.num_kv_heads * self.head_dim * self.itemsize

    @staticmethod
    def slots_for_budget(config: ModelConfig, max_seq_len: int, budget_bytes: int, dtype: torch.dtype,
                         full_windows: bool = False, lookahead: int = 0) -> int:
        """The largest B whose cache of `max_seq_len` positions fits in `budget_bytes`."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        entries = sum(layer_capacities(config, max_seq_len, full_windows, lookahead))
        return budget_bytes // (2 * entries * config.num_kv_heads * config.head_dim * itemsize)

    @property
    def mha_capacity_bytes(self) -> int:
        """What the same cache would take with one K/V head per query head (h_kv = h_q)."""
        return self.capacity_bytes * self.num_q_heads // self.num_kv_heads

    def terms(self) -> dict:
        """The cache's size and the formula that gives it, term by term: with sliding layers that keep only their
        window, two terms."""
        terms = {"capacity_bytes": self.capacity_bytes, "formula": "2*B*L*T*h_kv*d_h*itemsize", "B": self.slots,
                 "L": self.num_layers, "T": self.max_seq_len, "h_kv": self.num_kv_heads, "d_h": self.head_dim,
                 "itemsize": self.itemsize, "h_q": self.num_q_heads, "mha_capacity_bytes": self.mha_capacity_bytes}
        if self.ring_capacity is not None:
            sliding = sum(c < self.max_seq_len for c in self.capacities)
            terms |= {"formula": "2*B*(L_global*T + L_sliding*W)*h_kv*d_h*itemsize", "L_global": self.num_layers - sliding,
                      "L_sliding": sliding, "W": self.ring_capacity, "full_length_bytes": self.full_length_bytes}
            if self.lookahead:  # the ring also holds the positions a step verifying drafts writes
                terms |= {"formula": "2*B*(L_global*T + L_sliding*(W+K))*h_kv*d_h*itemsize",
                          "W": self.ring_capacity - self.lookahead, "K": self.lookahead}
        return terms

    def describe(self) -> str:
        layers = f"{self.num_layers} layers"
        if self.ring_capacity is not None:
            rings = sum(c < self.max_seq_len for c in self.capacities)
            layers = (f"{self.num_layers - rings} global layers x {self.max_seq_len} + {rings} sliding layers x "
                      f"{self.ring_capacity} (full length: {format_bytes(self.full_length_bytes)})")
        return (
            f"KV cache: {self.slots} slots x {self.max_seq_len} tokens, {layers}, "
            f"{self.num_kv_heads} kv heads x {self.head_dim}, {str(self.dtype).removeprefix('torch.')} = "
            f"{format_bytes(self.capacity_bytes)} (MHA would need {format_bytes(self.mha_capacity_bytes)})"
        )


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def parse_bytes(text: str) -> int:
    """'1GiB', '512MiB', '2GB', '1000000' -> bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
             "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "b": 1}
    cleaned = text.strip().lower().replace(" ", "")
    for suffix in sorted(units, key=len, reverse=True):
        if cleaned.endswith(suffix):
            number = cleaned[: -len(suffix)]
            try:
                return int(float(number) * units[suffix])
            except ValueError:
                break
    try:
        return int(cleaned)
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a size; use e.g. '1GiB' or '512MiB'") from None
