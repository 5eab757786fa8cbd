"""Model architecture, read from a Hugging Face `config.json` and checked on creation."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

SUPPORTED_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


class ConfigError(ValueError):
    """A checkpoint's configuration that kvserve cannot serve; the message names the key."""


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE frequencies are stretched for long contexts ("default" means not at all)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ("default", "linear", "llama3"):
            raise ConfigError(
                f"rope scaling type {self.rope_type!r} is not supported (supported: default, linear, llama3)"
            )
        if self.factor <= 0:
            raise ConfigError(f"rope scaling factor must be positive, got {self.factor}")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    model_type: str = "llama"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type {self.model_type!r} is not supported "
                f"(supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))})"
            )

    @property
    def query_groups(self) -> int:
        """Query heads that share one key/value head."""
        return self.num_heads // self.num_kv_heads

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Read a `config.json` as written by transformers 4.x or 5.x."""
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"config.json: model_type {model_type!r} is not supported "
                f"(supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))})"
            )
        architectures = raw.get("architectures") or [SUPPORTED_MODEL_TYPES[model_type]]
        unknown = [a for a in architectures if a not in SUPPORTED_MODEL_TYPES.values()]
        if unknown:
            raise ConfigError(f"config.json: architectures {unknown} are not supported")

        def need(key: str) -> Any:
            if key not in raw:
                raise ConfigError(f"config.json: missing key {key!r}")
            return raw[key]

        num_heads = need("num_attention_heads")
        hidden_size = need("hidden_size")
        head_dim = raw.get("head_dim") or hidden_size // num_heads
        # Qwen2 always has q/k/v biases and no output bias; Llama/Mistral use `attention_bias` for all four.
        attention_bias = bool(raw.get("attention_bias", False))
        qkv_bias = model_type == "qwen2" or attention_bias
        theta, scaling = _read_rope(raw)
        return cls(
            vocab_size=need("vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=need("max_position_embeddings"),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=attention_bias and model_type != "qwen2",
            mlp_bias=bool(raw.get("mlp_bias", False)),
            model_type=model_type,
        )


def _read_rope(raw: dict[str, Any]) -> tuple[float, RopeScaling]:
    # transformers 5.x nests everything under rope_parameters; 4.x has rope_theta + rope_scaling.
    params = dict(raw.get("rope_parameters") or {})
    legacy = raw.get("rope_scaling") or {}
    for key, value in legacy.items():
        params.setdefault(key, value)
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), RopeScaling()
    if "factor" not in params:
        raise ConfigError(f"config.json: rope scaling of type {rope_type!r} needs 'factor'")
    scaling = RopeScaling(
        rope_type=rope_type,
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )
    if not math.isfinite(float(theta)) or float(theta) <= 0:
        raise ConfigError(f"config.json: rope_theta must be positive, got {theta}")
    return float(theta), scaling
