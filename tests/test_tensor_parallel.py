"""Tensor parallelism on the CPU: 2 processes over gloo compute what one process computes, from half the weights."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from bench.common import free_port
from engine import Engine, EngineConfig
from engine.config import ModelConfig
from engine.sampling import SamplingParams
from engine.tensor_parallel import Shard, cpu_group, shard_model
from engine.tokenizer import Tokenizer
from weights.checkpoint import load_checkpoint

PROMPTS = ["The quick brown fox", "Once upon a time there was"]
SETTINGS = dict(device="cpu", dtype="float32", max_batch_size=2, max_seq_len=64, compile="off", seed=0)
GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)


def run_rank(rank: int, world: int, path: str, port: int, out: str) -> None:
    """One rank: its shard of the checkpoint, in an engine of its own, running what every rank runs."""
    torch.set_num_threads(1)
    with cpu_group(rank, world, port):
        config, state = load_checkpoint(Path(path), torch.float32)
        model = shard_model(config, state, Shard(rank, world), torch.device("cpu"))
        engine = Engine(model, Tokenizer.from_dir(Path(path)), EngineConfig(**SETTINGS))
        logits = engine.prompt_logits(PROMPTS[1])
        tokens = [c.output_ids for c in engine.generate(PROMPTS, GREEDY)]
        save_file({"logits": logits.contiguous()}, f"{out}/logits.{rank}.safetensors")
        Path(f"{out}/rank.{rank}.json").write_text(json.dumps(
            {"tokens": tokens, "cache_bytes": engine.cache.capacity_bytes, "kv_heads": engine.cache.num_kv_heads}))
    # Leave without finalizing the interpreter: gloo's worker threads may still hold tensors whose release
    # then aborts the process (SIGABRT, about one run in ten here; pytorch/pytorch pull request 179291 describes it).
    os._exit(0)


@pytest.mark.parametrize("variant", ["mha", "gqa", "mqa", "qwen2_bias", "tied"])
def test_two_ranks_compute_what_one_computes(model_dir, tmp_path, variant):
    path = model_dir(variant)
    mp.spawn(run_rank, args=(2, str(path), free_port(), str(tmp_path)), nprocs=2, join=True)
    whole = Engine.from_pretrained(path, EngineConfig(**SETTINGS))
    expected_logits = whole.prompt_logits(PROMPTS[1])
    expected_tokens = [c.output_ids for c in whole.generate(PROMPTS, GREEDY)]
    config = whole.model.config
    for rank in range(2):
        got = json.loads((tmp_path / f"rank.{rank}.json").read_text())
        torch.testing.assert_close(load_file(tmp_path / f"logits.{rank}.safetensors")["logits"], expected_logits,
                                   rtol=1e-4, atol=1e-4)
        assert got["tokens"] == expected_tokens  # greedy, token for token
        # Each rank's cache holds its K/V heads only: h_kv/2 of them, or the one it replicates (MQA).
        kv_heads = max(config.num_kv_heads // 2, 1)
        assert got["kv_heads"] == kv_heads
        assert got["cache_bytes"] == whole.cache.capacity_bytes * kv_heads // config.num_kv_heads


def config_of(heads: int, kv_heads: int, intermediate: int = 128) -> ModelConfig:
    return ModelConfig(vocab_size=10, hidden_size=64, intermediate_size=intermediate, num_layers=1, num_heads=heads,
                       num_kv_heads=kv_heads, head_dim=16, max_position_embeddings=32)


def test_heads_that_cannot_be_split_are_refused():
    with pytest.raises(ValueError, match="query heads"):
        Shard(0, 2).check(config_of(heads=3, kv_heads=1))
    with pytest.raises(ValueError, match="neither be split"):
        Shard(0, 4).check(config_of(heads=12, kv_heads=6))
    Shard(1, 4).check(config_of(heads=8, kv_heads=2))  # each K/V head replicated on two ranks


def test_each_rank_reads_the_kv_heads_its_query_heads_use():
    gqa = config_of(heads=8, kv_heads=2)  # query heads 0-3 read K/V head 0, 4-7 head 1
    assert [list(Shard(r, 4).kv_heads(gqa)) for r in range(4)] == [[0], [0], [1], [1]]
    assert [list(Shard(r, 2).kv_heads(gqa)) for r in range(2)] == [[0], [1]]
    assert [list(Shard(r, 2).vocab_rows(9)) for r in range(2)] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
