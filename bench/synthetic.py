"""Engines with random weights of a given shape: no files, for measuring shapes rather than models."""

from __future__ import annotations

import torch

from engine import Engine, EngineConfig, ModelConfig
from engine.models.model import Transformer, build_model


def default_shape(**overrides) -> ModelConfig:
    """SmolLM2-135M's shape: 30 layers, hidden 576, 9 query / 3 kv heads of 64, MLP 1536, vocab 49152, tied."""
    shape = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                 num_kv_heads=3, head_dim=64, max_position_embeddings=8192, rope_theta=100000.0,
                 tie_word_embeddings=True)
    return ModelConfig(**(shape | overrides))


def random_model(config: ModelConfig, dtype: torch.dtype, seed: int = 0) -> Transformer:
    """Norms of ones, every other weight N(0, 0.02), each linear layer planned as for a checkpoint (dense, on the CPU)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = Transformer(config).state_dict()  # tied weights once: the head's name is the embedding's
    state: dict[str, torch.Tensor] = {}
    for name, meta in shapes.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            state[name] = state["embed_tokens.weight"]
        elif name.endswith("norm.weight"):
            state[name] = torch.ones(meta.shape, dtype=dtype)
        else:
            state[name] = (torch.randn(meta.shape, generator=generator) * 0.02).to(dtype)
    return build_model(config, state, torch.device("cpu"))


def random_engine(config: ModelConfig, dtype: torch.dtype, slots: int, max_seq_len: int,
                  model: Transformer | None = None) -> Engine:
    model = model or random_model(config, dtype)
    return Engine(model, None, EngineConfig(max_batch_size=slots, max_seq_len=max_seq_len, device="cpu"))
