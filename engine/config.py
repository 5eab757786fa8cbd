"""Model architecture, read from a Hugging Face `config.json` and checked on creation."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# model_type -> the Hugging Face class of its checkpoints (how each composes the shared parts: engine/models/architecture.py)
SUPPORTED_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
LAYER_TYPES = ("full_attention", "sliding_attention")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


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
    # Per layer "full_attention" or "sliding_attention"; () = every layer full. A sliding layer's query at
    # position p reads keys p - W + 1 .. p only (W = sliding_window), as transformers' sliding mask does.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    local_rope_theta: float | None = None  # the sliding layers' RoPE base, unscaled (Gemma 3); None: rope_theta
    query_pre_attn_scalar: float | None = None  # scores are q·k / sqrt(this) (Gemma 3); None: head_dim
    hidden_activation: str = "silu"  # of the gated MLP: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)

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
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ConfigError(f"layer_types lists {len(self.layer_types)} layers, the model has {self.num_layers}")
        unknown = set(self.layer_types) - set(LAYER_TYPES)
        if unknown:
            raise ConfigError(f"layer_types {sorted(unknown)} are not supported (supported: {', '.join(LAYER_TYPES)})")
        if "sliding_attention" in self.layer_types and not (isinstance(self.sliding_window, int) and self.sliding_window > 0):
            raise ConfigError(f"sliding layers need a positive sliding_window, got {self.sliding_window!r}")
        if self.hidden_activation not in ACTIVATIONS:
            raise ConfigError(f"hidden_activation {self.hidden_activation!r} is not supported "
                              f"(supported: {', '.join(ACTIVATIONS)})")

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

    def window(self, layer: int) -> int | None:
        """Keys a query of this layer reads back from itself (None: all before it)."""
        return self.sliding_window if self.layer_types and self.layer_types[layer] == "sliding_attention" else None

    @property
    def attention_scale(self) -> float:
        """What q·k is multiplied by before the softmax."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Read a `config.json` as written by transformers 4.x or 5.x.

        Gemma 3 4B and larger are vision-language models (`gemma3`): their `text_config` is the text model
        served here. Gemma's configs leave out what equals its class's defaults; those are filled in.
        """
        if raw.get("model_type") == "gemma3":
            raw = text_model_config(raw)
        if raw.get("model_type") == "gemma3_text":
            raw = GEMMA3_TEXT_DEFAULTS | raw
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
        num_layers = need("num_hidden_layers")
        head_dim = raw.get("head_dim") or hidden_size // num_heads
        # Qwen2 always has q/k/v biases and no output bias; the others use `attention_bias` for all four.
        attention_bias = bool(raw.get("attention_bias", False))
        qkv_bias = model_type == "qwen2" or attention_bias
        gemma = model_type == "gemma3_text"
        if gemma:
            _refuse_gemma_options(raw)
        theta, scaling, local_theta = _read_gemma_rope(raw) if gemma else (*_read_rope(raw), None)
        layer_types = _read_layer_types(raw, model_type, num_layers)
        return cls(
            vocab_size=need("vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=need("intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=need("max_position_embeddings"),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),  # Gemma's class ties by default
            qkv_bias=qkv_bias,
            o_bias=attention_bias and model_type != "qwen2",
            mlp_bias=bool(raw.get("mlp_bias", False)),
            model_type=model_type,
            layer_types=layer_types,
            sliding_window=raw.get("sliding_window") if layer_types else None,
            local_rope_theta=local_theta,
            query_pre_attn_scalar=float(raw["query_pre_attn_scalar"]) if gemma else None,  # filled by the defaults
            hidden_activation=raw.get("hidden_activation") or raw.get("hidden_act") or "silu",
        )


# transformers' Gemma3TextConfig defaults, for the keys a Hub config may leave out (Gemma 3 4B's text_config lists
# six keys); sliding_window_pattern is read in _read_layer_types.
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "tie_word_embeddings": True,
}


def text_model_config(raw: dict[str, Any]) -> dict[str, Any]:
    """A vision-language Gemma 3's text model, as a Gemma3ForCausalLM config (the vision tower is not served)."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError("config.json: model_type 'gemma3' without a text_config")
    tied = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
    return text | {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "tie_word_embeddings": tied}


def _read_layer_types(raw: dict[str, Any], model_type: str, num_layers: int) -> tuple[str, ...]:
    """Each layer's attention: as listed (transformers 5.x writes `layer_types`), else by the family's rule;
    () where every layer is global."""
    if raw.get("layer_types"):
        listed = tuple(raw["layer_types"])
        return () if set(listed) == {"full_attention"} else listed
    if model_type == "gemma3_text":  # five sliding layers, then a global one (4.x: `sliding_window_pattern`)
        pattern = int(raw.get("sliding_window_pattern", 6))
        return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers))
    if model_type == "mistral" and raw.get("sliding_window"):  # Mistral 7B v0.1: every layer
        return ("sliding_attention",) * num_layers
    if model_type in ("qwen2", "qwen3") and raw.get("use_sliding_window"):  # layers from max_window_layers on
        first = int(raw.get("max_window_layers", num_layers))
        return tuple("sliding_attention" if i >= first else "full_attention" for i in range(num_layers))
    return ()


def _refuse_gemma_options(raw: dict[str, Any]) -> None:
    """Gemma 2's soft-capping and the bidirectional (embedding) variant are other models."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if raw.get(key) is not None:
            raise ConfigError(f"config.json: {key} is not supported")
    if raw.get("use_bidirectional_attention"):
        raise ConfigError("config.json: use_bidirectional_attention is not supported (kvserve serves decoders)")


def _read_gemma_rope(raw: dict[str, Any]) -> tuple[float, RopeScaling, float]:
    """Gemma 3's two RoPEs: global layers' (rope_theta, with any scaling) and sliding layers' (unscaled base).

    transformers 5.x nests them under rope_parameters by layer type; 4.x has rope_theta, rope_scaling and
    rope_local_base_freq.
    """
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        theta, scaling = _read_rope({"rope_parameters": params.get("full_attention") or {"rope_theta": 1e6}})
        local = params.get("sliding_attention") or {}
        local_theta, local_scaling = _read_rope({"rope_parameters": {"rope_theta": 1e4} | local})
        if local_scaling.rope_type != "default":
            raise ConfigError("config.json: scaled RoPE on sliding layers is not supported")
        return theta, scaling, local_theta
    theta, scaling = _read_rope({"rope_theta": 1e6} | raw)
    return theta, scaling, float(raw.get("rope_local_base_freq", 1e4))


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
