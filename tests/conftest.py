from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import Engine, EngineConfig
from tests.tiny import write_model
from weights.loading import load_engine

GEMMA3 = dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
              tie_word_embeddings=True, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
# name -> (kind, overrides): the shapes the parity tests cover.
VARIANTS = {
    "gqa": ("llama", dict(num_attention_heads=8, num_key_value_heads=2)),
    "mha": ("llama", dict(num_attention_heads=4, num_key_value_heads=4)),
    "mqa": ("llama", dict(num_attention_heads=4, num_key_value_heads=1)),
    "tied": ("llama", dict(tie_word_embeddings=True)),
    # Rows of whole K-quant super-blocks (256 inputs).
    "wide": ("llama", dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                           tie_word_embeddings=True)),
    "llama3_rope": ("llama", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "linear_rope": ("llama", dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})),
    "qwen2_bias": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "head_dim": ("llama", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
    "long": ("llama", dict(max_position_embeddings=4096)),  # room for requests that outlast a test's steps
    "qwen3": ("qwen3", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)),  # head_dim != hidden/heads
    # A window of 4 keys, prompts and answers well past it; global layers' RoPE scaled; scores by 1/sqrt(24).
    "gemma3": ("gemma3", dict(GEMMA3, query_pre_attn_scalar=24)),
    # Scores by 1/sqrt(head_dim), as every Gemma 3 but the 27B (a GGUF has no key for another scale).
    "gemma3_gguf": ("gemma3", dict(GEMMA3, query_pre_attn_scalar=16)),
}


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """model_dir(name) -> a tiny random checkpoint folder of that variant, written once per session."""
    made: dict[str, Path] = {}

    def make(name: str = "gqa") -> Path:
        if name not in made:
            kind, overrides = VARIANTS[name]
            made[name] = write_model(tmp_path_factory.mktemp(name), kind=kind, **overrides)
        return made[name]

    return make


@pytest.fixture(scope="session")
def tiny_dir(model_dir) -> Path:
    return model_dir("gqa")


@pytest.fixture
def make_engine(tiny_dir):
    def make(path: Path | None = None, **settings) -> Engine:
        settings = {"device": "cpu", "dtype": "float32", "max_batch_size": 4, "max_seq_len": 128, "seed": 0} | settings
        return load_engine(path or tiny_dir, EngineConfig(**settings))

    return make


@pytest.fixture(scope="session")
def hf_model():
    """hf_model(path) -> the transformers model of a checkpoint folder, float32, the oracle."""
    from transformers import AutoModelForCausalLM

    cache = {}

    def load(path: Path):
        if path not in cache:
            cache[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return cache[path]

    return load
