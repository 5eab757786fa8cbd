"""The KV cache: one tensor, allocated once, never grown."""

from __future__ import annotations

import torch

from engine.config import ModelConfig


class KVCache:
    """K and V for `slots` sequences of up to `max_seq_len` positions, all layers.

    Layout (2, L, B, h_kv, T, d_h): each layer's K or V is a view, each slot a contiguous block,
    and a slot's first n positions are exactly what attention reads. Only the h_kv shared heads
    are stored; query heads are grouped onto them at attention time, never repeated here.
    """

    def __init__(self, config: ModelConfig, slots: int, max_seq_len: int, device: torch.device, dtype: torch.dtype):
        if slots <= 0 or max_seq_len <= 0:
            raise ValueError(f"KV cache needs positive slots and max_seq_len, got {slots} and {max_seq_len}")
        self.num_layers = config.num_layers
        self.num_kv_heads = config.num_kv_heads
        self.num_q_heads = config.num_heads
        self.head_dim = config.head_dim
        self.slots = slots
        self.max_seq_len = max_seq_len
        self.data = torch.zeros(
            2, config.num_layers, slots, config.num_kv_heads, max_seq_len, config.head_dim,
            device=device, dtype=dtype,
        )

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) of one layer, each (B, h_kv, T, d_h)."""
        return self.data[0, index], self.data[1, index]

    def copy_prefix(self, source: int, target: int, positions: int) -> None:
        """Slot `target`'s first `positions` entries become slot `source`'s, in every layer: one copy."""
        self.data[:, :, target, :, :positions] = self.data[:, :, source, :, :positions]

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def bytes_per_token(self) -> int:
        """K and V of one position across all layers: 2·L·h_kv·d_h·itemsize."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.data.element_size()

    @property
    def capacity_bytes(self) -> int:
        """2·B·L·T·h_kv·d_h·itemsize: the whole allocation."""
        return self.data.numel() * self.data.element_size()

    def used_bytes(self, tokens_held: int) -> int:
        return tokens_held * self.bytes_per_token

    @staticmethod
    def slots_for_budget(config: ModelConfig, max_seq_len: int, budget_bytes: int, dtype: torch.dtype) -> int:
        """The largest B whose cache of `max_seq_len` positions fits in `budget_bytes`."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        per_slot = 2 * config.num_layers * max_seq_len * config.num_kv_heads * config.head_dim * itemsize
        return budget_bytes // per_slot

    @property
    def mha_capacity_bytes(self) -> int:
        """What the same cache would take with one K/V head per query head (h_kv = h_q)."""
        return self.capacity_bytes * self.num_q_heads // self.num_kv_heads

    def describe(self) -> str:
        return (
            f"KV cache: {self.slots} slots x {self.max_seq_len} tokens, {self.num_layers} layers, "
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
