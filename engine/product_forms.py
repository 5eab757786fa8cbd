"""Where kvserve's group-code products change form, measured once for the CPU found.

kvserve::codes4_product and codes8_product (engine/native/group_product.h) run in one of three forms: vector
dot products (AVX2 or AVX512-VNNI), AMX's integer tiles (one tile product per group for up to 16 input rows) or
AMX's bfloat16 tiles (the weights dequantized once per call, then summed over every group in the tile registers).
Which is fastest depends on the number of input rows and on the CPU: a tile product's loads and stores are not
repaid by a few rows, and dequantizing every weight pays off only over many. So the forms are timed against each
other at row counts from 1 to 256 when the kernels first load on a machine, and the counts where they cross are
written beside the kernels' library: every later process there reads the same counts, so compiled graphs, which
hold them as constants, stay the same from one start to the next. The record is a cache file
(engine/cache_file.py): one that is damaged is measured again.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine import cache_file
from engine.cache_file import CacheMiss
from engine.native import kernels_library

log = logging.getLogger("kvserve.product_forms")

NEVER = 2**62  # a row count no product reaches
ROW_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TIMED_CALLS = 3  # per form and row count, after one warm-up call; the fastest is kept (the host is shared)
LAYERS = 8  # timed in turn, 4 MiB of codes: more than a core's cache holds, as a model's weights are
INTEGER_TILES, BFLOAT16_TILES = 1, 2  # kvserve::tile_forms()'s bits


@dataclass(frozen=True)
class ProductForms:
    """The input rows from which each tile form runs; below both, vector dot products."""

    integer_tiles_from: int = NEVER
    bfloat16_tiles_from: int = NEVER

    def __post_init__(self) -> None:
        if self.integer_tiles_from < 1 or self.bfloat16_tiles_from < 1:
            raise ValueError(f"row counts must be >= 1, got {self}")

    def described(self) -> str:
        parts = [f"integer tiles from {self.integer_tiles_from} rows" if self.integer_tiles_from < NEVER else "",
                 f"bfloat16 tiles from {self.bfloat16_tiles_from} rows" if self.bfloat16_tiles_from < NEVER else ""]
        return ", ".join(p for p in parts if p) or "dot products at every row count"


@functools.cache  # once per process, as the kernels load
def product_forms() -> ProductForms:
    """This machine's crossovers: read beside the kernels' library once checked (engine/cache_file.py), or
    measured now and written there (a record that cannot be used is measured again)."""
    library = kernels_library()
    if library is None:  # the kernels are off here
        return ProductForms()
    path = library.with_suffix(".forms.json")
    try:
        return recorded(path)
    except CacheMiss as miss:
        if miss.found:
            log.warning("the measured product forms at %s cannot be used (%s): measuring them again", path,
                        miss.reason)
    forms, described = measure()
    log.info("quantized products on this CPU: %s (ms per form for %d layers, by rows: %s)", forms.described(), LAYERS,
             described)
    try:
        cache_file.write(path, json.dumps(asdict(forms)).encode())
    except OSError as error:  # a full disk: this process uses what it measured
        log.warning("the product forms could not be kept in %s (%s)", path, cache_file.describe(error))
        return forms
    try:  # processes that measured at once all use the record that stands (compiled graphs hold its counts)
        return recorded(path)
    except CacheMiss:
        return forms


def recorded(path: Path) -> ProductForms:
    """The forms the record at `path` holds, once checked; CacheMiss if it cannot be used or holds none."""
    data = cache_file.read(path)
    try:
        return ProductForms(**json.loads(data))
    except (ValueError, TypeError) as e:  # a record of another version's fields, say
        raise CacheMiss(path, f"it holds no product forms ({e})", found=True) from None


def measure() -> tuple[ProductForms, str]:
    """The forms this build and process can run, timed on LAYERS layers of 1024 x 1024 4-bit codes; with the
    timings, described."""
    available = torch.ops.kvserve.tile_forms()
    candidates = {"dot": ProductForms()}
    if available & INTEGER_TILES:
        candidates["integer"] = ProductForms(integer_tiles_from=1)
    if available & BFLOAT16_TILES:
        candidates["bfloat16"] = ProductForms(bfloat16_tiles_from=1)
    if len(candidates) == 1:
        return ProductForms(), "no tile forms here"
    generator = torch.Generator().manual_seed(0)
    features, tiles, groups = 1024, 1024 // 16, 1024 // 32
    layers = [(torch.randint(0, 256, (tiles, groups * 256), dtype=torch.uint8, generator=generator),  # the codes
               (torch.rand(tiles, groups, 16, generator=generator) * 0.01).half(),  # scales
               (torch.randn(tiles, groups, 16, generator=generator) * 0.01).half())  # minimums
              for _ in range(LAYERS)]

    def product(x: torch.Tensor, forms: ProductForms) -> None:
        for codes, scale, minimum in layers:
            torch.ops.kvserve.codes4_product(x, codes, scale, minimum, features, forms.integer_tiles_from,
                                             forms.bfloat16_tiles_from)

    timings = {}
    for rows in ROW_COUNTS:
        x = torch.randn(rows, features, generator=generator)
        timings[rows] = {name: fastest(lambda: product(x, forms)) for name, forms in candidates.items()}
    described = "; ".join(f"{rows}: " + "/".join(f"{name} {1e3 * s:.2f}" for name, s in forms.items())
                          for rows, forms in timings.items())
    return crossovers(timings), described


def fastest(call) -> float:
    return min(call_seconds(call, TIMED_CALLS))


def call_seconds(call, calls: int) -> list[float]:
    """The seconds of each of `calls` calls, after one warm-up call (also how engine/two_forms.py times its forms)."""
    call()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def crossovers(timings: dict[int, dict[str, float]]) -> ProductForms:
    """The forms from seconds per form ("dot", "integer", "bfloat16") by row count: bfloat16 tiles from the least
    count from which they are the fastest at every larger count measured; below that, integer tiles from the least
    count from which they beat dot products at every larger one."""
    counts = sorted(timings)
    bfloat16_from = run_start(counts, lambda rows: timings[rows].get("bfloat16") == min(timings[rows].values()))
    below = [rows for rows in counts if rows < bfloat16_from]
    integer_from = run_start(below, lambda rows: timings[rows].get("integer", NEVER) <= timings[rows]["dot"])
    return ProductForms(integer_tiles_from=integer_from, bfloat16_tiles_from=bfloat16_from)


def run_start(counts: list[int], wins) -> int:
    """The least of `counts` (ascending) from which `wins` holds for it and every larger one; NEVER if none."""
    start = NEVER
    for rows in reversed(counts):
        if not wins(rows):
            break
        start = rows
    return start
