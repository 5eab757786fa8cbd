"""kvserve's engine: a decoder model (Llama, Mistral, Qwen2/3, Gemma 3), its KV cache, sampling and continuous
batching.

The names below are imported on first use, so that a light submodule (engine.cache_file, which
`python -m weights pull` uses) can be imported without torch.
"""

import importlib

EXPORTS = {
    "ConfigError": "engine.config", "ModelConfig": "engine.config",
    "Completion": "engine.engine", "Engine": "engine.engine", "EngineConfig": "engine.engine",
    "FinishReason": "engine.request", "RequestFailed": "engine.request", "TokenEvent": "engine.request",
    "InvalidParameter": "engine.sampling", "SamplingParams": "engine.sampling",
    "Tokenizer": "engine.tokenizer",
}
__all__ = sorted(EXPORTS)


def __getattr__(name: str):
    if name not in EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(EXPORTS[name]), name)
