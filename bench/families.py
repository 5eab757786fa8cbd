"""Qwen3 and Gemma 3 beside Llama, and the packaged Gemma 3 270M beside llama.cpp.

1. Shapes: a Llama, a Qwen3 and a Gemma 3 of the same sizes (Qwen3-0.6B's: 28 layers, hidden 1024, 16 query / 8
   K/V heads of 128, MLP 3072; random weights, no files), batch-1 decode side by side in this process after a
   prompt longer than Gemma's 512-key window: what the families' own parts (q/k norms, four norms per block,
   GeGLU, sliding windows, a scaled embedding) cost per step.
2. The KV cache of Gemma 3 270M at T = 8192: sliding layers holding their window vs every position (allocated).
3. gemma-3-270m as downloaded (`python -m weights pull gemma-3-270m`): one stream over HTTP, kvserve's server vs
   llama.cpp's `llama-server` on the same GGUF with the same threads, one after the other (`--llama-server PATH`;
   without it, kvserve alone).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch

from bench.common import free_port, machine, machine_line, markdown_table, timed, write_results
from bench.serve import local_server, one_request
from bench.synthetic import random_engine, random_model
from engine import ModelConfig, SamplingParams
from engine.kv_cache import KVCache, format_bytes

QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
                  num_kv_heads=8, head_dim=128, max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=True)
GEMMA3_LAYERS = tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(28))
FAMILIES = {
    "llama": {},
    "qwen3": {"model_type": "qwen3"},
    "gemma3": {"model_type": "gemma3_text", "layer_types": GEMMA3_LAYERS, "sliding_window": 512,
               "local_rope_theta": 1e4, "query_pre_attn_scalar": 128, "hidden_activation": "gelu_pytorch_tanh"},
}


def shapes(args: argparse.Namespace) -> tuple[list[list], dict]:
    """Batch-1 decode ms per token of each family at one size, measured in turns (llama, qwen3, gemma3, again)."""
    dtype = getattr(torch, args.dtype)
    layers = 4 if args.quick else QWEN3_0_6B["num_layers"]
    prompt_tokens, new_tokens = (40, 8) if args.quick else (600, 32)
    engines = {}
    for name, parts in FAMILIES.items():
        fields = QWEN3_0_6B | parts | {"num_layers": layers}
        if "layer_types" in fields:
            fields["layer_types"] = fields["layer_types"][:layers]
        config = ModelConfig(**fields)
        engines[name] = random_engine(config, dtype, slots=1, max_seq_len=prompt_tokens + new_tokens + 8,
                                      model=random_model(config, dtype))
    prompt = [(7 * i) % 1000 + 5 for i in range(prompt_tokens)]
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    samples = {name: [] for name in engines}
    first_only = dataclasses.replace(params, max_new_tokens=1)
    for _ in range(1 if args.quick else 3):  # in turns, so that a noisy neighbour weighs on every family alike
        for name, engine in engines.items():
            # The same prefill twice; the difference is the decode steps alone.
            prefill = timed(lambda: engine.generate([prompt], first_only), 1).median
            whole = timed(lambda: engine.generate([prompt], params), 1, warmup=0).median
            samples[name].append((whole - prefill) / (new_tokens - 1))
    per_token = {name: statistics.median(values) for name, values in samples.items()}
    rows = [[name, f"{per_token[name] * 1e3:.1f}", f"{per_token[name] / per_token['llama']:.3f}"] for name in engines]
    return rows, {"layers": layers, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
                  "decode_s_per_token": per_token}


def cache_bytes() -> tuple[list[list], dict]:
    """Gemma 3 270M's KV cache at T = 8192, one slot, bfloat16: windows vs full length, as allocated."""
    config = ModelConfig(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_layers=18, num_heads=4,
                         num_kv_heads=1, head_dim=256, max_position_embeddings=32768, model_type="gemma3_text",
                         layer_types=tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                           for i in range(18)), sliding_window=512, local_rope_theta=1e4)
    sizes = {}
    for full in (False, True):
        cache = KVCache(config, 1, 8192, torch.device("cpu"), torch.bfloat16, full_windows=full)
        sizes["full length" if full else "windows"] = cache.storage.untyped_storage().nbytes()
    rows = [[name, f"{n:,}", format_bytes(n)] for name, n in sizes.items()]
    rows.append(["full / windows", f"{sizes['full length'] / sizes['windows']:.2f}x", ""])
    return rows, sizes


