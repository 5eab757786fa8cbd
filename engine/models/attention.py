"""Grouped-query attention over the KV cache."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.rope import apply_rope

if TYPE_CHECKING:  # the batches attend through this module's functions
    from engine.batch import DecodeBatch, PrefillBatch
    from engine.config import ModelConfig
    from engine.kv_cache import LayerCache


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) masked) v with h_q = g * h_kv query heads sharing each K/V head.

    q (b, h_q, s, d); k, v (b, h_kv, t, d); mask (b|1, 1, s, t) bool, True = may attend, applied
    to the scores before the softmax. Query head i reads K/V head i // g (the Hugging Face order),
    so the g heads of a group are folded into the row axis instead of copying K/V g times.
    Returns (b, h_q, s, d).
    """
    b, h_q, s, d = q.shape
    h_kv = k.shape[1]
    groups = h_q // h_kv
    q = q.reshape(b, h_kv, groups * s, d)  # (b, h_kv, g·s, d): rows are (group member, position)
    if mask is not None and s > 1 and groups > 1:
        mask = mask.repeat(1, 1, groups, 1)  # (b|1, 1, g·s, t), same order as q's rows
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.view(b, h_q, s, d)


def broadcast_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """grouped_attention for one query per row, its two products written as broadcast multiply-and-sum.

    Only for compiled graphs (eager, it would materialize (b, h_kv, g, t, d) products): inductor turns
    each product into a loop of its own that reads k and v where they lie, so keys gathered by slot
    index from the cache are read in place instead of copied first, and no extern call is made per layer.
    q (b, h_q, 1, d); k, v (b, h_kv, t, d); mask (b, 1, 1, t) bool, True = may attend. In float32.
    """
    b, h_q, _, d = q.shape
    h_kv = k.shape[1]
    q = q.reshape(b, h_kv, h_q // h_kv, 1, d).float()  # (b, h_kv, g, 1, d): query head i reads K/V head i // g
    scores = (q * k[:, :, None].float()).sum(-1) / math.sqrt(d)  # (b, h_kv, g, t)
    weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)  # mask (b, 1, 1, t) broadcasts over heads
    out = (weights[..., None] * v[:, :, None].float()).sum(-2)  # (b, h_kv, g, t, 1) * (b, h_kv, 1, t, d) -> (b, h_kv, g, d)
    return out.to(v.dtype).view(b, h_q, 1, d)


class Attention(nn.Module):
    """One layer's attention: its own window (None: every earlier key) and RoPE table ("global" or "local")."""

    def __init__(self, config: ModelConfig, layer: int, qk_norm: type[nn.Module] | None = None):
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.window = config.window(layer)
        self.rope = "local" if self.window is not None and config.local_rope_theta is not None else "global"
        # Every attention function scales scores by 1/sqrt(d_h); another scale is folded into q (None: none).
        ratio = config.attention_scale * math.sqrt(config.head_dim)
        self.query_scale = None if ratio == 1.0 else ratio
        # q, k and v projections fused into one matmul: [q; k; v] rows.
        self.qkv_proj = nn.Linear(config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=config.o_bias)
        # Qwen3, Gemma 3: each q and k head normalized over d_h before RoPE (one weight shared by the heads).
        self.q_norm = qk_norm(config.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = qk_norm(config.head_dim, config.rms_norm_eps) if qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        rope: dict[str, tuple[torch.Tensor, torch.Tensor]],
        cache: LayerCache,
        batch: PrefillBatch | DecodeBatch,
    ) -> torch.Tensor:
        b, s, _ = x.shape
        # Reshape exposes the head axis, transpose moves it before the positions.
        heads = self.qkv_proj(x).view(b, s, self.num_heads + 2 * self.num_kv_heads, self.head_dim)  # (b, s, h_q+2h_kv, d)
        if self.q_norm is not None:
            q, k, v = heads.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=2)
            heads = torch.cat([self.q_norm(q), self.k_norm(k), v], dim=2)  # (b, s, h_q+2h_kv, d), q and k normalized
        heads = heads.transpose(1, 2)  # (b, h_q + 2·h_kv, s, d)
        qk = apply_rope(heads[:, : self.num_heads + self.num_kv_heads], *rope[self.rope])  # q and k rotated together
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # (b, h_q, s, d), (b, h_kv, s, d)
        if self.query_scale is not None:
            q = q * self.query_scale
        v = heads[:, self.num_heads + self.num_kv_heads:]  # (b, h_kv, s, d)
        out = batch.attend(q, k, v, cache, self.window)  # (b, h_q, s, d); k, v written into the cache first
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.q_size))  # (b, s, h_q·d) -> (b, s, hidden)
