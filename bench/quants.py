"""kvserve and llama.cpp on the same GGUF files, side by side in one run: batch-1 and many-stream decode over HTTP,
a long prompt's prefill over HTTP, llama-bench's tg and pp, resident memory, and the read-bandwidth floor.

For each file kvserve's server and llama-server (`-np N`) are up at once and take the same streamed load
(`/v1/completions`, greedy, `ignore_eos`) in turn, round by round (--repeats rounds), each round also running
llama-bench's tg and pp on the same file and threads and measuring the machine's read rate (torch summing a large
tensor). A shared host's speed drifts by a third within minutes, so the ratios are taken within each round (paired)
and their median reported. One stream is compared finer still (--turns): a request to each server and a
llama-bench tg run, in turn, the order rotated each turn, the ratios taken within each turn (the read rate moves
within seconds: whole runs minutes apart gave 0.84x and 1.11x llama-bench for one file). The turns also decode the
same prompt in this process, on kvserve's engine alone (no server, no HTTP): the server's share of a stream's time
and the engine's own ratio to llama-bench then come from the same turns. A token's read floor is
the file's bytes over the read rate (every matrix is read once per step; a tied embedding is the LM head): a round's
one read for its rounds' figures; in the turns, a read right before and right after each run, the run's floor at the
mean of the two. The read rate is a mean, as a run's tokens per second is, over a few sums in a row, not the best
of several: on a shared host the rate swings within a tenth of a second, and the best of five short reads, taken
once a turn, caught bursts (54 GB/s where the reads either side of a run gave 31) that no run of a second sees.
Resident memory is each server's VmRSS once warm. Prefill is the time of a one-token completion of a prompt of about
--prefill-tokens (each server says how many it counted), the best over the rounds, each prompt opening with its own
number so that no server reuses a cached prefix.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable

import httpx
import torch

from bench.common import machine, machine_line, markdown_table, write_results
from bench.families import llama_server, one_stream
from bench.serve import level, local_server

PROMPT = "Once upon a time, in a small village by the sea, there lived"
READ_RATE = "read rate"  # a turn's entry that is not a run: each run's read rate either side of it, bytes per second


class ReadRate:
    """The machine's read rate now: bytes per second over `sums` sums in a row of a 512 MiB float32 tensor, held for
    the bench's life (a fresh tensor's page faults are not reading)."""

    def __init__(self, sums: int = 3):
        self.data = torch.ones(128 << 20)
        self.data.sum()
        self.sums = sums

    def __call__(self) -> float:
        seconds = timed_once(lambda: [self.data.sum() for _ in range(self.sums)])
        return self.sums * self.data.numel() * self.data.element_size() / seconds


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
    errors = [r["error"] for r in results if "error" in r]
    if errors:  # a failed request's missing tokens would read as the server's slowness
        raise RuntimeError(f"{len(errors)} of {len(results)} streams from {url} failed: {errors}")
    return sum(len(r["gaps"]) + 1 for r in results) / seconds


def load_round(url: str, args: argparse.Namespace, number: int) -> dict:
    """Round `number` of the load: one stream (a request of --new-tokens after a warm-up), the long prompt's prefill,
    and each many-stream level."""
    result = {"one": one_stream(url, PROMPT, args.new_tokens, 1),
              "prefill": prefill(url, args.prefill_tokens, 1, first=2 * number)}
    for streams in args.streams[1:]:
        result[f"{streams} streams"] = many_streams(url, streams, args.new_tokens)
    return result


def combined(rounds: list[dict]) -> dict:
    """A server's rounds as one result: medians of rates and gaps, the best prefill."""
    median = lambda key, field=None: statistics.median(r[key] if field is None else r[key][field] for r in rounds)
    result = {"one": {field: median("one", field) for field in rounds[0]["one"]},
              "prefill": min(rounds, key=lambda r: r["prefill"]["seconds"])["prefill"]}
    return result | {key: median(key) for key in rounds[0] if key.endswith("streams")}


