"""Loads a Hugging Face checkpoint folder, strictly, never unpickling.

The weights are `*.safetensors`, or a GGUF file (`model.gguf`, what importing a GGUF writes), whose
quantized matrices can stay quantized.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open

from engine.models.architecture import ARCHITECTURES
from engine.config import ConfigError, ModelConfig
from engine.linear.codes import QUANTIZED, QuantizedWeight, fuse
from weights.gguf_file import WEIGHTS_NAME, GGUFFile

# Buffers some exporters save that are recomputed from the config, never weights.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint folder or tensor that kvserve cannot load; the message names the file or tensor."""


def raw_config(path: str | Path) -> dict:
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path}: no config.json (expected a Hugging Face model folder)")
    try:
        return json.loads(config_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_file}: not valid JSON ({e})") from None


def load_config(path: str | Path) -> ModelConfig:
    return ModelConfig.from_hf(raw_config(path))


# A vision-language Gemma 3's text model, as transformers 4.x and 5.x name its tensors; the vision tower is not served.
TEXT_MODEL_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                       "language_model.lm_head.": "lm_head."}
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def text_model_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The text model's tensors under Gemma3ForCausalLM's names."""
    out = {}
    for name, tensor in tensors.items():
        if name.startswith(VISION_PREFIXES):
            continue
        prefix = next((p for p in TEXT_MODEL_PREFIXES if name.startswith(p)), None)
        out[TEXT_MODEL_PREFIXES[prefix] + name[len(prefix):] if prefix else name] = tensor
    return out


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
    """Every tensor a Hugging Face checkpoint of this config holds, by name."""
    d, inter = config.hidden_size, config.intermediate_size
    architecture = ARCHITECTURES[config.model_type]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, d),
        "model.norm.weight": (d,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, d)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes |= {p + f"{norm}.weight": (d,) for norm in architecture.block.NORMS}
        if architecture.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (config.head_dim,), p + "self_attn.k_norm.weight": (config.head_dim,)}
        shapes |= {
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


Weight = torch.Tensor | QuantizedWeight


def to_model_state(tensors: dict[str, Weight], config: ModelConfig, dtype: torch.dtype) -> dict[str, Weight]:
    """Hugging Face names -> the names of `engine.models.model.Transformer`, with q/k/v and gate/up fused; floats in `dtype`."""
    head = tensors.get("lm_head.weight")
    tied_head = config.tie_word_embeddings and not isinstance(head, QUANTIZED)  # a quantized tied head has its own codes
    state = {
        "embed_tokens.weight": tensors["model.embed_tokens.weight"],
        "norm.weight": tensors["model.norm.weight"],
        "lm_head.weight": tensors["model.embed_tokens.weight"] if tied_head else head,
    }
    architecture = ARCHITECTURES[config.model_type]
    norms = [*architecture.block.NORMS] + (["self_attn.q_norm", "self_attn.k_norm"] if architecture.qk_norm else [])
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        for norm in norms:
            state[dst + f"{norm}.weight"] = tensors[src + f"{norm}.weight"]
        for kind in ("weight", "bias") if config.qkv_bias else ("weight",):
            state[dst + f"self_attn.qkv_proj.{kind}"] = fuse([tensors[src + f"self_attn.{n}_proj.{kind}"] for n in "qkv"])
        for kind in ("weight", "bias") if config.o_bias else ("weight",):
            state[dst + f"self_attn.o_proj.{kind}"] = tensors[src + f"self_attn.o_proj.{kind}"]
        for kind in ("weight", "bias") if config.mlp_bias else ("weight",):
            state[dst + f"mlp.gate_up_proj.{kind}"] = fuse([tensors[src + f"mlp.{n}_proj.{kind}"] for n in ("gate", "up")])
            state[dst + f"mlp.down_proj.{kind}"] = tensors[src + f"mlp.down_proj.{kind}"]
    converted: dict[int, Weight] = {}  # tied weights stay one tensor after the cast
    return {name: converted.setdefault(id(t), t if isinstance(t, QUANTIZED) else t.to(dtype)) for name, t in state.items()}


def load_checkpoint(path: str | Path, dtype: torch.dtype = torch.float32,
                    codes: bool = False) -> tuple[ModelConfig, dict[str, Weight]]:
    """(config, state dict for `engine.models.model.Transformer`) from a Hugging Face folder; strict.

    With `codes`, a GGUF's quantized matrices come as `GroupCodes` or `SuperBlockCodes` (see `weights.gguf_file`); otherwise
    every weight is a `dtype` tensor.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory")
    raw = raw_config(path)
    try:
        config = ModelConfig.from_hf(raw)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    gguf = path / WEIGHTS_NAME
    if gguf.is_file():
        file = GGUFFile(gguf)
        tensors = file.tensors(progress=False, codes=codes)
        # Whether the head is the embedding is the file's to say (an output.weight or none), as llama.cpp reads it:
        # a config.json copied beside it from the Hugging Face folder may say otherwise.
        config = replace(config, tie_word_embeddings=file.hf_config()["tie_word_embeddings"])
    else:
        tensors = read_tensors(path)
    if raw.get("model_type") == "gemma3":
        tensors = text_model_tensors(tensors)
    check_tensors(tensors, config, str(path))
    return config, to_model_state(tensors, config, dtype)


def stores_quantized(path: str | Path) -> bool:
    """Whether the folder's weights are a GGUF with quantized matrices (what `--quantize auto` serves as stored)."""
    gguf = Path(path) / WEIGHTS_NAME
    return gguf.is_file() and GGUFFile(gguf).quantized


def transformers_files(path: str | Path) -> dict[str, str]:
    """The keyword arguments with which transformers' `from_pretrained(path, ...)` reads the same weights."""
    return {"gguf_file": WEIGHTS_NAME} if (Path(path) / WEIGHTS_NAME).is_file() else {}
