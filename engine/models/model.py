"""A decoder: embedding, blocks, final norm, LM head; the parts each family composes are engine/models/architecture.py's."""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.models.architecture import ARCHITECTURES
from engine.models.layers import RMSNorm
from engine.batch import DecodeBatch, PrefillBatch
from engine.config import ModelConfig
from engine.kv_cache import KVCache
from engine.linear.codes import QuantizedWeight
from engine.linear.planner import Decision, Machine, Planner, Role
from engine.pages import Placement
from engine.rope import RotaryTable

KERNEL_DTYPES = (torch.bfloat16, torch.float32)  # the dtypes kvserve's rms_norm computes in


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        architecture = ARCHITECTURES[config.model_type]
        # Gemma: sqrt(hidden) rounded to the embedding's dtype, as its reference rounds it, by dtype (None: not
        # scaled); rounded here, once, not in every step.
        scale = math.sqrt(config.hidden_size)
        self.embedding_scale = {dtype: torch.tensor(scale, dtype=dtype, device="cpu").item()
                                for dtype in (torch.float32, torch.bfloat16, torch.float16)
                                } if architecture.scaled_embedding else None
        # Made uninitialized (its weight is loaded): normal_ on the meta device runs a Python reference that imports
        # torch's compiler, about 70 MB that a process serving compiled-ahead steps never needs.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(architecture.block(config, i, architecture.norm, architecture.qk_norm)
                                    for i in range(config.num_layers))
        self.norm = architecture.norm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.plan: tuple[Decision, ...] = ()  # which layer serves each linear product, and why (`build_model`)
        self.pages = Placement(0, 0)  # the weights moved onto huge pages, where the loader moved them

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
            # Rounded to the dtype, as Gemma's reference rounds it, and materialized: inside one compiled graph,
            # inductor fuses this multiply into the first norm and reads the product unrounded, even with
            # emulate_precision_casts (the many-row graph then gave a row other bits than it got alone, and a
            # verified draft flipped a near tie on gemma-3-270m). The break ends the first graph at x, which is
            # then a bfloat16 tensor; eager, it does nothing.
            x = (x.float() * self.embedding_scale[x.dtype]).to(x.dtype)
            torch._dynamo.graph_break()
        for index, layer in enumerate(self.layers):
            x = layer(x, rope, cache.layer(index), batch)
        return self.norm(x)

    @property
    def dtype(self) -> torch.dtype:
        """What the blocks compute in and the cache holds: the norms' dtype, the checkpoint's as loaded."""
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def build_model(config: ModelConfig, state: dict[str, torch.Tensor | QuantizedWeight], device: torch.device,
                planner: Planner | None = None) -> Transformer:
    """A Transformer holding exactly `state` (strict: every parameter present, no extras), on `device`.

    Each linear layer is what `planner` decides for its weight (by default: dense, as this machine runs it
    fastest), and so is the embedding (dense, or read from codes: a tied head's or its own); the decisions, with their reasons,
    are the model's `plan`. The norms stay dense, computed by kvserve's kernel where it runs (RMSNorm).
    """
    planner = planner or Planner(Machine.found(device))
    with torch.device("meta"):
        model = Transformer(config)
    state = dict(state)
    embedding = state["embed_tokens.weight"] if config.tie_word_embeddings else None
    decisions = []
    for name in [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]:
        weight, bias = state.pop(f"{name}.weight"), state.pop(f"{name}.bias", None)
        decision = planner.plan(weight, bias, Role(name, embedding if name == "lm_head" else None))
        state |= decision.layer.state_dict(prefix=f"{name}.")
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, decision.layer)
        decisions.append(decision)
    head = next(d for d in decisions if d.name == "lm_head") if config.tie_word_embeddings else None
    lookup = planner.embedding(state.pop("embed_tokens.weight"), head, state["norm.weight"].dtype)
    model.embed_tokens = lookup.layer
    state |= lookup.layer.state_dict(prefix="embed_tokens.")
    decisions.insert(0, lookup)
    model.load_state_dict(state, strict=True, assign=True)
    retie(model)
    for norm in (m for m in model.modules() if isinstance(m, RMSNorm)):
        norm.by_kernel = planner.machine.cpu and planner.machine.kernels_off is None and norm.weight.dtype in KERNEL_DTYPES
    model.plan = tuple(decisions)
    return model.to(device).eval().requires_grad_(False)


def retie(model: Transformer) -> None:
    """assign=True made each name its own Parameter: a head that computes on the embedding itself (tied, in any
    form) gets the embedding's Parameter back, so the two stay one tensor."""
    embedding = getattr(model.embed_tokens, "weight", None)
    if embedding is None:  # read from the head's codes: nothing to tie
        return
    for module in model.lm_head.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, nn.Parameter) and weight is not embedding and weight.data_ptr() == embedding.data_ptr():
            module.weight = embedding


def weights_bytes(model: nn.Module) -> int:
    """The bytes of every parameter and buffer, each tensor once (tied weights share one)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())
