"""Storms and overload: clients that drop their streams, and more requests at once than the server takes.

- A storm opens S streams together, reads each one's first token, and drops them all. The server must notice
  every dropped client and free its slot: after each storm, /metrics is read until no request runs or waits
  (or 60 s pass); a slot still held then is a leak.
- Overload sends R requests at once to a server with a short queue (--max-queue Q), twice: every answer must be a
  200 or a 429 with Retry-After, and the server's memory (RSS) must stay flat across the second burst (the
  first warms the allocator's pools).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter

import httpx

from bench.common import machine, machine_line, write_results
from bench.serve import local_server, scrape
from bench.soak import rss_mib

SETTLE_S = 60.0  # how long a storm's slots may take to come free before they count as leaked


def held(client: httpx.Client) -> tuple[float, float]:
    """(requests running, requests waiting) from the server's /metrics."""
    values = scrape(client)
    return values["kvserve_requests_running"], values["kvserve_requests_waiting"]


async def storm(url: str, streams: int, new_tokens: int) -> int:
    """Open `streams` streams at once, read each until its first token, drop them all; returns how many streamed."""
    body = {"prompt": "the storm drops this stream", "max_tokens": new_tokens, "stream": True, "ignore_eos": True}
    first = 0
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=streams)) as client:
        async def one() -> None:
            nonlocal first
            async with client.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data:"):
                        first += 1
                        return  # leaving the block closes the connection mid-stream

        await asyncio.gather(*(one() for _ in range(streams)))
    return first


def settle(client: httpx.Client) -> tuple[float, float, float]:
    """Polls /metrics until nothing runs or waits, or SETTLE_S pass: (running, waiting, seconds taken)."""
    started = time.perf_counter()
    while True:
        running, waiting = held(client)
        elapsed = time.perf_counter() - started
        if running == waiting == 0 or elapsed > SETTLE_S:
            return running, waiting, elapsed
        time.sleep(0.05)


async def burst(url: str, requests: int, new_tokens: int) -> list[tuple[int, bool]]:
    """`requests` non-streamed completions at once: (status, has Retry-After) of each."""
    body = {"prompt": "one of many at once", "max_tokens": new_tokens, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=requests)) as client:
        async def one() -> tuple[int, bool]:
            response = await client.post("/v1/completions", json=body)
            return response.status_code, "retry-after" in response.headers

        return await asyncio.gather(*(one() for _ in range(requests)))


def run(args: argparse.Namespace) -> dict:
    storms, streams = (1, 16) if args.quick else (args.storms, args.streams)
    requests = 40 if args.quick else args.requests
    storm_rows = []
    with local_server(args) as url, httpx.Client(base_url=url, timeout=60) as client:  # a queue for every stream
        for index in range(storms):
            streamed = asyncio.run(storm(url, streams, args.new_tokens))
            running, waiting, seconds = settle(client)
            storm_rows.append({"storm": index + 1, "streams": streams, "streamed": streamed,
                               "leaked_slots": running, "left_waiting": waiting, "settle_s": seconds})
    started: list = []
    with local_server(args, ["--max-queue", str(args.max_queue)], started=started) as url:
        pid = started[0].pid
        with httpx.Client(base_url=url, timeout=60) as client:
            answers = asyncio.run(burst(url, requests, args.new_tokens))  # the first burst warms the allocator's pools
            settle(client)
            rss_before = rss_mib(pid)
            answers += asyncio.run(burst(url, requests, args.new_tokens))
            settle(client)
            rss_after = rss_mib(pid)
            health = client.get("/health").status_code
    statuses = Counter(status for status, _ in answers)
    refused_without_retry = sum(1 for status, retry in answers if status == 429 and not retry)
    payload = {
        "machine": machine(), "storms": storm_rows, "leaked_slots": sum(r["leaked_slots"] for r in storm_rows),
        "overload": {"requests": 2 * requests, "max_queue": args.max_queue, "statuses": dict(statuses),
                     "only_200_and_429": set(statuses) <= {200, 429}, "429_without_retry_after": refused_without_retry,
                     "rss_mib_before": rss_before, "rss_mib_after": rss_after,
                     "rss_growth_pct": (rss_after - rss_before) / rss_before * 100, "health_after": health},
    }
    overload = payload["overload"]
    lines = [f"# Storms of dropped streams, and overload (python -m server --max-batch-size {args.max_batch_size} "
             f"--max-queue {args.max_queue} --quantize {args.quantize} --compile {args.compile})", "",
             machine_line(payload["machine"]), "",
             "| storm | streams opened and dropped | got a first token | slots still held | still waiting | "
             "settled in s |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['storm']} | {r['streams']} | {r['streamed']} | {r['leaked_slots']:.0f} | {r['left_waiting']:.0f} "
              f"| {r['settle_s']:.2f} |" for r in storm_rows]
    lines += ["", f"Overload: {requests} requests at once, twice; answers {', '.join(f'{k}: {v}' for k, v in sorted(statuses.items()))} "
              f"({refused_without_retry} 429s without Retry-After); server RSS across the second burst {rss_before:.0f} -> "
              f"{rss_after:.0f} MiB ({overload['rss_growth_pct']:+.2f}%); /health afterwards: {health}."]
    table = "\n".join(lines)
    write_results(args.out, "storm", payload, table)
    print(table)
    return payload
