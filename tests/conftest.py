from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import Engine, EngineConfig
from tests.tiny import write_model

# name -> (kind, overrides): the shapes the parity tests cover.
VARIANTS = {
    "gqa": ("llama", dict(num_attention_heads=8, num_key_value_heads=2)),
    "mha": ("llama", dict(num_attention_heads=4, num_key_value_heads=4)),
    "mqa": ("llama", dict(num_attention_heads=4, num_key_value_heads=1)),
    "tied": ("llama", dict(tie_word_embeddings=True)),
    "llama3_rope": ("llama", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "linear_rope": ("llama", dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})),
    "qwen2_bias": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "head_dim": ("llama", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
    "long": ("llama", dict(max_position_embeddings=4096)),  # room for requests that outlast a test's steps
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
        return Engine.from_pretrained(path or tiny_dir, EngineConfig(**settings))

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
