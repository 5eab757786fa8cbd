"""What the planner measured on this machine, kept in one record per machine so that every start decides the same.

Two kinds of measurement, both of whole products on data shaped as a model's:
- product forms: kvserve::codes4_product and codes8_product (engine/linear/native/group_product.h) run in
  one of three forms, vector dot products (AVX2 or AVX512-VNNI), AMX's integer tiles (one tile product per
  group for up to 16 input rows) or AMX's bfloat16 tiles (the weights dequantized once per call, then summed
  over every group in the tile registers). A tile product's loads and stores are not repaid by a few rows, and
  dequantizing every weight pays off only over many, so the forms are timed against each other at row counts
  from 1 to 256 and the counts where they cross are kept.
- switches: the row count from which a dense form of a quantized matrix (TwoForms) beats its codes, by kind
  and shape of both forms.

The record is a cache file (engine/cache_file.py) in the compiled-code cache, named by the CPU, torch and the
kernels' library: every later process on the machine reads the same counts, so compiled graphs, which hold
them as constants (the forms' row counts), stay the same from one start to the next. One
that is damaged is measured again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from engine import cache_file
from engine.cache_file import CacheMiss

log = logging.getLogger("kvserve.timing")

NEVER = 2**62  # a row count no product reaches
ROW_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # where forms and switches are timed
TIMED_CALLS = 3  # per form and row count, after one warm-up call
FORM_LAYERS = 8  # timed in turn, 4 MiB of codes: more than a core's cache holds, as a model's weights are
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


class Timings:
    """The machine's record: {"forms": ProductForms' fields, "switches": {key: rows or None}}.

    path None: held in memory only (tests give their own values this way).
    """

    def __init__(self, path: Path | None, values: dict | None = None):
        self.path = path
        self.values = {"forms": None, "switches": {}} | (values or {})
        if path is not None and values is None:
            self.values |= self._read()

    @classmethod
    def for_machine(cls, kernels: Path | None) -> "Timings":
        """The record for this CPU, torch and kernels' library (`kernels`, None where they are off)."""
        from engine.device import cpu_description

        key = hashlib.sha256("\n".join([cpu_description() or platform.processor(), torch.__version__,
                                        kernels.name if kernels else "torch's kernels only"]).encode())
        return cls(cache_file.compiled_root() / f"timings-{key.hexdigest()[:20]}.json")

    def forms(self, measure: Callable[[], tuple[ProductForms, str]]) -> ProductForms:
        """The recorded product forms, or `measure()`'s (forms, timings described), then recorded."""
        if self.values["forms"] is None:
            forms, described = measure()
            log.info("quantized products on this CPU: %s (ms per form for %d layers, by rows: %s)", forms.described(),
                     FORM_LAYERS, described)
            self._record({"forms": asdict(forms)})
        return ProductForms(**self.values["forms"])

    def switch(self, key: str, measure: Callable[[], dict[int, tuple[float, float]]]) -> int | None:
        """The recorded switch for `key`, or the one `measure()`'s seconds (codes, dense) by rows give, recorded."""
        if key not in self.values["switches"]:
            timings = measure()
            log.info("%s: ms codes/dense by rows: %s", key, described(timings))
            self._record({"switches": {key: dense_from(timings)}})
        return self.values["switches"][key]

    def _read(self, warn: bool = True) -> dict:
        try:
            values = json.loads(cache_file.read(self.path))
            ProductForms(**(values["forms"] or {}))  # a record of another version's fields fails here
            if not isinstance(values["switches"], dict):
                raise TypeError("switches is not a table")
            return values
        except CacheMiss as miss:
            if miss.found and warn:
                log.warning("the measured timings at %s cannot be used (%s): measuring them again", self.path,
                            miss.reason)
        except (ValueError, TypeError, KeyError) as e:
            if warn:
                log.warning("the measured timings at %s cannot be used (it holds no timings: %s): measuring them "
                            "again", self.path, e)
        return {}

    def _record(self, update: dict) -> None:
        """Merge `update` into the record on disk, what stands there first: processes that measured at once all
        use one value (compiled graphs hold it)."""
        standing = self._read(warn=False) if self.path is not None else {}
        self.values = {"forms": standing.get("forms") or update.get("forms") or self.values["forms"],
                       "switches": self.values["switches"] | update.get("switches", {}) | standing.get("switches", {})}
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            cache_file.write(self.path, json.dumps(self.values, sort_keys=True).encode())
        except OSError as error:  # a full disk: this process uses what it measured
            log.warning("the measured timings could not be kept in %s (%s)", self.path, cache_file.describe(error))


def measure_forms() -> tuple[ProductForms, str]:
    """The forms this build and process can run, timed on FORM_LAYERS layers of 1024 x 1024 4-bit codes; with the
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
              for _ in range(FORM_LAYERS)]

    def product(x: torch.Tensor, forms: ProductForms) -> None:
        for codes, scale, minimum in layers:
            torch.ops.kvserve.codes4_product(x, codes, scale, minimum, features, forms.integer_tiles_from,
                                             forms.bfloat16_tiles_from)

    timings = {}
    for rows in ROW_COUNTS:
        x = torch.randn(rows, features, generator=generator)
        timings[rows] = {name: min(call_seconds(lambda: product(x, forms), TIMED_CALLS))
                         for name, forms in candidates.items()}
    described = "; ".join(f"{rows}: " + "/".join(f"{name} {1e3 * s:.2f}" for name, s in forms.items())
                          for rows, forms in timings.items())
    return crossovers(timings), described


@torch.inference_mode()
def measure_switch(codes: torch.nn.Module, dense: torch.nn.Module) -> dict[int, tuple[float, float]]:
    """Median seconds of one product through each form, (codes, dense), by row count."""
    def seconds(layer: torch.nn.Module, rows: int) -> float:
        x = torch.randn(rows, layer.in_features, dtype=layer.activation_dtype)
        return statistics.median(call_seconds(lambda: layer(x), TIMED_CALLS))

    return {rows: (seconds(codes, rows), seconds(dense, rows)) for rows in ROW_COUNTS}


def call_seconds(call, calls: int) -> list[float]:
    """The seconds of each of `calls` calls, after one warm-up call."""
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


def dense_from(timings: dict[int, tuple[float, float]]) -> int | None:
    """The fewest measured rows from which the dense form (second) was faster at every larger count, or None."""
    start = run_start(sorted(timings), lambda rows: timings[rows][1] < timings[rows][0])
    return None if start == NEVER else start


def run_start(counts: list[int], wins) -> int:
    """The least of `counts` (ascending) from which `wins` holds for it and every larger one; NEVER if none."""
    start = NEVER
    for rows in reversed(counts):
        if not wins(rows):
            break
        start = rows
    return start


def described(timings: dict[int, tuple[float, float]]) -> str:
    return ", ".join(f"{rows}: {c * 1e3:.2f}/{d * 1e3:.2f}" for rows, (c, d) in timings.items())
