"""CUDA: the same engine on a GPU. Skipped where no GPU is present."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, SamplingParams
from tests.test_speculative import drafting_always
from weights.loading import load_engine

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_cuda_float32_logits_match_cpu(tiny_dir):
    cpu = load_engine(tiny_dir, EngineConfig(device="cpu", dtype="float32", max_seq_len=128))
    gpu = load_engine(tiny_dir, EngineConfig(device="cuda", dtype="float32", max_seq_len=128))
    assert gpu.cache.device.type == "cuda"
    ids = [5, 17, 33, 120, 7, 250]
    torch.testing.assert_close(gpu.prompt_logits(ids).cpu(), cpu.prompt_logits(ids), atol=1e-4, rtol=1e-4)


def test_cuda_bfloat16_batch_generation_and_cache_size(tiny_dir):
    engine = load_engine(tiny_dir, EngineConfig(device="cuda", dtype="auto", max_batch_size=4, max_seq_len=128))
    assert engine.dtype == torch.bfloat16
    c = engine.model.config
    assert engine.cache.capacity_bytes == 2 * 4 * c.num_layers * 128 * c.num_kv_heads * c.head_dim * 2
    completions = engine.generate(["The quick brown fox", "Paris", "def add(a, b):"],
                                  SamplingParams(max_new_tokens=16, temperature=0.8, seed=7, ignore_eos=True))
    assert [len(c.output_ids) for c in completions] == [16, 16, 16]
    again = engine.generate(["Paris"], SamplingParams(max_new_tokens=16, temperature=0.8, seed=7, ignore_eos=True))
    assert again[0].output_ids == completions[1].output_ids


def test_cuda_graphs_decode_as_eager_does(tiny_dir):
    settings = dict(device="cuda", dtype="float32", max_batch_size=4, max_seq_len=128, seed=0)
    eager = load_engine(tiny_dir, EngineConfig(**settings))
    graphs = load_engine(tiny_dir, EngineConfig(**settings, compile="on"))
    assert graphs.compile() and graphs.compiled_graphs == ()  # captured as each size is first used
    prompts = ["The quick brown fox jumps over", "Paris", "def add(a, b):", "Once upon a time there"]
    lengths = [90, 12, 25, 33]  # 4 rows, then 3 (padded to 4), 2, 1; the longest past 64 keys into 128
    greedy = [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    got = graphs.generate(prompts, greedy)
    assert [c.output_ids for c in got] == [c.output_ids for c in eager.generate(prompts, greedy)]
    assert set(graphs.compiled_graphs) == {"b4·k64", "b2·k64", "b1·k64", "b1·k128"}
    again = graphs.generate(prompts, greedy)  # replayed, not captured again
    assert [c.output_ids for c in again] == [c.output_ids for c in got]


def test_cuda_graphs_verify_drafts_as_plain_decoding_does(model_dir):
    """Speculative decoding on CUDA: each verifying step (up to 4 slots x (1 + 3 drafts) rows) replays a captured
    graph padded to its batch size, and every request gets the tokens of eager decoding without drafts."""
    settings = dict(device="cuda", dtype="float32", max_batch_size=4, max_seq_len=512, seed=0)
    prompts = [[5, 6, 7, 8, 9, 10] * 3, [3, 4] * 4, [11, 12, 13, 14, 15, 16], [40, 41, 42] * 2]  # recurring n-grams
    params = [SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)] * 2 + [
        SamplingParams(max_new_tokens=40, temperature=0.9, seed=i, ignore_eos=True) for i in range(2)]
    plain = load_engine(model_dir("long"), EngineConfig(**settings)).generate(prompts, params)
    drafting = EngineConfig(**settings, compile="on", speculative="ngram", num_speculative_tokens=3)
    engine = drafting_always(load_engine(model_dir("long"), drafting))
    assert engine.compile()
    got = engine.generate(prompts, params)
    assert [c.output_ids for c in got] == [c.output_ids for c in plain]
    assert engine.speculation["accepted_tokens"] > 0
    assert max(size for size, _ in engine.executor.captured.replays) > 4  # past a row per slot: verifying steps
