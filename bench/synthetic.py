"""Engines with random weights of a given shape: no files, for measuring shapes rather than models."""

from __future__ import annotations

import torch

from engine import Engine, EngineConfig, ModelConfig
from engine.model import Transformer


def default_shape(**overrides) -> ModelConfig:
    """SmolLM2-135M's shape: 30 layers, hidden 576, 9 query / 3 kv heads of 64, MLP 1536, vocab 49152, tied."""
    shape = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                 num_kv_heads=3, head_dim=64, max_position_embeddings=8192, rope_theta=100000.0,
                 tie_word_embeddings=True)
    return ModelConfig(**(shape | overrides))


def random_model(config: ModelConfig, dtype: torch.dtype, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(config)
    for name, param in model.named_parameters():
        if name.endswith("layernorm.weight") or name == "norm.weight":
            param.data.fill_(1.0)
        else:
            param.data.normal_(0.0, 0.02)
    return model.to(dtype).eval().requires_grad_(False)


def random_engine(config: ModelConfig, dtype: torch.dtype, slots: int, max_seq_len: int,
                  model: Transformer | None = None) -> Engine:
    model = model or random_model(config, dtype)
    return Engine(model, None, EngineConfig(max_batch_size=slots, max_seq_len=max_seq_len, device="cpu"))
