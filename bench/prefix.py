"""Prefix caching and chunked prefill on the HTTP server, on vs off in the same run.

Three scenarios, each on a server of its own for each setting of `--prefix-caching`:
- chat: a 10-turn conversation whose history grows to about 1,500 tokens; time to first token per turn;
- shared: 16 concurrent chat requests behind one ~1,000-token system prompt; the prompt tokens the server
  computed (its prefix-cache counters: queried - hit) and the time until all 16 had a first token;
- arrival (prefix caching on only: chunked prefill does not depend on it): one stream decoding while a
  ~2,000-token prompt arrives; the stream's largest gap vs one prefill chunk plus one decode step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import httpx

from bench.common import machine, machine_line, markdown_table, plot, write_results
from bench.serve import local_server

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact river mountain city music story garden window paper "
         "science history market energy letter winter summer morning evening question answer reason idea").split()
MAX_SEQ_LEN = 2560


def text(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def words_per_token(url: str) -> float:
    """The served tokenizer's words per token on this bench's text, so sizes are set in tokens."""
    sample = text(400, seed=-1)
    return 400 / len(httpx.post(f"{url}/tokenize", json={"inputs": sample}).json())


async def chat_request(client: httpx.AsyncClient, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat completion: time to first token, the text, and usage (prompt and cached tokens)."""
    body = {"model": "kvserve", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    started, first, pieces, usage = time.perf_counter(), None, [], {}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif chunk["choices"]:
                first = first or time.perf_counter()
                pieces.append(chunk["choices"][0]["delta"].get("content") or "")
    return {"ttft": first - started, "text": "".join(pieces), "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}


async def chat(url: str, turns: int, turn_words: int, new_tokens: int) -> list[dict]:
    """A conversation of `turns` user messages of `turn_words` words, each answered before the next."""
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    records = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for turn in range(turns):
            messages.append({"role": "user", "content": text(turn_words, seed=turn)})
            record = await chat_request(client, messages, new_tokens)
            messages.append({"role": "assistant", "content": record.pop("text")})
            records.append(record)
    return records


def prefix_counters(url: str) -> tuple[float, float]:
    from prometheus_client.parser import text_string_to_metric_families

    values = {s.name: s.value for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text) for s in f.samples}
    return values["kvserve_prefix_cache_queried_tokens_total"], values["kvserve_prefix_cache_hit_tokens_total"]


async def shared(url: str, users: int, system_words: int, new_tokens: int) -> dict:
    system = {"role": "system", "content": text(system_words, seed=1000)}
    queried, hit = prefix_counters(url)
    limits = httpx.Limits(max_connections=users + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        started = time.perf_counter()
        records = await asyncio.gather(*(chat_request(client, [system, {"role": "user", "content": text(12, seed=2000 + i)}],
                                                      new_tokens) for i in range(users)))
        all_first = max(r["ttft"] for r in records)
    queried_after, hit_after = prefix_counters(url)
    system_tokens = len(httpx.post(f"{url}/tokenize", json={"inputs": system["content"]}).json())
    return {"users": users, "system_tokens": system_tokens, "all_first_token_s": all_first,
            "wall_s": time.perf_counter() - started, "ttft_sum_s": sum(r["ttft"] for r in records),
            "queried_tokens": queried_after - queried, "computed_tokens": (queried_after - queried) - (hit_after - hit),
            "prompt_tokens": [r["prompt_tokens"] for r in records]}


async def arrival(url: str, long_words: int, chunk_words: int) -> dict:
    """A stream decoding while a long prompt arrives: its largest gap, vs a chunk's prefill and a decode step."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        chunk = await chat_request(client, [{"role": "user", "content": text(chunk_words, seed=3000)}], 1)
        stamps: list[float] = []
        body = {"model": "kvserve", "prompt": "Once upon a time", "max_tokens": 2000, "temperature": 0, "stream": True,
                "ignore_eos": True}

        async def stream():
            async with client.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        stamps.append(time.perf_counter())

        running = asyncio.create_task(stream())
        while len(stamps) < 20:
            await asyncio.sleep(0.01)
        sent = time.perf_counter()
        long = await chat_request(client, [{"role": "user", "content": text(long_words, seed=3001)}], 1)
        answered = time.perf_counter()
        # The stream's first token after the long prompt's answer closes the gap that spans its prefill:
        # cancelling before it arrives would leave the largest gap out of the measurement.
        while not running.done() and stamps[-1] < answered:
            await asyncio.sleep(0.001)
        running.cancel()
    before = [b - a for a, b in zip(stamps, stamps[1:]) if b < sent]
    during = [b - a for a, b in zip(stamps, stamps[1:]) if b >= sent and a <= answered]
    decode = sorted(before)[len(before) // 2]
    return {"long_prompt_tokens": long["prompt_tokens"], "long_ttft_s": long["ttft"],
            "chunk_prompt_tokens": chunk["prompt_tokens"], "chunk_ttft_s": chunk["ttft"], "decode_step_s": decode,
            "largest_gap_s": max(during, default=0.0), "gaps_during": len(during)}


def run(args: argparse.Namespace) -> dict:
    # In tokens: turns of a chat growing to ~1,500; one system prompt of ~1,000 for many users; a ~2,000 prompt
    # arriving; and a prompt of about one prefill chunk (the server's default prefill_chunk_size, 512).
    turns, turn_tokens = (4, 100) if args.quick else (10, 130)
    users, system_tokens = (4, 600) if args.quick else (16, 1000)
    long_tokens, chunk_tokens = (1000 if args.quick else 2000), 500
    server_args = argparse.Namespace(**vars(args) | {"max_batch_size": max(users, 2)})
    results: dict[str, dict] = {}
    for mode in ("on", "off"):
        with local_server(server_args, ["--prefix-caching", mode, "--max-seq-len", str(MAX_SEQ_LEN)]) as url:
            words = words_per_token(url)
            results[mode] = {"chat": asyncio.run(chat(url, turns, int(turn_tokens * words), args.new_tokens)),
                             "shared": asyncio.run(shared(url, users, int(system_tokens * words), args.new_tokens))}
            if mode == "on":
                results[mode]["arrival"] = asyncio.run(arrival(url, int(long_tokens * words), int(chunk_tokens * words)))
    on, off = results["on"], results["off"]
    last = max(1, turns // 3)  # the last turns: the longest histories
    ttft_on = sum(r["ttft"] for r in on["chat"][-last:]) / last
    ttft_off = sum(r["ttft"] for r in off["chat"][-last:]) / last
    a = on["arrival"]
    gap_bound = a["chunk_ttft_s"] + a["decode_step_s"]
    ratios = {"chat_last_turns_ttft_speedup": ttft_off / ttft_on,
              "shared_all_first_token_speedup": off["shared"]["all_first_token_s"] / on["shared"]["all_first_token_s"],
              "arrival_gap_vs_chunk_plus_step": a["largest_gap_s"] / gap_bound}
    info = machine()
    rows = [[turn + 1, r_on["prompt_tokens"], r_on["cached_tokens"], f"{r_on['ttft'] * 1e3:.0f}", f"{r_off['ttft'] * 1e3:.0f}"]
            for turn, (r_on, r_off) in enumerate(zip(on["chat"], off["chat"]))]
    s_on, s_off = on["shared"], off["shared"]
    table = "\n".join([
        f"# Prefix caching on vs off (python -m server --quantize {args.quantize} --compile {args.compile})", "",
        machine_line(info), "",
        f"## A {turns}-turn chat (greedy, {args.new_tokens} new tokens per turn)", "",
        markdown_table(["turn", "prompt tokens", "reused (on)", "TTFT ms, on", "TTFT ms, off"], rows), "",
        f"Last {last} turns: TTFT {ttft_on * 1e3:.0f} ms on vs {ttft_off * 1e3:.0f} ms off: "
        f"**{ratios['chat_last_turns_ttft_speedup']:.1f}x** lower.", "",
        f"## {users} concurrent users of one system prompt (~{s_on['system_tokens']} tokens)", "",
        markdown_table(["", "prompt tokens sent", "prompt tokens computed", "all first tokens s", "sum of TTFT s"], [
            ["on", f"{s_on['queried_tokens']:.0f}", f"{s_on['computed_tokens']:.0f}", f"{s_on['all_first_token_s']:.2f}",
             f"{s_on['ttft_sum_s']:.2f}"],
            ["off", f"{s_off['queried_tokens']:.0f}", f"{s_off['computed_tokens']:.0f}", f"{s_off['all_first_token_s']:.2f}",
             f"{s_off['ttft_sum_s']:.2f}"]]), "",
        f"All {users} first tokens **{ratios['shared_all_first_token_speedup']:.1f}x** sooner with prefix caching.", "",
        "## A stream decoding while a long prompt arrives (chunked prefill)", "",
        f"A {a['long_prompt_tokens']}-token prompt (TTFT {a['long_ttft_s']:.2f} s) arrived while a stream decoded at "
        f"{a['decode_step_s'] * 1e3:.1f} ms per token. The stream's largest gap meanwhile: "
        f"{a['largest_gap_s'] * 1e3:.0f} ms over {a['gaps_during']} tokens; one prefill chunk (a {a['chunk_prompt_tokens']}-token "
        f"prompt's TTFT, {a['chunk_ttft_s'] * 1e3:.0f} ms) plus one decode step is {gap_bound * 1e3:.0f} ms: "
        f"**{ratios['arrival_gap_vs_chunk_plus_step']:.2f}x** that.",
    ])
    payload = {"machine": info, "results": results, "ratios": ratios}
    write_results(args.out, "prefix", payload, table)
    plot(args.out, "prefix", "Chat time to first token per turn", "turn", "TTFT (s)",
         {f"prefix caching {mode}": (list(range(1, turns + 1)), [r["ttft"] for r in results[mode]["chat"]])
          for mode in ("on", "off")})
    print(table)
    return payload
