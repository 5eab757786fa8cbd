"""Cached incremental decode vs recomputing the whole prefix for every new token (no KV cache)."""

from __future__ import annotations

import argparse


from bench.common import machine, machine_line, markdown_table, plot, timed, write_results
from bench.synthetic import default_shape, random_engine
from engine import SamplingParams
from engine.device import DTYPES


def run(args: argparse.Namespace) -> dict:
    dtype = DTYPES[args.dtype]
    positions = (32, 64, 128) if args.quick else (64, 256, 1024)
    config = default_shape(num_layers=6) if args.quick else default_shape()
    engine = random_engine(config, dtype, slots=1, max_seq_len=max(positions) + 64)
    repeats = 2 if args.quick else 3
    rows, records = [], []
    cached_ms, recompute_ms = [], []
    for position in positions:
        prefix = [(7 * i) % config.vocab_size for i in range(position)]
        request = engine.add_request(prefix, SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True))
        while not request.output_ids:
            engine.step()  # prefill, a chunk per step: `position` tokens in the cache

        def decode_one():
            engine.step()  # one new token against the cached prefix

        cached = timed(decode_one, repeats * 3, warmup=1)
        engine.abort(request.request_id)
        # Without a cache every token is a forward pass over the whole prefix (logits for the last position only).
        recompute = timed(lambda: engine.prompt_logits(prefix, last_only=True), repeats, warmup=1)
        ratio = recompute.median / cached.median
        cached_ms.append(cached.median * 1e3)
        recompute_ms.append(recompute.median * 1e3)
        rows.append([position, cached.ms(), recompute.ms(), f"{ratio:.1f}x"])
        records.append({"position": position, "cached": cached.as_dict(), "recompute": recompute.as_dict(),
                        "speedup": ratio})
    info = machine()
    table = "\n".join([
        f"# Cached decode vs recompute ({config.num_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_heads}q/{config.num_kv_heads}kv heads, random weights, {args.dtype})", "", machine_line(info), "",
        "Time for the token at each position: one decode step over the cache vs a forward over the whole prefix; "
        "median (min-max) in ms.", "",
        markdown_table(["position", "cached ms/token", "recompute ms/token", "recompute / cached"], rows),
    ])
    payload = {"machine": info, "dtype": args.dtype, "layers": config.num_layers, "rows": records}
    write_results(args.out, "cache", payload, table)
    plot(args.out, "cache", "Time per token: KV cache vs recompute", "position (tokens before the new one)",
         "ms per token", {"cached decode": (list(positions), cached_ms), "recompute prefix": (list(positions), recompute_ms)},
         logx=True, logy=True)
    print(table)
    return payload
