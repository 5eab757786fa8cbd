"""kvserve's engine: a Llama-family model, its KV cache, sampling and continuous batching."""

from engine.config import ConfigError, ModelConfig
from engine.engine import Completion, Engine, EngineConfig
from engine.request import FinishReason, RequestFailed, TokenEvent
from engine.sampling import InvalidParameter, SamplingParams
from engine.tokenizer import Tokenizer

__all__ = [
    "Completion", "ConfigError", "Engine", "EngineConfig", "FinishReason", "InvalidParameter",
    "ModelConfig", "RequestFailed", "SamplingParams", "TokenEvent", "Tokenizer",
]
