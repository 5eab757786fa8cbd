"""Decode and prefill speed of MHA, GQA and MQA with random weights of one shape.

Drives the model and its cache directly (no scheduler): every row of a batch decodes at the given
context, the cache already filled with that many positions, so the context costs no prefill here.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from bench.common import machine, machine_line, markdown_table, plot, timed, write_results
from bench.memory import variants
from bench.synthetic import default_shape, random_model
from engine.batch import DecodeBatch, PrefillBatch
from engine.device import DTYPES
from engine.kv_cache import KVCache
from engine.rope import RotaryTable


def run(args: argparse.Namespace) -> dict:
    dtype = DTYPES[args.dtype]
    base = default_shape(num_layers=6) if args.quick else default_shape()
    contexts = (128, 1024) if args.quick else (128, 1024, 4096)
    batches = (1, 4) if args.quick else (1, 4, 8, 16)
    prefill_tokens = 128 if args.quick else 512
    repeats = 3 if args.quick else 5
    cpu = torch.device("cpu")
    rows, records = [], []
    series: dict[str, tuple[list, list]] = {}
    for name, h_kv in variants(base).items():
        config = dataclasses.replace(base, num_kv_heads=h_kv)
        model = random_model(config, dtype)  # planned as an engine runs it
        capacity = max(contexts) + 1
        cache = KVCache(config, max(batches), capacity, cpu, dtype)
        cache.storage.normal_()  # stands in for a filled prefix: the values do not change the cost
        rotary = RotaryTable(config, capacity, cpu, dtype)
        with torch.inference_mode():
            prefill = timed(lambda: model(torch.zeros(1, prefill_tokens, dtype=torch.long), rotary, cache,
                                          PrefillBatch([0], [0], [prefill_tokens], cpu)), max(1, repeats // 2))
            for context in contexts:
                for batch in batches:
                    step = DecodeBatch(list(range(batch)), [context] * batch, cpu)
                    tokens = torch.zeros(batch, 1, dtype=torch.long)
                    t = timed(lambda: model.logits(model(tokens, rotary, cache, step)[:, 0]), repeats)
                    record = {"variant": name, "h_kv": h_kv, "context": context, "batch": batch,
                              "step": t.as_dict(), "tokens_per_s": batch / t.median}
                    records.append(record)
                    rows.append([name, context, batch, t.ms(), f"{batch / t.median:.1f}"])
                    if batch == batches[-1]:
                        series.setdefault(name, ([], []))
                        series[name][0].append(context)
                        series[name][1].append(batch / t.median)
        records.append({"variant": name, "prefill_tokens": prefill_tokens, "prefill": prefill.as_dict(),
                        "prefill_tokens_per_s": prefill_tokens / prefill.median})
        rows.append([name, f"prefill {prefill_tokens}", 1, prefill.ms(), f"{prefill_tokens / prefill.median:.1f}"])
    info = machine()
    table = "\n".join([
        f"# Speed of MHA vs GQA vs MQA ({base.num_layers} layers, hidden {base.hidden_size}, {base.num_heads} query "
        f"heads x {base.head_dim}, random weights, {args.dtype})", "", machine_line(info), "",
        "One decode step (every row at the given context) or one prefill; median (min-max) of "
        f"{repeats} runs in ms.", "",
        markdown_table(["variant", "context", "batch", "step ms", "tokens/s"], rows),
    ])
    payload = {"machine": info, "dtype": args.dtype, "layers": base.num_layers, "rows": records}
    write_results(args.out, "speed", payload, table)
    plot(args.out, "speed", f"Decode throughput at batch {batches[-1]} ({args.dtype})", "context (tokens)",
         "tokens/s", series, logx=True)
    print(table)
    return payload
