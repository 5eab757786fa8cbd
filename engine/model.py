"""A decoder: embedding, blocks, final norm, LM head; the parts each family composes are engine/architecture.py's."""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.architecture import ARCHITECTURES
from engine.batch import DecodeBatch, PrefillBatch
from engine.config import ModelConfig
from engine.kv_cache import KVCache
from engine.quantization import GroupCodes, quantized_linear
from engine.rope import RotaryTable


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        architecture = ARCHITECTURES[config.model_type]
        # Gemma: sqrt(hidden) in the embedding's dtype, as its reference rounds it (None: not scaled).
        self.embedding_scale = math.sqrt(config.hidden_size) if architecture.scaled_embedding else None
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(architecture.block(config, i, architecture.norm, architecture.qk_norm)
                                    for i in range(config.num_layers))
        self.norm = architecture.norm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        tokens: torch.Tensor,
        rotary: RotaryTable,
        cache: KVCache,
        batch: PrefillBatch | DecodeBatch,
    ) -> torch.Tensor:
        """tokens (b, s) at batch.positions -> final hidden states (b, s, hidden)."""
        rope = rotary.lookup(batch.positions)
        x = self.embed_tokens(tokens)
        if self.embedding_scale is not None:
            x = x * torch.tensor(self.embedding_scale, dtype=x.dtype)
        for index, layer in enumerate(self.layers):
            x = layer(x, rope, cache.layer(index), batch)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def build_model(config: ModelConfig, state: dict[str, torch.Tensor | GroupCodes], device: torch.device,
                quantize: str = "none") -> Transformer:
    """A Transformer holding exactly `state` (strict: every parameter present, no extras), on `device`.

    With `quantize` other than "none", each linear layer is what `quantized_linear` makes of its weight
    (group codes always become `GroupLinear`); the embedding and norms stay dense.
    """
    with torch.device("meta"):
        model = Transformer(config)
    state = dict(state)
    if quantize != "none":
        for name in [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]:
            layer = quantized_linear(state[f"{name}.weight"], state.get(f"{name}.bias"), quantize, head=name == "lm_head")
            if layer is None:
                continue
            state.pop(f"{name}.weight"), state.pop(f"{name}.bias", None)
            state |= layer.state_dict(prefix=f"{name}.")
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, layer)
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings and isinstance(model.lm_head, nn.Linear):  # assign=True untied the two names
        model.lm_head.weight = model.embed_tokens.weight
    return model.to(device).eval().requires_grad_(False)
