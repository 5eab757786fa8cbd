"""Load on the HTTP server: N concurrent streaming clients, client-side latencies, and the server's own view."""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch

from bench.common import free_port, machine, machine_line, markdown_table, plot, timed, write_results
from bench.event_stream import HTTPStatusError, events
from weights.loading import load_engine


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def scrape(client: httpx.Client) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name in ("kvserve_generation_tokens_total", "kvserve_prompt_tokens_total"):
                values[sample.name] = sample.value
            elif sample.name == "kvserve_requests_total":
                values["requests"] = values.get("requests", 0) + sample.value
            elif sample.name in ("kvserve_engine_step_seconds_count", "kvserve_engine_step_seconds_sum",
                                 "kvserve_requests_running", "kvserve_requests_waiting"):
                values[sample.name] = sample.value
            elif sample.name == "kvserve_engine_step_seconds_bucket" and sample.labels["le"] == "1.0":
                values["engine_steps_within_1s"] = sample.value
    return values


@contextmanager
def local_server(args: argparse.Namespace, extra: list[str] = (), started: list | None = None):
    """`python -m server` on a free port, until the block ends, with `extra` flags last; yields its URL (and
    appends its process to `started`, when given)."""
    port = free_port()
    command = [sys.executable, "-m", "server", "--port", str(port), "--dtype", args.dtype,
               "--max-batch-size", str(args.max_batch_size), "--max-queue", "1024", "--max-seq-len", "1024",
               "--compile", args.compile]
    if args.model:
        command += ["--model", args.model]
    command += ["--quantize", args.quantize, "--dense-copies", args.dense_copies, *extra]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
    if started is not None:
        started.append(process)
    try:
        # The log lines that say the model is loaded and, when compiling, that the compile thread is done:
        # timings start on the server as it will run from then on.
        done = ("decode compiled for every batch size", "decode stays eager", "compiling the decode step failed")
        for line in process.stdout:
            if "ready:" in line and args.compile == "off" or any(marker in line for marker in done):
                break
            if "failed to load" in line or process.poll() is not None:
                raise RuntimeError(f"the server did not start: {line.strip()}")
        # Keep reading its log: a full pipe would block the server at its next log line (one per request).
        threading.Thread(target=collections.deque, args=(process.stdout, 0), daemon=True).start()
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(60)


async def one_request(url: str, prompt: str, new_tokens: int) -> dict:
    """One streamed /v1/completions request, greedy: when each token's event arrived, and the tokens the usage
    counted; or {"error": why} (a request still streaming after 600 s is one: TimeoutError)."""
    body = {"prompt": prompt, "max_tokens": new_tokens, "stream": True, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    async def read() -> dict | None:
        nonlocal tokens
        async for arrived, chunk in events(url, "/v1/completions", body):
            if "error" in chunk:
                return {"error": chunk["error"]["message"]}
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            else:
                stamps.append(arrived)
        return None

    try:
        if (failed := await asyncio.wait_for(read(), 600)) is not None:
            return failed
    except HTTPStatusError as e:
        return {"error": str(e)}
    except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError) as e:
        return {"error": type(e).__name__}
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"ttft": stamps[0] - started, "gaps": gaps, "e2e": stamps[-1] - started, "tokens": tokens}


async def level(url: str, concurrency: int, requests: int, prompt: str, new_tokens: int) -> tuple[list[dict], float]:
    semaphore = asyncio.Semaphore(concurrency)

    async def limited():
        async with semaphore:
            return await one_request(url, prompt, new_tokens)

    started = time.perf_counter()
    results = await asyncio.gather(*(limited() for _ in range(requests)))
    return results, time.perf_counter() - started


def offline(args: argparse.Namespace, prompt: str, new_tokens: int, rows: int) -> tuple[float, float] | None:
    """The same single request through the engine in this process, for the HTTP overhead ratio (tokens/s), and the
    matrix products alone of one decode step of `rows` sequences (seconds), the floor of that step."""
    if args.url:
        return None
    from bench.decode import matmul_floor
    from engine import EngineConfig, SamplingParams
    from weights.resolve import resolve_model

    engine = load_engine(resolve_model(args.model), EngineConfig(
        dtype=args.dtype, max_batch_size=args.max_batch_size, prefix_caching=False, max_seq_len=1024,
        quantize=args.quantize, dense_copies=args.dense_copies == "on", compile=args.compile))
    engine.compile()  # as the server will decode
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    engine.generate([prompt], params)  # warm-up
    started = time.perf_counter()
    engine.generate([prompt], params)
    return new_tokens / (time.perf_counter() - started), matmul_floor(engine.model, 1, rows).median


