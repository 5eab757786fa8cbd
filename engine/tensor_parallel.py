"""Tensor parallelism: one model split over the N ranks of a torch.distributed group, as Megatron-LM splits it.

Each rank holds a slice of every block and runs every step on it:
- attention: its h_q/N query heads and the K/V heads they read. With h_kv divisible by N each rank holds
  h_kv/N of them; with fewer K/V heads than ranks (N a multiple of h_kv), each is replicated on the N/h_kv
  ranks whose query heads read it, as vLLM does. The rank's KV cache holds only its own K/V heads.
- q/k/v and gate/up are split by output rows (column-parallel: no communication); the output and down
  projections by input columns (row-parallel), whose partial sums one all-reduce adds: two per layer.
- the embedding and the LM head are split over the vocabulary: a rank looks up only its own tokens (one
  all-reduce fills in the rest) and computes only its own logits (one all-gather joins them).

Every rank runs the same engine on the same inputs (the scheduler's decisions are deterministic given
them), so the collectives line up without a coordinator; what decides the inputs is the caller's (gpt-fast
runs its tensor parallelism the same way; the server sends rank 0's calls to the others, server/tensor_parallel).

A collective that fails (a peer died, or it timed out) raises `PeerLost`, a BaseException: the engine's
per-request isolation catches Exceptions and would go on, but ranks out of step cannot.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.linear.codes import QUANTIZED, QuantizedWeight
from engine.linear.planner import Planner
from engine.models.model import Transformer, build_model


Weight = torch.Tensor | QuantizedWeight


class PeerLost(BaseException):
    """A collective failed: another rank is gone or stuck, and this one cannot go on alone."""


def collective(operation, *args, **kwargs) -> None:
    """Run one torch.distributed collective; its failure becomes PeerLost."""
    try:
        operation(*args, **kwargs)
    except RuntimeError as error:  # gloo: connection closed or reset by a dead peer, or the group's timeout
        raise PeerLost(f"a tensor-parallel collective failed ({operation.__name__}): {error}") from error


@dataclass(frozen=True)
class Shard:
    """This process's place in a tensor-parallel group of `world` ranks."""

    rank: int
    world: int

    def __post_init__(self) -> None:
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is not in a group of {self.world}")

    def check(self, config: ModelConfig) -> None:
        """Raise if the model's heads cannot be split over the ranks."""
        n, h_q, h_kv = self.world, config.num_heads, config.num_kv_heads
        if h_q % n or config.intermediate_size % n:
            raise ValueError(f"tensor parallelism over {n} ranks needs the query heads ({h_q}) and the MLP width "
                             f"({config.intermediate_size}) divisible by {n}")
        if h_kv % n and n % h_kv:
            raise ValueError(f"{h_kv} key/value heads can neither be split over {n} ranks nor replicated on them")

    def kv_heads(self, config: ModelConfig) -> range:
        """The K/V heads this rank's query heads read: its share, or the one head it replicates."""
        per_rank = max(config.num_kv_heads // self.world, 1)
        first = self.rank * config.num_heads // self.world // config.query_groups
        return range(first, first + per_rank)

    def vocab_rows(self, vocab_size: int) -> range:
        """This rank's rows of the embedding and the LM head: ceil(V/N) each, the last rank's padded past V."""
        per_rank = math.ceil(vocab_size / self.world)
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)


