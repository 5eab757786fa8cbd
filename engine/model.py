"""A Llama-family decoder: embedding, pre-norm blocks, final norm, LM head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import Attention
from engine.batch import DecodeBatch, PrefillBatch
from engine.config import ModelConfig
from engine.kv_cache import KVCache
from engine.quantization import GroupCodes, quantized_linear
from engine.rope import RotaryTable


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalized in float32 whatever the model dtype, cast back, then scaled: the reference's order.
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused into one matmul."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, rope, cache, batch):
        # Pre-norm: each branch reads a normalized copy; the residual stream keeps the incoming x.
        x = x + self.self_attn(self.input_layernorm(x), rope, cache, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
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
