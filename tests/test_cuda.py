"""CUDA: the same engine on a GPU. Skipped where no GPU is present."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_cuda_float32_logits_match_cpu(tiny_dir):
    cpu = Engine.from_pretrained(tiny_dir, EngineConfig(device="cpu", dtype="float32", max_seq_len=128))
    gpu = Engine.from_pretrained(tiny_dir, EngineConfig(device="cuda", dtype="float32", max_seq_len=128))
    assert gpu.cache.data.device.type == "cuda"
    ids = [5, 17, 33, 120, 7, 250]
    torch.testing.assert_close(gpu.prompt_logits(ids).cpu(), cpu.prompt_logits(ids), atol=1e-4, rtol=1e-4)


def test_cuda_bfloat16_batch_generation_and_cache_size(tiny_dir):
    engine = Engine.from_pretrained(tiny_dir, EngineConfig(device="cuda", dtype="auto", max_batch_size=4, max_seq_len=128))
    assert engine.dtype == torch.bfloat16
    c = engine.model.config
    assert engine.cache.capacity_bytes == 2 * 4 * c.num_layers * 128 * c.num_kv_heads * c.head_dim * 2
    completions = engine.generate(["The quick brown fox", "Paris", "def add(a, b):"],
                                  SamplingParams(max_new_tokens=16, temperature=0.8, seed=7, ignore_eos=True))
    assert [len(c.output_ids) for c in completions] == [16, 16, 16]
    again = engine.generate(["Paris"], SamplingParams(max_new_tokens=16, temperature=0.8, seed=7, ignore_eos=True))
    assert again[0].output_ids == completions[1].output_ids
