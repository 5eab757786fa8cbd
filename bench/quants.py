"""kvserve and llama.cpp on the same GGUF files, side by side in one run: batch-1 and many-stream decode over HTTP,
a long prompt's prefill over HTTP, llama-bench's tg and pp, resident memory, and the read-bandwidth floor.

For each file: kvserve's server and llama-server (`-np N`) one after the other, each given the same streamed load
(`/v1/completions`, greedy, `ignore_eos`); llama-bench's tg on the same file and threads; the machine's read rate
as torch reads a large tensor, from which a token's floor is the file's bytes over that rate (every matrix is read
once per step; a tied embedding is the LM head). Resident memory is each server's VmRSS once warm. Prefill is the
time of a one-token completion of a prompt of about --prefill-tokens (each server says how many it counted),
the best of three, each prompt opening with its own number so that no server reuses a cached prefix.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import time
from pathlib import Path

import httpx
import torch

from bench.common import machine, machine_line, markdown_table, write_results
from bench.families import llama_server, one_stream
from bench.serve import level, local_server

PROMPT = "Once upon a time, in a small village by the sea, there lived"


def read_rate() -> float:
    """Bytes per second at which torch sums a 512 MiB float32 tensor (the best of five)."""
    data = torch.ones(128 << 20)
    data.sum()
    best = min(timed_once(data.sum) for _ in range(5))
    return data.numel() * data.element_size() / best


def timed_once(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def resident_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def many_streams(url: str, streams: int, new_tokens: int) -> float:
    """Tokens per second over 2·streams requests, `streams` at a time."""
    results, seconds = asyncio.run(level(url, streams, 2 * streams, PROMPT, new_tokens))
    return sum(len(r["gaps"]) + 1 for r in results if "error" not in r) / seconds


def load(url: str, args: argparse.Namespace) -> dict:
    result = {"one": one_stream(url, PROMPT, args.new_tokens, args.repeats),
              "prefill": prefill(url, args.prefill_tokens)}
    for streams in args.streams[1:]:
        result[f"{streams} streams"] = many_streams(url, streams, args.new_tokens)
    return result


def prefill(url: str, tokens: int, repeats: int = 3) -> dict:
    """A one-token completion of a prompt of about `tokens` tokens: the best time of `repeats` and the prompt tokens
    the server counted."""
    def complete(prompt: str) -> tuple[float, int]:
        started = time.perf_counter()
        response = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0},
                              timeout=600)
        response.raise_for_status()
        return time.perf_counter() - started, response.json()["usage"]["prompt_tokens"]

    _, per_sentence = complete(PROMPT)
    sentences = max(1, tokens // per_sentence)
    runs = [complete(f"{i}. " + " ".join([PROMPT] * sentences)) for i in range(repeats + 1)][1:]  # the first warms
    return {"seconds": min(s for s, _ in runs), "prompt_tokens": runs[0][1]}


def llama_bench(binary: Path, gguf: Path, threads: int, new_tokens: int, prompt_tokens: int) -> dict:
    """llama-bench's tg`new_tokens` and pp`prompt_tokens`: tokens per second."""
    out = subprocess.run([str(binary), "-m", str(gguf), "-p", str(prompt_tokens), "-n", str(new_tokens),
                          "-t", str(threads), "-o", "json"], capture_output=True, text=True, check=True).stdout
    rates = {(run["n_prompt"], run["n_gen"]): float(run["avg_ts"]) for run in json.loads(out)}
    return {"tg": rates[(0, new_tokens)], "pp": rates[(prompt_tokens, 0)]}


def measure(gguf: Path, args: argparse.Namespace, threads: int) -> dict:
    started: list = []
    server = argparse.Namespace(dtype="auto", max_batch_size=max(args.streams), compile=args.compile, model=str(gguf),
                                quantize="auto", dense_copies="off")
    began = time.perf_counter()
    with local_server(server, ["--prefix-caching", "off", "--max-seq-len", str(args.max_seq_len)], started) as url:
        ready = time.perf_counter() - began
        info = httpx.get(f"{url}/info").json()
        ours = load(url, args) | {"rss": resident_bytes(started[0].pid), "ready_s": ready,
                                  "weights_served": info["weights_served"], "weights_bytes": info["weights_bytes"]}
    result = {"file_bytes": gguf.stat().st_size, "kvserve": ours}
    if args.llama_bin:
        server_binary = args.llama_bin / "llama-server"
        theirs: list = []
        with llama_server(server_binary, gguf, threads, slots=max(args.streams), started=theirs) as url:
            result["llama-server"] = load(url, args) | {"rss": resident_bytes(theirs[0].pid)}
        bench = llama_bench(args.llama_bin / "llama-bench", gguf, threads, args.new_tokens, args.prefill_tokens)
        result["llama-bench tg"], result["llama-bench pp"] = bench["tg"], bench["pp"]
    return result


def rendered(payload: dict) -> str:
    rate = payload["read_rate"]
    rows, prompt = [], payload["prefill_tokens"]
    for name, result in payload["files"].items():
        floor_s = result["file_bytes"] / rate
        for server in ("kvserve", "llama-server"):
            if server not in result:
                continue
            r = result[server]
            one = r["one"]
            per_token = 1 / one["tokens_per_s"]
            many = ", ".join(f"{k}: {v:.1f}" for k, v in r.items() if k.endswith("streams"))
            filled = r["prefill"]
            rows.append([name, server, f"{one['tokens_per_s']:.1f} ({one['inter_token_s'] * 1e3:.1f} ms)",
                         f"{100 * floor_s / per_token:.0f}%", many,
                         f"{filled['seconds']:.2f} s ({filled['prompt_tokens']} tokens)", f"{r['rss'] / 1e9:.2f} GB"])
        if "llama-bench tg" in result:
            tg, pp = result["llama-bench tg"], result["llama-bench pp"]
            rows.append([name, "llama-bench tg, pp", f"{tg:.1f}", f"{100 * floor_s * tg:.0f}%", "",
                         f"{prompt / pp:.2f} s ({prompt} tokens)", ""])
    table = markdown_table(["file", "server", "1 stream tok/s (inter-token)", "of the read floor",
                            "many streams tok/s", "prefill", "resident"], rows)
    served = {name: r["kvserve"]["weights_served"] for name, r in payload["files"].items()}
    return (f"{machine_line(payload['machine'])}; read rate {rate / 1e9:.1f} GB/s, {payload['threads']} threads\n\n"
            f"{table}\n\nkvserve serves: {json.dumps(served)}\n")


def run(args: argparse.Namespace) -> dict:
    threads = args.threads or torch.get_num_threads()
    env = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        names = [gguf.name for gguf in args.gguf]  # or folder/name where two files share a name (model.gguf)
        labels = [f"{g.parent.name}/{g.name}" if names.count(g.name) > 1 else g.name for g in args.gguf]
        files = {label: measure(gguf, args, threads) for label, gguf in zip(labels, args.gguf)}
    finally:
        os.environ.pop("OMP_NUM_THREADS") if env is None else os.environ.update(OMP_NUM_THREADS=env)
    payload = {"machine": machine(), "threads": threads, "read_rate": read_rate(),
               "prefill_tokens": args.prefill_tokens, "files": files}
    table = rendered(payload)
    write_results(args.out, "quants", payload, table)
    print(table)
    return payload