@contextmanager
def llama_server(binary: Path, gguf: Path, threads: int, slots: int = 1, started: list | None = None,
                 extra: tuple[str, ...] = ()):
    """llama.cpp's server on `gguf` with `slots` parallel sequences (1024 positions each) and `extra` flags, until the
    block ends; yields its URL (and appends its process to `started`, when given)."""
    port = free_port()
    process = subprocess.Popen([str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads),
                                "-c", str(max(4096, 1024 * slots)), "-np", str(slots), "--port", str(port),
                                "--host", "127.0.0.1", *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if started is not None:
        started.append(process)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if process.poll() is not None:
                raise RuntimeError(f"llama-server exited with {process.returncode}")
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.wait(60)


def one_stream(url: str, prompt: str, new_tokens: int, repeats: int) -> dict:
    """Streamed /v1/completions, greedy, one at a time: tokens/s and the median inter-token gap."""
    async def run():
        await one_request(url, prompt, 8)  # warm-up
        return [await one_request(url, prompt, new_tokens) for _ in range(repeats)]

    answers = asyncio.run(run())
    results = [r for r in answers if "error" not in r]
    if not results:
        raise RuntimeError(f"no streamed completion from {url}: {[r['error'] for r in answers]}")
    gaps = [g for r in results for g in r["gaps"]]
    return {"tokens_per_s": statistics.median(len(r["gaps"]) / (r["e2e"] - r["ttft"]) for r in results),
            "inter_token_s": statistics.median(gaps), "ttft_s": statistics.median(r["ttft"] for r in results)}


def served(args: argparse.Namespace) -> tuple[list[list], dict] | None:
    from weights.default_model import GEMMA3_270M, pull

    folder = pull(GEMMA3_270M, progress=True)
    new_tokens = 16 if args.quick else 128
    prompt = "Once upon a time, in a small village by the sea, there lived"
    threads = args.threads or torch.get_num_threads()
    server_args = argparse.Namespace(dtype="auto", max_batch_size=4, compile=args.compile, model="gemma-3-270m",
                                     quantize="auto", dense_copies="off")
    results = {}
    env = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        with local_server(server_args, ["--prefix-caching", "off"]) as url:
            results["kvserve"] = one_stream(url, prompt, new_tokens, args.repeats)
    finally:
        os.environ.pop("OMP_NUM_THREADS") if env is None else os.environ.update(OMP_NUM_THREADS=env)
    if args.llama_server:
        with llama_server(args.llama_server, folder / "model.gguf", threads) as url:
            results["llama-server"] = one_stream(url, prompt, new_tokens, args.repeats)
    rows = [[name, f"{r['tokens_per_s']:.1f}", f"{r['inter_token_s'] * 1e3:.1f}", f"{r['ttft_s'] * 1e3:.0f}",
             f"{r['tokens_per_s'] / results.get('llama-server', r)['tokens_per_s']:.2f}x"]
            for name, r in results.items()]
    return rows, {"threads": threads, "new_tokens": new_tokens, "results": results}


def run(args: argparse.Namespace) -> dict:
    info = machine()
    shape_rows, shape_data = shapes(args)
    cache_rows, cache_data = cache_bytes()
    lines = [f"# Model families: Qwen3 and Gemma 3 beside Llama ({args.dtype}), and Gemma 3 270M beside llama.cpp",
             "", machine_line(info), "",
             f"Batch-1 decode, random weights of Qwen3-0.6B's sizes ({shape_data['layers']} layers), after a "
             f"{shape_data['prompt_tokens']}-token prompt, {shape_data['new_tokens']} new tokens, eager:", "",
             markdown_table(["family", "ms per token", "/ llama"], shape_rows), "",
             "Gemma 3 270M's KV cache at T = 8192, one slot, bfloat16, as allocated:", "",
             markdown_table(["sliding layers hold", "bytes", ""], cache_rows)]
    payload = {"machine": info, "shapes": shape_data, "kv_cache_bytes": cache_data}
    if not args.quick:
        serve_rows, serve_data = served(args)
        lines += ["", f"gemma-3-270m (Q4_K_M, as downloaded), one stream over HTTP, {serve_data['new_tokens']} "
                      f"greedy tokens, {serve_data['threads']} threads each:", "",
                  markdown_table(["server", "tokens/s", "inter-token ms", "TTFT ms", "/ llama-server"], serve_rows)]
        payload["served"] = serve_data
    table = "\n".join(lines)
    write_results(args.out, "families", payload, table)
    print(table)
    return payload