def references(args: argparse.Namespace, prompt: str, new_tokens: int) -> dict[str, float]:
    """What the HTTP figures are held against, measured in this run before the server starts (not with --quick
    or --url): llama.cpp's batch-1 decode on the model's GGUF and transformers' batch of 8, in tokens/s."""
    if args.url or args.quick:
        return {}
    from transformers import AutoModelForCausalLM

    from bench import llama_cpp
    from bench.decode import dense_folder
    from engine.device import resolve_dtype
    from engine.tokenizer import Tokenizer
    from weights.gguf_file import WEIGHTS_NAME
    from weights.resolve import resolve_model

    path = resolve_model(args.model)
    ids = Tokenizer.from_dir(path).encode(prompt)
    found = {}
    if llama_cpp.available() and (path / WEIGHTS_NAME).is_file():
        measured = llama_cpp.measure(path / WEIGHTS_NAME, ids, ids, new_tokens, torch.get_num_threads(), repeats=3)
        found["llama.cpp batch 1"] = 1 / measured["decode_per_token_s"]
    with tempfile.TemporaryDirectory() as scratch:
        theirs = AutoModelForCausalLM.from_pretrained(dense_folder(path, Path(scratch)),
                                                      dtype=resolve_dtype(args.dtype, torch.device("cpu"))).eval()
    batch = torch.tensor([ids] * 8)  # (8, prompt)

    @torch.inference_mode()
    def generate(n: int):
        return theirs.generate(batch, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    found["transformers batch 8"] = 8 * new_tokens / timed(lambda: generate(new_tokens), 1).median
    return found


def run(args: argparse.Namespace) -> dict:
    levels = [int(c) for c in args.concurrency.split(",")]
    new_tokens = min(args.new_tokens, 8) if args.quick else args.new_tokens
    prompt = " ".join(["hello"] * args.prompt_tokens)
    offline_tokens_per_s, floor_s = offline(args, prompt, new_tokens, levels[-1]) or (None, None)
    reference = references(args, prompt, new_tokens)
    rows, records = [], []
    # Every request sends the same prompt: with prefix caching all but the first would skip their prefill.
    with (local_server(args, ["--prefix-caching", "off"]) if args.url is None else _given(args.url)) as url:
        with httpx.Client(base_url=url, timeout=60) as client:
            asyncio.run(level(url, 1, 1, prompt, new_tokens))  # warm-up
            before = scrape(client)
            for concurrency in levels:
                requests = args.requests or (concurrency if args.quick else 2 * concurrency)
                results, wall = asyncio.run(level(url, concurrency, requests, prompt, new_tokens))
                ok = [r for r in results if "error" not in r]
                tokens = sum(r["tokens"] for r in ok)
                ttft = [r["ttft"] for r in ok]
                itl = [g for r in ok for g in r["gaps"]]
                e2e = [r["e2e"] for r in ok]
                record = {
                    "concurrency": concurrency, "requests": requests, "errors": len(results) - len(ok),
                    "output_tokens": tokens, "wall_s": wall, "output_tokens_per_s": tokens / wall,
                    "requests_per_s": len(ok) / wall,
                    **{f"{name}_p{q}_s": percentile(values, q) for name, values in
                       (("ttft", ttft), ("itl", itl), ("e2e", e2e)) for q in (50, 90, 99)},
                }
                records.append(record)
                rows.append([concurrency, requests, record["errors"], f"{record['output_tokens_per_s']:.1f}",
                             f"{record['requests_per_s']:.2f}",
                             " / ".join(f"{percentile(ttft, q) * 1e3:.0f}" for q in (50, 90, 99)),
                             " / ".join(f"{percentile(itl, q) * 1e3:.0f}" for q in (50, 90, 99)),
                             " / ".join(f"{percentile(e2e, q):.2f}" for q in (50, 90, 99))])
            after = scrape(client)
    server_view = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    client_tokens = sum(r["output_tokens"] for r in records)
    client_requests = sum(r["requests"] - r["errors"] for r in records)
    single = records[0]["output_tokens_per_s"] if levels[0] == 1 else None
    info = machine()
    lines = [
        f"# Load on the HTTP server ({prompt.count('hello')}-word prompt, {new_tokens} new tokens per request, streaming"
        f", --quantize {args.quantize})",
        "", machine_line(info), "",
        markdown_table(["concurrency", "requests", "errors", "output tokens/s", "requests/s", "TTFT ms p50/p90/p99",
                        "inter-token ms p50/p90/p99", "end-to-end s p50/p90/p99"], rows), "",
        f"Server's /metrics over the run: {server_view.get('kvserve_generation_tokens_total', 0):.0f} tokens and "
        f"{server_view.get('requests', 0):.0f} requests; clients received {client_tokens} tokens in {client_requests} "
        "requests.",
    ]
    if single and len(levels) > 1:
        lines.append(f"Aggregate tokens/s at concurrency {levels[-1]} / concurrency 1: "
                     f"{records[-1]['output_tokens_per_s'] / single:.2f}x.")
    if offline_tokens_per_s and single:
        lines.append(f"One request over HTTP: {single:.1f} tokens/s; the same request offline in the engine: "
                     f"{offline_tokens_per_s:.1f} tokens/s (HTTP / offline = {single / offline_tokens_per_s:.2f}).")
    if floor_s:
        lines.append(f"The matrix products alone of one decode step of {levels[-1]} sequences: {floor_s * 1e3:.1f} ms, "
                     f"at most {levels[-1] / floor_s:.0f} tokens/s with these kernels.")
    if reference:
        lines += ["", "Measured in this run, before the server started (output tokens/s):"]
        lines += [f"- {name}: {tps:.1f}; kvserve over HTTP at concurrency " + ", ".join(
            f"{r['concurrency']}: {r['output_tokens_per_s'] / tps:.2f}x" for r in records)
            for name, tps in reference.items()]
    table = "\n".join(lines)
    payload = {"machine": info, "new_tokens": new_tokens, "levels": records, "server_view": server_view,
               "client_tokens": client_tokens, "client_requests": client_requests, "offline_tokens_per_s": offline_tokens_per_s,
               "products_floor_s": floor_s,
               "references_tokens_per_s": reference}
    write_results(args.out, "serve", payload, table)
    plot(args.out, "serve", "HTTP streaming throughput", "concurrent streams", "output tokens/s (all streams)",
         {"output tokens/s": (levels, [r["output_tokens_per_s"] for r in records])}, logx=True)
    plot(args.out, "serve_latency", "HTTP streaming latency (medians)", "concurrent streams", "ms",
         {"time to first token": (levels, [r["ttft_p50_s"] * 1e3 for r in records]),
          "inter-token latency": (levels, [r["itl_p50_s"] * 1e3 for r in records])}, logx=True, logy=True)
    print(table)
    return payload


@contextmanager
def _given(url: str):
    yield url
