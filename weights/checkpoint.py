"""Loads a Hugging Face checkpoint folder: config.json + safetensors, strictly, never unpickling."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ConfigError, ModelConfig

# Buffers some exporters save that are recomputed from the config, never weights.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint folder or tensor that kvserve cannot load; the message names the file or tensor."""


def load_config(path: str | Path) -> ModelConfig:
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path}: no config.json (expected a Hugging Face model folder)")
    try:
        return ModelConfig.from_hf(json.loads(config_file.read_text(encoding="utf-8")))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_file}: not valid JSON ({e})") from None


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = [path / name for name in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index}: shards listed but missing: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt*"))
    if pickles:
        raise CheckpointError(
            f"{path}: only pickle weights found ({', '.join(pickles)}). kvserve never unpickles files "
            "(they can run arbitrary code); convert the checkpoint to safetensors, e.g. with "
            "transformers: model.save_pretrained(dir, safe_serialization=True)"
        )
    raise CheckpointError(f"{path}: no *.safetensors weights found")


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face Llama/Mistral/Qwen2 checkpoint of this config holds, by name."""
    d, inter = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, d),
        "model.norm.weight": (d,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, d)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (config.q_size, d),
            p + "self_attn.k_proj.weight": (config.kv_size, d),
            p + "self_attn.v_proj.weight": (config.kv_size, d),
            p + "self_attn.o_proj.weight": (d, config.q_size),
            p + "mlp.gate_proj.weight": (inter, d),
            p + "mlp.up_proj.weight": (inter, d),
            p + "mlp.down_proj.weight": (d, inter),
        }
        if config.qkv_bias:
            shapes |= {p + "self_attn.q_proj.bias": (config.q_size,), p + "self_attn.k_proj.bias": (config.kv_size,),
                       p + "self_attn.v_proj.bias": (config.kv_size,)}
        if config.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (d,)
        if config.mlp_bias:
            shapes |= {p + "mlp.gate_proj.bias": (inter,), p + "mlp.up_proj.bias": (inter,),
                       p + "mlp.down_proj.bias": (d,)}
    return shapes


def check_tensors(tensors: dict[str, torch.Tensor], config: ModelConfig, source: str) -> None:
    shapes = expected_shapes(config)
    missing = [name for name in shapes if name not in tensors]
    if missing:
        raise CheckpointError(f"{source}: missing tensor {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    for name, shape in shapes.items():
        if tuple(tensors[name].shape) != shape:
            raise CheckpointError(f"{source}: tensor {name} has shape {tuple(tensors[name].shape)}, config needs {shape}")
    # A tied checkpoint may still carry lm_head.weight (a copy of the embedding): it is not used.
    allowed_extra = {"lm_head.weight"} if config.tie_word_embeddings else set()
    unexpected = [n for n in tensors if n not in shapes and n not in allowed_extra and not n.endswith(IGNORED_SUFFIXES)]
    if unexpected:
        raise CheckpointError(f"{source}: unexpected tensor {unexpected[0]} (not part of a {config.model_type} model of this config)")


def to_model_state(tensors: dict[str, torch.Tensor], config: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Hugging Face names -> the names of `engine.model.Transformer`, with q/k/v and gate/up fused."""
    state = {
        "embed_tokens.weight": tensors["model.embed_tokens.weight"],
        "norm.weight": tensors["model.norm.weight"],
        "lm_head.weight": tensors["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"],
    }
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        state[dst + "input_layernorm.weight"] = tensors[src + "input_layernorm.weight"]
        state[dst + "post_attention_layernorm.weight"] = tensors[src + "post_attention_layernorm.weight"]
        for kind in ("weight", "bias") if config.qkv_bias else ("weight",):
            state[dst + f"self_attn.qkv_proj.{kind}"] = torch.cat(
                [tensors[src + f"self_attn.{n}_proj.{kind}"] for n in ("q", "k", "v")])
        for kind in ("weight", "bias") if config.o_bias else ("weight",):
            state[dst + f"self_attn.o_proj.{kind}"] = tensors[src + f"self_attn.o_proj.{kind}"]
        for kind in ("weight", "bias") if config.mlp_bias else ("weight",):
            state[dst + f"mlp.gate_up_proj.{kind}"] = torch.cat(
                [tensors[src + f"mlp.gate_proj.{kind}"], tensors[src + f"mlp.up_proj.{kind}"]])
            state[dst + f"mlp.down_proj.{kind}"] = tensors[src + f"mlp.down_proj.{kind}"]
    converted: dict[int, torch.Tensor] = {}  # tied weights stay one tensor after the cast
    return {name: converted.setdefault(id(t), t.to(dtype)) for name, t in state.items()}


def load_checkpoint(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, state dict for `engine.model.Transformer`) from a Hugging Face folder; strict."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory")
    try:
        config = load_config(path)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    tensors = read_tensors(path)
    check_tensors(tensors, config, str(path))
    return config, to_model_state(tensors, config, dtype)
