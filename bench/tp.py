"""python -m bench tp: what tensor parallelism costs here: a decode step at TP 2 vs TP 1, and its all-reduces alone.

TP 1 runs in this process with torch's threads; TP 2 in two processes over gloo, one thread each, so both use
the same cores. On one CPU, TP cannot be faster (the cores are shared either way); the figure is the price
of communication. On GPUs each rank has a device of its own, and the same split divides the weights each
one streams.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.common import free_port, machine, machine_line, markdown_table, write_results
from engine import Engine, EngineConfig, SamplingParams
from engine.config import ModelConfig
from engine.models.model import Transformer, build_model
from engine.tensor_parallel import Shard, cpu_group, shard_model
from engine.tokenizer import Tokenizer
from weights.checkpoint import load_checkpoint

PROMPT_IDS = list(range(100, 132))  # 32 tokens: token ids, so that a random model needs no tokenizer


def run(args: argparse.Namespace) -> dict:
    steps = 8 if args.quick else 64  # within the 128 positions of the engines below
    config, state, tokenizer = checkpoint(args.model, args.dtype)
    whole = step_times(Engine(build_model(config, state, torch.device("cpu")), tokenizer, settings(args.dtype)), steps)
    with tempfile.TemporaryDirectory() as scratch:
        mp.spawn(rank_main, args=(2, args.model, args.dtype, steps, free_port(), scratch), nprocs=2, join=True)
        split = json.loads(Path(scratch, "rank.0.json").read_text())
    model = args.model or f"random weights, {DESCRIBED}"
    payload = {"machine": machine(), "model": model, "dtype": args.dtype, "steps": steps, "tp1_step_ms": whole,
               "tp2_step_ms": split["step_ms"], "tp2_all_reduce_ms": split["all_reduce_ms"],
               "all_reduces_per_step": split["all_reduces"]}
    rows = [["1 (this process)", f"{whole:.2f}", "-"],
            ["2 (2 processes, gloo)", f"{split['step_ms']:.2f}", f"{split['all_reduce_ms']:.2f}"]]
    table = "\n".join([
        f"# Tensor parallelism on this CPU ({model}, {args.dtype}, batch 1, median of {steps} decode steps, eager)",
        "", machine_line(payload["machine"]), "",
        markdown_table(["TP", "decode step ms", "its all-reduces alone ms"], rows), "",
        f"A step at TP 2 makes 2 per layer = {split['all_reduces']} all-reduces of one hidden vector (the last "
        "column times them alone), one more for the embedding, and one all-gather of the logits. Both ranks share "
        "this machine's cores, so TP 2 cannot be faster here: the figures show what the communication costs.",
    ])
    write_results(args.out, "tp", payload, table)
    print(table)
    return payload


# The default model's sizes with heads that split over 2 ranks (its own 9 query heads do not).
RANDOM = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=8,
                     num_kv_heads=2, head_dim=72, max_position_embeddings=2048, tie_word_embeddings=True)
DESCRIBED = "SmolLM2-135M's sizes with 8 query and 2 K/V heads"


def checkpoint(path: str | None, dtype: str) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer | None]:
    """A dense checkpoint's config and tensors (and tokenizer), or random ones of RANDOM's shape: the same in
    every process that asks, from one seed."""
    if path:
        config, state = load_checkpoint(Path(path), getattr(torch, dtype))
        return config, state, Tokenizer.from_dir(Path(path))
    torch.manual_seed(0)
    model = Transformer(RANDOM)
    torch.nn.init.normal_(model.embed_tokens.weight)  # Transformer leaves its embedding uninitialized
    state = {name: tensor.to(getattr(torch, dtype)) for name, tensor in model.state_dict().items()}
    return RANDOM, state, None


def settings(dtype: str) -> EngineConfig:
    return EngineConfig(device="cpu", dtype=dtype, max_batch_size=1, max_seq_len=128, compile="off",
                        prefix_caching=False, seed=0)


def step_times(engine: Engine, steps: int) -> float:
    """The median time of one decode step (ms) of one greedy request after its prefill."""
    engine.add_request(PROMPT_IDS, SamplingParams(max_new_tokens=steps + 2, temperature=0, ignore_eos=True))
    engine.step()  # the prefill and the first token
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def rank_main(rank: int, world: int, path: str | None, dtype: str, steps: int, port: int, out: str) -> None:
    """One rank: its shard of the dense checkpoint in an engine of its own, timed as rank 0 is."""
    torch.set_num_threads(1)
    with cpu_group(rank, world, port):
        config, state, tokenizer = checkpoint(path, dtype)
        engine = Engine(shard_model(config, state, Shard(rank, world), torch.device("cpu")), tokenizer, settings(dtype))
        step_ms = step_times(engine, steps)
        vector, count, times = torch.zeros(1, config.hidden_size, dtype=getattr(torch, dtype)), 2 * config.num_layers, []
        for _ in range(steps):
            started = time.perf_counter()
            for _ in range(count):
                dist.all_reduce(vector)
            times.append(time.perf_counter() - started)
        if rank == 0:
            Path(out, "rank.0.json").write_text(json.dumps(
                {"step_ms": step_ms, "all_reduce_ms": statistics.median(times) * 1e3, "all_reduces": count}))
    os._exit(0)  # as tests/test_tensor_parallel.py: gloo's threads can abort an interpreter's teardown
