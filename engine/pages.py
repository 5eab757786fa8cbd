"""The weights' pages: a CPU model's tensors moved into one region of 2 MB pages.

Decoding one token reads every weight once, so a CPU decode step is as fast as memory streams the weights in. On
4 KB pages that stream crosses a page every 4 KB: a TLB walk each time, and the hardware prefetchers stop at each
boundary. On 2 MB pages (Linux's transparent huge pages, asked for by madvise) the same products ran 1.05-1.17x
faster, paired (bench/README.md, session 38). torch's allocator asks for them only under a process-wide
environment variable, for every large allocation; this asks for the weights alone, in one region, laid out in the
order the layers run.
"""

from __future__ import annotations

import mmap
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

HUGE_PAGE = 2 << 20  # bytes: x86-64's and most arm64 kernels' transparent huge page
ALIGNMENT = 64  # bytes: each tensor starts on a cache line, as torch's allocator starts them


@dataclass(frozen=True)
class Placement:
    """Where the weights went: `moved` bytes into the region, of which `huge` the kernel backs by huge pages."""

    moved: int
    huge: int

    def __post_init__(self):
        if not 0 <= self.huge <= self.moved + HUGE_PAGE:
            raise ValueError(f"huge={self.huge} bytes must lie within the {self.moved} moved (and the region's page)")

    def describe(self) -> str:
        if not self.moved:
            return "where the loader put them (not moved onto huge pages)"
        return f"{self.moved / 2**20:.0f} MiB in one region, {self.huge / 2**20:.0f} MiB of it on huge pages"


def onto_huge_pages(model: nn.Module) -> Placement:
    """Move every contiguous CPU parameter and buffer of `model` into one anonymous region that asks for huge
    pages, in module order; a tensor registered under two names (a tied head) stays one tensor. Where the kernel
    gives no huge pages (THP off, another OS), the region is ordinary memory and nothing else changes."""
    tensors = movable(model)
    if not tensors:
        return Placement(0, 0)
    offsets, size = {}, 0
    for key, tensor in tensors.items():
        offsets[key] = size
        size += -(-tensor.nbytes // ALIGNMENT) * ALIGNMENT
    region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: the pages are huge from their first fault
    memory = torch.frombuffer(region, dtype=torch.uint8)  # the tensor keeps the region mapped
    start = -memory.data_ptr() % HUGE_PAGE  # the unused head is never touched, so never resident
    moved, parameters = {}, {}
    for key, tensor in tensors.items():
        place = memory[start + offsets[key]:start + offsets[key] + tensor.nbytes]
        moved[key] = place.view(tensor.dtype).view(tensor.shape).copy_(tensor)
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                key = identity(tensor) if placeable(tensor) else None
                if key in moved and isinstance(tensor, nn.Parameter):  # one per tensor: a tied head shares it
                    table[name] = parameters.setdefault(key, nn.Parameter(moved[key], requires_grad=False))
                elif key in moved:
                    table[name] = moved[key]
    return Placement(size, huge_bytes(memory.data_ptr() + start, size))


def movable(model: nn.Module) -> dict[tuple, torch.Tensor]:
    """The model's placeable tensors by identity, in module order."""
    found = {}
    for module in model.modules():
        for tensor in [*module._parameters.values(), *module._buffers.values()]:
            if placeable(tensor):
                found.setdefault(identity(tensor), tensor)
    return found


def placeable(tensor: torch.Tensor | None) -> bool:
    """A plain CPU tensor whose bytes are its values: strided (oneDNN's packed weights have no storage to copy),
    contiguous and not empty."""
    return (tensor is not None and tensor.device.type == "cpu" and tensor.layout == torch.strided
            and tensor.is_contiguous() and tensor.nbytes > 0)


def identity(tensor: torch.Tensor) -> tuple:
    """Two names for the same memory, shape and type are one tensor to move."""
    return tensor.data_ptr(), tensor.dtype, tuple(tensor.shape)


def huge_bytes(address: int, size: int) -> int:
    """How much of [address, address + size) the kernel backs by huge pages now (/proc/self/smaps; 0 where there
    is none)."""
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return 0
    total = 0
    for mapping in re.finditer(r"^([0-9a-f]+)-([0-9a-f]+) .*?^AnonHugePages:\s+(\d+) kB", text, re.M | re.S):
        low, high = int(mapping[1], 16), int(mapping[2], 16)
        if low < address + size and address < high:
            total += int(mapping[3]) * 1024
    return min(total, size)
