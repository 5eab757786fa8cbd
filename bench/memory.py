"""KV-cache memory of MHA, GQA and MQA for one model shape: the formula, what is allocated, what fits."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from bench.common import machine, machine_line, markdown_table, plot, write_results
from bench.synthetic import default_shape
from engine import ModelConfig
from engine.device import DTYPES
from engine.kv_cache import KVCache, format_bytes

BUDGETS = {"1 GiB": 1 << 30, "8 GiB": 8 << 30, "80 GiB": 80 << 30}


def shape(args: argparse.Namespace) -> ModelConfig:
    if args.model:
        from weights.checkpoint import load_config
        from weights.resolve import resolve_model

        base = load_config(resolve_model(args.model))
    else:
        base = default_shape()
    overrides = {k: v for k, v in (("num_layers", args.layers), ("num_heads", args.heads), ("head_dim", args.head_dim))
                 if v is not None}
    if "num_heads" in overrides:
        overrides["num_kv_heads"] = overrides["num_heads"]
    return dataclasses.replace(base, **overrides)


def variants(config: ModelConfig) -> dict[str, int]:
    """name -> h_kv: every query head its own K/V, a GQA grouping, one shared K/V head."""
    h = config.num_heads
    if 1 < config.num_kv_heads < h:
        gqa = config.num_kv_heads
    else:
        gqa = next((h // g for g in (3, 4, 2) if h % g == 0 and h // g > 1), 1)
    return {"MHA": h, f"GQA ({h}q/{gqa}kv)": gqa, "MQA": 1}


def resident_bytes() -> int:
    statm = Path("/proc/self/statm")
    return int(statm.read_text().split()[1]) * 4096 if statm.is_file() else 0


def measure(config: ModelConfig, slots: int, positions: int, dtype: torch.dtype, max_alloc: int) -> dict:
    itemsize = torch.empty((), dtype=dtype).element_size()
    formula = 2 * slots * config.num_layers * positions * config.num_kv_heads * config.head_dim * itemsize
    row = {"B": slots, "T": positions, "h_kv": config.num_kv_heads, "formula_bytes": formula,
           "allocated_bytes": None, "rss_growth_bytes": None, "cuda_allocated_bytes": None}
    if formula > max_alloc:
        return row  # reported from the formula alone
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    before_rss = resident_bytes()
    before_cuda = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    cache = KVCache(config, slots, positions, device, dtype)
    row["allocated_bytes"] = cache.storage.untyped_storage().nbytes()
    if device.type == "cuda":
        row["cuda_allocated_bytes"] = torch.cuda.memory_allocated() - before_cuda
    else:
        row["rss_growth_bytes"] = resident_bytes() - before_rss
    del cache
    return row


def run(args: argparse.Namespace) -> dict:
    config = shape(args)
    dtype = DTYPES[args.dtype]
    slots_grid = (1, 4) if args.quick else (1, 8, 16)
    positions_grid = (256, 1024) if args.quick else (512, 2048, 8192)
    max_alloc = 10 << 30  # larger rows are reported from the formula (this machine has 24 GiB)
    rows, records = [], []
    series: dict[str, tuple[list, list]] = {}
    for name, h_kv in variants(config).items():
        variant = dataclasses.replace(config, num_kv_heads=h_kv)
        for slots in slots_grid:
            for positions in positions_grid:
                r = measure(variant, slots, positions, dtype, max_alloc)
                mha = r["formula_bytes"] * config.num_heads // h_kv
                r |= {"variant": name, "ratio_to_mha": r["formula_bytes"] / mha,
                      "sequences_fit": {label: budget // (r["formula_bytes"] // slots) for label, budget in BUDGETS.items()}}
                records.append(r)
                growth = r["cuda_allocated_bytes"] if r["cuda_allocated_bytes"] is not None else r["rss_growth_bytes"]
                rows.append([name, slots, positions, f"{r['formula_bytes']:,}",
                             f"{r['allocated_bytes']:,}" if r["allocated_bytes"] is not None else "not allocated (> 10 GiB)",
                             format_bytes(growth) if growth else "-", f"{r['ratio_to_mha']:.3f}",
                             " / ".join(str(n) for n in r["sequences_fit"].values())])
                if slots == slots_grid[-1]:
                    series.setdefault(name, ([], []))
                    series[name][0].append(positions)
                    series[name][1].append(r["formula_bytes"] / (1 << 20))
    info = machine()
    table = "\n".join([
        f"# KV cache memory: {config.num_layers} layers, {config.num_heads} query heads x {config.head_dim}, {args.dtype}",
        "", machine_line(info), "",
        "Formula 2·B·L·T·h_kv·d_h·itemsize; allocated = the cache tensor's storage; growth = process RSS (CPU) or "
        "torch.cuda.memory_allocated (CUDA) across the allocation; fit = sequences of T tokens in "
        + " / ".join(BUDGETS) + ".", "",
        markdown_table(["variant", "B", "T", "formula bytes", "allocated bytes", "growth", "ratio to MHA",
                        "sequences that fit"], rows),
    ])
    payload = {"machine": info, "shape": dataclasses.asdict(config), "dtype": args.dtype, "rows": records}
    write_results(args.out, "memory", payload, table)
    plot(args.out, "memory", f"KV cache size vs context (B = {slots_grid[-1]}, {args.dtype})", "T (positions per slot)",
         "KV cache (MiB)", series, logx=True, logy=True)
    print(table)
    return payload