def paired(ours: list[dict], theirs: list[dict]) -> dict:
    """kvserve / llama-server within each round, the median over rounds: rates (higher is better for kvserve) and
    the prefill's time (lower is)."""
    ratio = lambda get: statistics.median(get(a) / get(b) for a, b in zip(ours, theirs))
    result = {"one stream": ratio(lambda r: r["one"]["tokens_per_s"]),
              "prefill time": ratio(lambda r: r["prefill"]["seconds"])}
    return result | {key: ratio(lambda r, key=key: r[key]) for key in ours[0] if key.endswith("streams")}


def prefill(url: str, tokens: int, repeats: int = 3, first: int = 0) -> dict:
    """A one-token completion of a prompt of about `tokens` tokens: the best time of `repeats` and the prompt tokens
    the server counted. The prompts are numbered from `first` (no two of a run alike: no server reuses a prefix)."""
    def complete(prompt: str) -> tuple[float, int]:
        started = time.perf_counter()
        response = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0},
                              timeout=600)
        response.raise_for_status()
        return time.perf_counter() - started, response.json()["usage"]["prompt_tokens"]

    _, per_sentence = complete(PROMPT)
    sentences = max(1, tokens // per_sentence)
    runs = [complete(f"{first + i}. " + " ".join([PROMPT] * sentences)) for i in range(repeats + 1)][1:]  # the first warms
    return {"seconds": min(s for s, _ in runs), "prompt_tokens": runs[0][1]}


def llama_bench(binary: Path, gguf: Path, threads: int, new_tokens: int, prompt_tokens: int = 0,
                repetitions: int = 5) -> dict:
    """llama-bench's tg`new_tokens` and, where prompt_tokens, pp`prompt_tokens`: tokens per second."""
    out = subprocess.run([str(binary), "-m", str(gguf), "-p", str(prompt_tokens), "-n", str(new_tokens),
                          "-t", str(threads), "-r", str(repetitions), "-o", "json"], capture_output=True, text=True,
                         check=True).stdout
    rates = {(run["n_prompt"], run["n_gen"]): float(run["avg_ts"]) for run in json.loads(out)}
    return {"tg": rates[(0, new_tokens)]} | ({"pp": rates[(prompt_tokens, 0)]} if prompt_tokens else {})


def alternated(runs: dict[str, Callable[[], float]], turns: int,
               read: Callable[[], float] | None = None) -> list[dict]:
    """Each run's rate once per turn, `turns` turns, the order rotated by one each turn (no run always first). With
    `read`, the read rate is read before the turn's first run and after each run, and the turn's READ_RATE entry
    holds, for each run, the mean of the reads either side of it."""
    names = list(runs)
    order = lambda turn: names[turn % len(names):] + names[:turn % len(names)]
    result = []
    for turn in range(turns):
        reads = [read()] if read else []
        rates = {}
        for name in order(turn):
            rates[name] = runs[name]()
            reads += [read()] if read else []
        if read:
            rates[READ_RATE] = {name: (reads[i] + reads[i + 1]) / 2 for i, name in enumerate(order(turn))}
        result.append(rates)
    return result


def engine_rate(engine, prompt: str, new_tokens: int) -> float:
    """One greedy stream decoded by `engine` in this process: tokens per second after the first, as one_stream
    counts a server's (the first token is the prompt's pass)."""
    from bench.spec import decoded
    from engine import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    return decoded(engine, [(engine.tokenizer.encode(prompt), params)])[0]


def local_engine(gguf: Path, args: argparse.Namespace):
    """The file's engine in this process, one slot, configured and compiled as `measure` starts the server."""
    from engine import EngineConfig
    from weights.loading import load_engine
    from weights.resolve import resolve_model

    config = EngineConfig(device="cpu", max_batch_size=1, max_seq_len=args.max_seq_len, prefix_caching=False,
                          compile=args.compile, seed=0)
    engine = load_engine(resolve_model(str(gguf), progress=False), config)
    engine.compile()
    return engine


def ratios_within_turns(turns: list[dict[str, float]], ours: str = "kvserve") -> dict[str, float]:
    """ours / each other run's tokens per second, within each turn; the median over the turns."""
    return {name: statistics.median(turn[ours] / turn[name] for turn in turns)
            for name in turns[0] if name not in (ours, READ_RATE)}


def floors_within_turns(turns: list[dict], file_bytes: int) -> dict[str, float]:
    """Each run's share of the read floor, its tokens per second times the file's bytes over the read rate either
    side of it; the median over the turns."""
    return {name: statistics.median(turn[name] * file_bytes / turn[READ_RATE][name] for turn in turns)
            for name in turns[0] if name != READ_RATE}


def measure(gguf: Path, args: argparse.Namespace, threads: int) -> dict:
    started: list = []
    server = argparse.Namespace(dtype="auto", max_batch_size=max(args.streams), compile=args.compile, model=str(gguf),
                                quantize="auto", dense_copies="off")
    began = time.perf_counter()
    with contextlib.ExitStack() as servers:
        urls = {"kvserve": servers.enter_context(local_server(
            server, ["--prefix-caching", "off", "--max-seq-len", str(args.max_seq_len)], started))}
        ready = time.perf_counter() - began
        info = httpx.get(f"{urls['kvserve']}/info").json()
        if args.llama_bin:
            urls["llama-server"] = servers.enter_context(llama_server(
                args.llama_bin / "llama-server", gguf, threads, slots=max(args.streams), started=started))
        rounds = {name: [] for name in urls}
        benches, rates, read = [], [], ReadRate()
        for number in range(args.repeats):
            rates.append(read())
            for name, url in urls.items():
                rounds[name].append(load_round(url, args, number))
            if args.llama_bin:
                benches.append(llama_bench(args.llama_bin / "llama-bench", gguf, threads, args.new_tokens,
                                           args.prefill_tokens))
        rss = {name: resident_bytes(process.pid) for name, process in zip(urls, started)}
        turns = []
        if args.llama_bin and args.turns:
            runs = {name: (lambda url=url: one_stream(url, PROMPT, args.new_tokens, 1)["tokens_per_s"])
                    for name, url in urls.items()}
            runs["llama-bench tg"] = lambda: llama_bench(args.llama_bin / "llama-bench", gguf, threads,
                                                         args.new_tokens, repetitions=1)["tg"]
            engine = local_engine(gguf, args)  # after the rounds: the resident memory they measured is the servers'
            runs["kvserve engine"] = lambda: engine_rate(engine, PROMPT, args.new_tokens)
            engine_rate(engine, PROMPT, 8)  # warm, as one_stream warms each server
            turns = alternated(runs, args.turns, read)  # a round's one read is minutes from most of its runs
    size = gguf.stat().st_size
    floors = [size / rate for rate in rates]  # seconds a token, round by round
    of_floor = lambda per_second: statistics.median(floor * rate for floor, rate in zip(floors, per_second))
    result = {"file_bytes": size, "read_rates": rates, "rounds": rounds,
              "of_read_floor": {name: of_floor([r["one"]["tokens_per_s"] for r in rounds[name]]) for name in urls},
              "kvserve": combined(rounds["kvserve"]) | {"rss": rss["kvserve"], "ready_s": ready,
                                                        "weights_served": info["weights_served"],
                                                        "weights_bytes": info["weights_bytes"]}}
    if args.llama_bin:
        result["llama-server"] = combined(rounds["llama-server"]) | {"rss": rss["llama-server"]}
        result["llama-bench tg"] = statistics.median(b["tg"] for b in benches)
        result["llama-bench pp"] = statistics.median(b["pp"] for b in benches)
        result["of_read_floor"]["llama-bench tg"] = of_floor([b["tg"] for b in benches])
        result["kvserve / llama-server"] = paired(rounds["kvserve"], rounds["llama-server"])
        result["kvserve / llama-bench tg"] = statistics.median(
            r["one"]["tokens_per_s"] / b["tg"] for r, b in zip(rounds["kvserve"], benches))
        if turns:
            result["one stream, turn by turn"] = {"turns": turns, "kvserve / ...": ratios_within_turns(turns),
                                                  "kvserve engine / ...": ratios_within_turns(turns, "kvserve engine"),
                                                  "of the read floor": floors_within_turns(turns, size)}
    return result


def rendered(payload: dict) -> str:
    rows, ratios, prompt = [], [], payload["prefill_tokens"]
    for name, result in payload["files"].items():
        floor = result["of_read_floor"]
        for server in ("kvserve", "llama-server"):
            if server not in result:
                continue
            r = result[server]
            one = r["one"]
            many = ", ".join(f"{k}: {v:.1f}" for k, v in r.items() if k.endswith("streams"))
            filled = r["prefill"]
            rows.append([name, server, f"{one['tokens_per_s']:.1f} ({one['inter_token_s'] * 1e3:.1f} ms)",
                         f"{100 * floor[server]:.0f}%", many,
                         f"{filled['seconds']:.2f} s ({filled['prompt_tokens']} tokens)", f"{r['rss'] / 1e9:.2f} GB"])
        if "llama-bench tg" in result:
            tg, pp = result["llama-bench tg"], result["llama-bench pp"]
            rows.append([name, "llama-bench tg, pp", f"{tg:.1f}", f"{100 * floor['llama-bench tg']:.0f}%", "",
                         f"{prompt / pp:.2f} s ({prompt} tokens)", ""])
            pairs = result["kvserve / llama-server"]
            by_turn = result.get("one stream, turn by turn", {}).get("kvserve / ...")
            one = lambda ratio, peer: f"{ratio:.2f}x" + (f" ({by_turn[peer]:.2f}x)" if by_turn else "")
            ratios.append([name, one(pairs["one stream"], "llama-server"),
                           one(result["kvserve / llama-bench tg"], "llama-bench tg"),
                           ", ".join(f"{k}: {v:.2f}x" for k, v in pairs.items() if k.endswith("streams")),
                           f"{pairs['prefill time']:.2f}x",
                           f"{result['kvserve']['rss'] / result['llama-server']['rss']:.2f}x"])
    table = markdown_table(["file", "server", "1 stream tok/s (inter-token)", "of the read floor",
                            "many streams tok/s", "prefill", "resident"], rows)
    if ratios:
        table += ("\n\nkvserve / llama.cpp, paired within each round (median over rounds); in brackets, one stream "
                  "turn by turn (median over --turns turns):\n\n") + markdown_table(
            ["file", "1 stream vs llama-server", "vs llama-bench tg", "many streams", "prefill time", "resident"],
            ratios)
    shares = lambda floor: " / ".join(f"{100 * floor[name]:.0f}%" for name in
                                      ("kvserve engine", "kvserve", "llama-server", "llama-bench tg"))
    engines = [[name, f"{by_turn['llama-bench tg']:.2f}x", f"{by_turn['llama-server']:.2f}x",
                f"{result['one stream, turn by turn']['kvserve / ...']['kvserve engine']:.2f}x",
                shares(result["one stream, turn by turn"]["of the read floor"])]
               for name, result in payload["files"].items()
               if (by_turn := result.get("one stream, turn by turn", {}).get("kvserve engine / ..."))]
    if engines:
        table += ("\n\nOne stream turn by turn, kvserve's engine alone in the bench's process (no server, no HTTP), "
                  "median over the turns; each run's share of the read floor at the read rate either side of it:\n\n"
                  ) + markdown_table(["file", "engine / llama-bench tg", "engine / llama-server",
                                      "kvserve's server / its engine",
                                      "of the read floor: engine / server / llama-server / llama-bench"], engines)
    rates = [rate / 1e9 for result in payload["files"].values() for rate in result["read_rates"]]
    in_turns = [rate / 1e9 for result in payload["files"].values()
                for turn in result.get("one stream, turn by turn", {}).get("turns", [])
                for rate in turn[READ_RATE].values()]
    turns = f", {min(in_turns):.1f}-{max(in_turns):.1f} GB/s beside the turns' runs" if in_turns else ""
    served = {name: r["kvserve"]["weights_served"] for name, r in payload["files"].items()}
    return (f"{machine_line(payload['machine'])}; read rate {min(rates):.1f}-{max(rates):.1f} GB/s over the rounds"
            f"{turns}, {payload['threads']} threads\n\n{table}\n\nkvserve serves: {json.dumps(served)}\n")


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
    payload = {"machine": machine(), "threads": threads, "prefill_tokens": args.prefill_tokens, "files": files}
    table = rendered(payload)
    write_results(args.out, "quants", payload, table)
    print(table)
    return payload
