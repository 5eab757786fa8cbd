"""Each supported family as a composition of the shared parts (engine/models/layers.py).

A new family is an entry here, plus a part where it does something no family did before (and its
config keys in engine/config.py, its tensor names in weights/).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.models.layers import OffsetRMSNorm, PreNormBlock, RMSNorm, SandwichBlock


@dataclass(frozen=True)
class Architecture:
    block: type[PreNormBlock] | type[SandwichBlock]
    norm: type[RMSNorm] = RMSNorm  # every norm of the model: blocks, q/k heads, the final one
    qk_norm: bool = False  # each q and k head normalized (over d_h) before RoPE
    scaled_embedding: bool = False  # embeddings times sqrt(hidden), rounded to the model's dtype


ARCHITECTURES = {
    "llama": Architecture(PreNormBlock),
    "mistral": Architecture(PreNormBlock),
    "qwen2": Architecture(PreNormBlock),  # q/k/v biases: the config's
    "qwen3": Architecture(PreNormBlock, qk_norm=True),
    "gemma3_text": Architecture(SandwichBlock, norm=OffsetRMSNorm, qk_norm=True, scaled_embedding=True),
}