def shard_checkpoint(config: ModelConfig, state: dict[str, Weight], shard: Shard
                     ) -> tuple[ModelConfig, dict[str, Weight]]:
    """The rank's part of a dense checkpoint: a config of its own heads, MLP width and vocabulary rows, and the
    tensors of its slices, to build a model from (`parallelize` then gives it back the whole vocabulary).

    The embedding and head tensors are the rank's rows, padded with zeros to ceil(V/N). Quantized matrices
    (GroupCodes, SuperBlockCodes) split the same way, columns in whole blocks (32 or 256 inputs).
    """
    shard.check(config)
    n, d = shard.world, config.head_dim
    heads = config.num_heads // n
    q_rows = slice(shard.rank * heads * d, (shard.rank + 1) * heads * d)
    kv = shard.kv_heads(config)
    k_rows = slice(config.q_size + kv.start * d, config.q_size + kv.stop * d)
    v_rows = slice(config.q_size + config.kv_size + kv.start * d, config.q_size + config.kv_size + kv.stop * d)
    width = config.intermediate_size // n
    gate_rows = slice(shard.rank * width, (shard.rank + 1) * width)
    up_rows = slice(config.intermediate_size + gate_rows.start, config.intermediate_size + gate_rows.stop)
    vocab = shard.vocab_rows(config.vocab_size)

    def rows(tensor: Weight, *slices: slice) -> Weight:
        if isinstance(tensor, QUANTIZED):  # codes, scales and minimums all lead with the output rows
            return tensor.map_rows(lambda t: rows(t, *slices))
        return torch.cat([tensor[s] for s in slices]).contiguous()

    def columns(tensor: Weight, part: slice) -> Weight:
        if isinstance(tensor, QUANTIZED):  # whole blocks of inputs: a rank's columns start and end on one
            try:
                return tensor.columns(part)
            except ValueError as e:
                raise ValueError(f"a rank's {part.stop - part.start} input columns split quantized blocks ({e}): "
                                 "serve this split with --quantize none") from None
        return tensor[:, part].contiguous()

    def vocabulary(tensor: Weight) -> Weight:  # (V, hidden) -> (ceil(V/N), hidden), zero-padded (zero codes too)
        if isinstance(tensor, QUANTIZED):
            return tensor.map_rows(vocabulary)
        part = tensor[vocab.start: vocab.stop]
        return F.pad(part, (0, 0, 0, len(vocab) - part.shape[0])).contiguous()

    local = {}
    for name, tensor in state.items():
        if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            local[name] = rows(tensor, q_rows, k_rows, v_rows)
        elif name.endswith("o_proj.weight"):
            local[name] = columns(tensor, q_rows)
        elif name.endswith(("gate_up_proj.weight", "gate_up_proj.bias")):
            local[name] = rows(tensor, gate_rows, up_rows)
        elif name.endswith("down_proj.weight"):
            local[name] = columns(tensor, gate_rows)
        elif name.endswith(("o_proj.bias", "down_proj.bias")):  # added once, after the all-reduce's sum
            local[name] = tensor if shard.rank == 0 else torch.zeros_like(tensor)
        elif name in ("embed_tokens.weight", "lm_head.weight"):
            local[name] = vocabulary(tensor)
        else:  # norms: every rank needs them whole
            local[name] = tensor
    local_config = dataclasses.replace(config, num_heads=heads, num_kv_heads=len(kv), intermediate_size=width,
                                       vocab_size=len(vocab))
    return local_config, local


class AllReduced(nn.Module):
    """A row-parallel product: each rank's partial sum, added over the group."""

    def __init__(self, inner: nn.Module, group: dist.ProcessGroup | None):
        super().__init__()
        self.inner = inner
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        collective(dist.all_reduce, y, group=self.group)
        return y


class VocabParallelEmbedding(nn.Module):
    """The rank's rows of the embedding; tokens outside them read zeros, and one all-reduce fills them in."""

    def __init__(self, inner: nn.Module, first: int, group: dist.ProcessGroup | None):
        super().__init__()
        self.inner = inner  # the rank's ceil(V/N) rows: dense, or read from the head's codes
        self.first = first
        self.group = group

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.first
        rows = self.inner.num_embeddings
        mine = (local >= 0) & (local < rows)
        out = self.inner(local.clamp(0, rows - 1)) * mine[..., None]  # (..., hidden)
        collective(dist.all_reduce, out, group=self.group)
        return out


class VocabParallelHead(nn.Module):
    """The rank's rows of the LM head; one all-gather joins every rank's logits, cut back to the vocabulary."""

    def __init__(self, inner: nn.Module, vocab_size: int, world: int, group: dist.ProcessGroup | None):
        super().__init__()
        self.inner = inner
        self.vocab_size = vocab_size
        self.world = world
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        part = self.inner(x).contiguous()  # (..., ceil(V/N))
        parts = [torch.empty_like(part) for _ in range(self.world)]
        collective(dist.all_gather, parts, part, group=self.group)
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]  # (..., V)


def parallelize(model: nn.Module, config: ModelConfig, shard: Shard, group: dist.ProcessGroup | None = None) -> nn.Module:
    """A model built from `shard_checkpoint`'s part, made to compute the whole model's outputs with the group: in place.

    `config` is the whole model's; the model's own becomes the rank's heads with the whole vocabulary.
    """
    for block in model.layers:
        block.self_attn.o_proj = AllReduced(block.self_attn.o_proj, group)
        block.mlp.down_proj = AllReduced(block.mlp.down_proj, group)
    first = shard.vocab_rows(config.vocab_size).start
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, first, group)
    model.lm_head = VocabParallelHead(model.lm_head, config.vocab_size, shard.world, group)
    model.config = dataclasses.replace(model.config, vocab_size=config.vocab_size)
    return model


def shard_model(config: ModelConfig, state: dict[str, Weight], shard: Shard, device: torch.device,
                group: dist.ProcessGroup | None = None, planner: Planner | None = None) -> Transformer:
    """The rank's part of a checkpoint, built (each matrix as `planner` decides) and made to compute the whole
    model's outputs with the group."""
    return parallelize(build_model(*shard_checkpoint(config, state, shard), device, planner), config, shard, group)


@contextmanager
def cpu_group(rank: int, world: int, port: int) -> Iterator[None]:
    """The default process group over gloo and TCP on this machine, for the block.

    On leaving, a barrier first, so that no rank tears down its connections while another still uses them.
    """
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()
