"""The parts every architecture is composed of: norms, the gated MLP and two kinds of block.

Which parts a family uses is engine/models/architecture.py's; each part here is one of the ways the families
differ, written once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.attention import Attention

if TYPE_CHECKING:
    from engine.config import ModelConfig

ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class RMSNorm(nn.Module):
    """x / rms(x) · w, normalized in float32, cast back to the model's dtype, then scaled (Llama's order).

    By kvserve's kernel where it runs (`by_kernel`, set by build_model): a row's bits are then the same eager, in
    every compiled graph and at every batch size (engine/linear/native/rms_norm.cpp says why torch's are not).
    """

    OFFSET = False  # the scale is 1 + w, not w

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))
        self.by_kernel = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.by_kernel and x.dtype == self.weight.dtype:
            return torch.ops.kvserve.rms_norm(x.contiguous(), self.weight, self.eps, self.OFFSET)
        return self.normalize(x)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """torch's form of the kernel's arithmetic."""
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)


class OffsetRMSNorm(RMSNorm):
    """x / rms(x) · (1 + w), all in float32, then cast (Gemma's): a stored w of 0 is the identity scale."""

    OFFSET = True

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0 + self.weight.float()
        return F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).mul(scale).to(x.dtype)


class GatedMLP(nn.Module):
    """down(act(gate(x)) · up(x)): SwiGLU with silu, GeGLU with tanh-approximated gelu; gate and up fused."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.activation = ACTIVATIONS[config.hidden_activation]
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.activation(gate) * up)


class PreNormBlock(nn.Module):
    """Llama's block: each branch reads a normalized copy; the residual stream keeps the incoming x."""

    NORMS = ("input_layernorm", "post_attention_layernorm")  # its norms, by their checkpoint names

    def __init__(self, config: ModelConfig, layer: int, norm: type[RMSNorm], qk_norm: bool):
        super().__init__()
        self.input_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer, norm if qk_norm else None)
        self.post_attention_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config)

    def forward(self, x, rope, cache, batch):
        x = x + self.self_attn(self.input_layernorm(x), rope, cache, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class SandwichBlock(nn.Module):
    """Gemma's block: pre-norm branches whose outputs are normalized again before they join the residual."""

    NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")

    def __init__(self, config: ModelConfig, layer: int, norm: type[RMSNorm], qk_norm: bool):
        super().__init__()
        self.input_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer, norm if qk_norm else None)
        self.post_attention_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.pre_feedforward_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config)
        self.post_feedforward_layernorm = norm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, rope, cache, batch):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, cache, batch))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
