"""From a model folder to a built model: the checkpoint read in the form it is served, each linear layer planned
(engine/linear/planner.py), and the engine that runs it (which knows nothing of files)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from engine import Engine, EngineConfig, Tokenizer
from engine.device import resolve_device, resolve_dtype
from engine.heap import release_freed_memory
from engine.linear.planner import Planner
from engine.models.model import Transformer, build_model
from engine.pages import onto_huge_pages
from engine.tensor_parallel import Shard, shard_model
from weights.checkpoint import load_checkpoint, stores_quantized


def load_engine(path: str | Path, config: EngineConfig = EngineConfig()) -> Engine:
    """An engine serving the model folder at `path` (a Hugging Face folder, or one with a GGUF) as `config` says."""
    tokenizer = Tokenizer.from_dir(path)  # first: what parsing it freed is handed back with the model's temporaries
    return Engine(load_model(path, config), tokenizer, config)


def load_model(path: str | Path, config: EngineConfig = EngineConfig()) -> Transformer:
    device = resolve_device(config.device)
    model_config, state, mode = served_checkpoint(path, config.quantize, config.dtype, device)
    model = build_model(model_config, state, device, Planner.for_machine(device, mode, config.dense_copies))
    del state  # the checkpoint's tensors, where the layers repacked them
    return settled(model)


def load_shard(path, device: str, dtype: str, quantize: str, shard: Shard, group: dist.ProcessGroup | None = None
               ) -> tuple[Transformer, Tokenizer]:
    """The rank's part of the checkpoint at `path`, with its tokenizer; weights as `load_engine` serves them."""
    resolved = resolve_device(device)
    tokenizer = Tokenizer.from_dir(path)  # first, as in load_engine
    config, state, mode = served_checkpoint(path, quantize, dtype, resolved)
    model = shard_model(config, state, shard, resolved, group, Planner.for_machine(resolved, mode))
    del state
    return settled(model), tokenizer


def settled(model: Transformer) -> Transformer:
    """`model` as it will be served: a CPU model's weights on huge pages (engine/pages.py), and the memory that
    building it freed (the checkpoint, the repacking's temporaries, the tensors just moved) handed back."""
    if next(model.parameters()).device.type == "cpu":
        model.pages = onto_huge_pages(model)
    release_freed_memory()
    return model


def served_checkpoint(path, quantize: str, dtype: str, device: torch.device) -> tuple:
    """The checkpoint at `path` as an engine serves it: (model config, state, quantize mode), weights in the dtype
    and form (`quantized_mode`) that the planner then takes with that mode."""
    mode = quantized_mode(path, quantize, dtype, device)
    loaded_dtype = torch.bfloat16 if mode != "none" else resolve_dtype(dtype, device)
    config, state = load_checkpoint(path, loaded_dtype, codes=mode != "none")
    return config, state, mode


def quantized_mode(path, quantize: str, dtype: str, device: torch.device) -> str:
    """What `quantize` resolves to for the checkpoint at `path`: auto serves a GGUF's quantized matrices as
    stored, on the CPU in bfloat16 (or auto) only; anything else dense ("none")."""
    mode = quantize
    if mode == "auto" and not (device.type == "cpu" and dtype in ("auto", "bfloat16") and stores_quantized(path)):
        mode = "none"
    if mode != "none" and device.type != "cpu":
        raise ValueError(f"quantize={mode!r} runs on CPU kernels; on {device} serve dense weights")
    return mode
