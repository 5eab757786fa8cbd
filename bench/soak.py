"""A soak: C clients send mixed requests for N minutes; errors, memory, latency per window, and the metrics' view.

Each client loops: a random route (TGI /generate, OpenAI completions or chat), streamed or not, a random prompt
of about 5-200 tokens, 4-128 new tokens, greedy or sampled. Streams give inter-token gaps, grouped in 30 s windows by
when each gap ended. The server's resident memory is read from /proc every 5 s; growth is measured from the end
of the first window (warm-up: the model, allocator pools and compiled code settle) to the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from pathlib import Path

import httpx

from bench.common import machine, machine_line, markdown_table, plot, write_results
from bench.prefix import WORDS, words_per_token
from bench.serve import local_server, percentile, scrape

WINDOW_S = 30.0


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def random_request(rng: random.Random, words_per_token: float) -> tuple[str, dict, bool]:
    """(path, body, streamed) of one random request."""
    text = " ".join(rng.choice(WORDS) for _ in range(max(1, int(rng.randint(5, 200) * words_per_token))))
    tokens, stream = rng.randint(4, 128), rng.random() < 0.7
    sampling = {"temperature": 0.8, "seed": rng.randrange(1 << 30)} if rng.random() < 0.5 else {"temperature": 0}
    route = rng.choice(["tgi", "completions", "chat"])
    if route == "tgi":
        parameters = {"max_new_tokens": tokens, "details": True} | (
            {"do_sample": True, **sampling} if sampling["temperature"] else {})
        return "/generate", {"inputs": text, "parameters": parameters, "stream": stream}, stream
    body = {"max_tokens": tokens, "stream": stream, **sampling}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if route == "chat":
        return "/v1/chat/completions", body | {"messages": [{"role": "user", "content": text}]}, stream
    return "/v1/completions", body | {"prompt": text}, stream


async def send(client: httpx.AsyncClient, path: str, body: dict, stream: bool) -> dict:
    """Status, tokens received and token arrival times of one request."""
    if not stream:
        response = await client.post(path, json=body)
        if response.status_code != 200:
            return {"status": response.status_code, "tokens": 0, "stamps": []}
        result = response.json()
        tokens = result["details"]["generated_tokens"] if path == "/generate" else result["usage"]["completion_tokens"]
        return {"status": 200, "tokens": tokens, "stamps": []}
    stamps, tokens, status = [], 0, 200
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            return {"status": response.status_code, "tokens": 0, "stamps": []}
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            chunk = json.loads(line.removeprefix("data:"))
            if "error" in chunk:
                status = "stream error"
            elif chunk.get("usage") and not chunk.get("choices"):
                tokens = chunk["usage"]["completion_tokens"]
            elif path == "/generate":
                tokens += 1
                stamps.append(time.perf_counter())
            else:
                stamps.append(time.perf_counter())
    return {"status": status, "tokens": tokens, "stamps": stamps}


async def soak(url: str, pid: int, minutes: float, concurrency: int, seed: int) -> dict:
    words = words_per_token(url)
    deadline = time.perf_counter() + minutes * 60
    records: list[dict] = []
    memory: list[tuple[float, float]] = []
    started = time.perf_counter()

    async def client_loop(index: int, client: httpx.AsyncClient) -> None:
        rng = random.Random(seed * 1000 + index)
        while time.perf_counter() < deadline:
            path, body, stream = random_request(rng, words)
            try:
                records.append(await send(client, path, body, stream))
            except httpx.HTTPError as e:
                records.append({"status": type(e).__name__, "tokens": 0, "stamps": []})

    async def watch_memory() -> None:
        while time.perf_counter() < deadline:
            memory.append((time.perf_counter() - started, rss_mib(pid)))
            await asyncio.sleep(5)

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        await asyncio.gather(watch_memory(), *(client_loop(i, client) for i in range(concurrency)))
    memory.append((time.perf_counter() - started, rss_mib(pid)))
    return {"records": records, "memory": memory, "started": started}


def windows(records: list[dict], started: float, seconds: float) -> list[dict]:
    """Inter-token gaps grouped by the window in which each gap ended; whole windows of the run only (after its
    end, the last requests finish with fewer clients sending)."""
    gaps: dict[int, list[float]] = {}
    for record in records:
        for a, b in zip(record["stamps"], record["stamps"][1:]):
            gaps.setdefault(int((b - started) // WINDOW_S), []).append(b - a)
    gaps = {w: g for w, g in gaps.items() if (w + 1) * WINDOW_S <= max(seconds, WINDOW_S)}
    return [{"window": w, "start_s": w * WINDOW_S, "gaps": len(gaps[w]), "p50_ms": percentile(gaps[w], 50) * 1e3,
             "p99_ms": percentile(gaps[w], 99) * 1e3} for w in sorted(gaps)]


def run(args: argparse.Namespace) -> dict:
    minutes = 0.5 if args.quick else args.minutes
    concurrency = min(args.concurrency, 4) if args.quick else args.concurrency
    server_args = argparse.Namespace(**vars(args) | {"max_batch_size": concurrency})
    started: list = []
    with local_server(server_args, ["--max-seq-len", "1024"], started=started) as url:
        process = started[0]
        with httpx.Client(base_url=url, timeout=60) as client:
            before = scrape(client)
            result = asyncio.run(soak(url, process.pid, minutes, concurrency, seed=0))
            after = scrape(client)
    records, memory = result["records"], result["memory"]
    statuses = Counter(str(r["status"]) for r in records)
    errors = sum(n for status, n in statuses.items() if status != "200")
    client_tokens = sum(r["tokens"] for r in records if r["status"] == 200)
    server_tokens = after["kvserve_generation_tokens_total"] - before["kvserve_generation_tokens_total"]
    rows = windows(records, result["started"], minutes * 60)
    steps = after["kvserve_engine_step_seconds_count"] - before["kvserve_engine_step_seconds_count"]
    step_seconds = after["kvserve_engine_step_seconds_sum"] - before["kvserve_engine_step_seconds_sum"]
    slow_steps = steps - (after["engine_steps_within_1s"] - before["engine_steps_within_1s"])
    warm = next((rss for t, rss in memory if t >= WINDOW_S), memory[-1][1]) if memory else float("nan")
    end = memory[-1][1] if memory else float("nan")
    steady = rows[1:] or rows  # the first window includes warm-up
    payload = {
        "machine": machine(), "minutes": minutes, "concurrency": concurrency, "requests": len(records),
        "errors": errors, "statuses": dict(statuses), "client_tokens": client_tokens, "server_tokens": server_tokens,
        "tokens_agree": client_tokens == server_tokens, "rss_mib_warm": warm, "rss_mib_end": end,
        "rss_growth_pct": (end - warm) / warm * 100,
        "itl_p99_ms_first_window": steady[0]["p99_ms"] if steady else None,
        "itl_p99_ms_last_window": steady[-1]["p99_ms"] if steady else None,
        "engine_steps": steps, "engine_step_mean_ms": step_seconds / steps * 1e3 if steps else None,
        "engine_steps_over_1s": slow_steps, "windows": rows, "memory": memory,
    }
    median_p99 = percentile([w["p99_ms"] for w in steady], 50) if steady else float("nan")
    table = "\n".join([
        f"# Soak: {concurrency} clients for {minutes:g} minutes (python -m server --quantize {args.quantize} "
        f"--compile {args.compile})", "", machine_line(payload["machine"]), "",
        f"{len(records)} requests, {errors} errors ({', '.join(f'{k}: {v}' for k, v in sorted(statuses.items()))}); "
        f"clients received {client_tokens} tokens, the server's metrics counted {server_tokens}.", "",
        f"Server memory (RSS): {warm:.0f} MiB after the first {WINDOW_S:g} s, {end:.0f} MiB at the end "
        f"({payload['rss_growth_pct']:+.2f}%).", "",
        f"Engine steps (the server's kvserve_engine_step_seconds): {steps:.0f}, {payload['engine_step_mean_ms'] or 0:.1f} ms "
        f"on average, {slow_steps:.0f} over 1 s.", "",
        markdown_table(["window", "from s", "gaps", "inter-token p50 ms", "p99 ms"],
                       [[w["window"], f"{w['start_s']:.0f}", w["gaps"], f"{w['p50_ms']:.1f}", f"{w['p99_ms']:.1f}"]
                        for w in rows]), "",
        f"p99 of the first steady window {payload['itl_p99_ms_first_window'] or float('nan'):.1f} ms, of the last "
        f"{payload['itl_p99_ms_last_window'] or float('nan'):.1f} ms; largest window p99 / median window p99: "
        f"{max((w['p99_ms'] for w in steady), default=float('nan')) / median_p99:.2f}.",
    ])
    write_results(args.out, "soak", payload, table)
    plot(args.out, "soak", "Soak: inter-token latency per window", "window start (s)", "ms",
         {"p50": ([w["start_s"] for w in rows], [w["p50_ms"] for w in rows]),
          "p99": ([w["start_s"] for w in rows], [w["p99_ms"] for w in rows])})
    print(table)
    return payload
