"""--tensor-parallel-size N: the model split over N processes, rank 0 serving HTTP, ranks 1..N-1 its workers.

Every rank holds a full engine on its shard (engine/tensor_parallel.py). Rank 0's runner drives its engine as
always; each call that changes an engine's state (add a request, abort one, step) is first broadcast to the
workers, which make the same call on theirs. Same calls in the same order, same seed: every rank's scheduler
and sampler decide the same, so the collectives inside the model line up (gpt-fast's scheme; vLLM's
multiprocessing executor broadcasts each step's inputs the same way). The one thing a rank would decide from its
own timings, how many drafts each request's step verifies (speculative decoding), rank 0 decides and sends within
the step.

Two groups: the model's (NCCL on GPUs, one per rank; gloo on the CPU), whose collectives time out after
--collective-timeout (a stuck peer), and the commands' (gloo), which waits as long as the server is idle. On one machine rank 0 spawns the workers and watches
them: a worker that exits fails the server at once (/health 503, open streams end with an error naming the rank,
the process exits 1). With --nnodes > 1, node k runs ranks k·N/nnodes .. (k+1)·N/nnodes - 1 and reaches node 0 at
--master-addr:--master-port, as torchrun's rendezvous settings do.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Callable

import torch
import torch.distributed as dist

from engine import Engine, EngineConfig, SamplingParams
from engine.kv_cache import format_bytes
from engine.tensor_parallel import PeerLost, Shard
from weights.loading import load_shard

log = logging.getLogger("kvserve.tensor_parallel")

IDLE_TIMEOUT = timedelta(days=365)  # the commands' group: a server may stay idle for as long as it likes


@dataclass(frozen=True)
class Command:
    """One engine call, as rank 0 made it; it travels as JSON (nothing is unpickled from the network)."""

    kind: str  # "add", "abort", "step" or "stop"
    prompt_ids: tuple[int, ...] = ()
    params: SamplingParams | None = None
    request_id: str | None = None

    def encode(self) -> dict:
        return {"kind": self.kind, "prompt_ids": list(self.prompt_ids), "request_id": self.request_id,
                "params": None if self.params is None else dataclasses.asdict(self.params)}

    @classmethod
    def decode(cls, fields: dict) -> "Command":
        params = fields["params"]
        if params is not None:  # JSON made the tuples lists
            params = SamplingParams(**{k: tuple(v) if isinstance(v, list) else v for k, v in params.items()})
        return cls(fields["kind"], tuple(fields["prompt_ids"]), params, fields["request_id"])


@dataclass(frozen=True)
class Group:
    """Where the ranks meet, and how long a collective may wait for a peer."""

    rank: int
    world: int
    init_method: str  # tcp://node-0:port, or file://path on one machine
    collective_timeout: float  # seconds
    device: str  # the server's --device: cpu, or cuda (one GPU per rank on each machine)
    local_ranks: int  # ranks on this machine

    @property
    def rank_device(self) -> str:
        """This rank's device: the CPU, or the GPU of its place on its machine."""
        if self.device == "cpu" or self.device == "auto" and not torch.cuda.is_available():
            return "cpu"
        return f"cuda:{self.rank % self.local_ranks}"

    def join(self) -> "Channel":
        """Join the default (model) group and return the commands' channel; every rank calls this, and the
        rendezvous waits for all of them. The model's collectives run over NCCL on GPUs, gloo on the CPU; the
        commands always over gloo (CPU tensors)."""
        backend = "gloo" if self.rank_device == "cpu" else "nccl"
        if backend == "nccl":
            torch.cuda.set_device(self.rank_device)
        dist.init_process_group(backend, init_method=self.init_method, rank=self.rank, world_size=self.world,
                                timeout=timedelta(seconds=self.collective_timeout))
        return Channel(dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT), self.collective_timeout)


class Channel:
    """Rank 0's calls to the other ranks: JSON bytes broadcast over a group of their own.

    The group's timeout is long, for workers that wait through idle hours; rank 0's sends wait at most the
    collective timeout, so that a stuck worker fails the server instead of hanging it.
    """

    def __init__(self, group: dist.ProcessGroup, send_timeout: float):
        self.group = group
        self.send_timeout = timedelta(seconds=send_timeout)

    def send(self, message: dict) -> None:
        data = torch.frombuffer(bytearray(json.dumps(message).encode()), dtype=torch.uint8)
        for tensor in (torch.tensor([data.numel()]), data):  # the length first: the receivers size their buffer
            try:
                dist.broadcast(tensor, src=0, group=self.group, async_op=True).wait(self.send_timeout)
            except RuntimeError as error:
                raise PeerLost(f"sending an engine call to the other ranks failed (a collective): {error}") from error

    def receive(self) -> dict:
        length = torch.zeros(1, dtype=torch.long)
        try:
            dist.broadcast(length, src=0, group=self.group)
            data = torch.empty(int(length), dtype=torch.uint8)
            dist.broadcast(data, src=0, group=self.group)
        except RuntimeError as error:
            raise PeerLost(f"rank 0 is gone: {error}") from error
        return json.loads(data.numpy().tobytes())


class LeaderEngine(Engine):
    """Rank 0's engine: every call that changes an engine's state goes to the other ranks first."""

    def __init__(self, model, tokenizer, config: EngineConfig, channel: Channel, world: int):
        super().__init__(model, tokenizer, config)
        self.channel = channel
        self.world = world

    def add_request(self, prompt, params: SamplingParams = SamplingParams(), request_id: str | None = None):
        prompt_ids = self._prompt_ids(prompt)
        self.channel.send(Command("add", tuple(prompt_ids), params, request_id).encode())
        return super().add_request(prompt_ids, params, request_id)

    def abort(self, request_id: str) -> bool:
        self.channel.send(Command("abort", request_id=request_id).encode())
        return super().abort(request_id)

    def step(self):
        self.channel.send(Command("step").encode())
        return super().step()

    def _drafts(self, requests):
        """The step's drafts, decided here (by rank 0's timings) and sent to the other ranks, which verify the
        same rows: every rank's forward must hold the same positions for the collectives inside it to line up."""
        drafts = super()._drafts(requests)
        self.channel.send({"drafts": drafts})
        return drafts

    def close(self) -> None:
        try:
            self.channel.send(Command("stop").encode())  # the workers leave their loops and exit 0
        except PeerLost as error:  # a rank is gone already (its exit is what failed the server): none to stop
            log.info("the other ranks were not told to stop: %s", error)

    @property
    def compile_blocker(self) -> str | None:
        return "tensor parallelism decodes eagerly so far"

    @property
    def tensor_parallel_size(self) -> int:
        return self.world


class FollowerEngine(Engine):
    """A worker's engine: each step's drafts (speculative decoding) are rank 0's, received, not its own."""

    def __init__(self, model, tokenizer, config: EngineConfig, channel: Channel):
        super().__init__(model, tokenizer, config)
        self.channel = channel

    def _drafts(self, requests):
        # JSON made each (method, tokens) a list
        return {request_id: (method, tokens) for request_id, (method, tokens) in
                self.channel.receive()["drafts"].items()}


def follow(engine: Engine, channel: Channel) -> None:
    """A worker's loop: make each call rank 0 makes, until it says stop. Errors that rank 0 meets too (a prompt
    too long) are its to report; here they only keep the worker in step."""
    while (command := Command.decode(channel.receive())).kind != "stop":
        if command.kind == "step":
            engine.step()
        elif command.kind == "abort":
            engine.abort(command.request_id)
        else:
            try:
                engine.add_request(list(command.prompt_ids), command.params, command.request_id)
            except Exception:  # rank 0 raised the same, and its runner reported it
                pass


def engine_config(config: EngineConfig, seed: int) -> EngineConfig:
    """Every rank's config: one seed for all (so sampling agrees), eager decode; speculation as configured (rank
    0 sends each step's drafts: LeaderEngine._drafts)."""
    return dataclasses.replace(config, seed=seed, compile="off")


def threads_per_rank(local_ranks: int) -> int:
    """The CPU's cores shared among the ranks on this machine: oversubscribed threads stall every collective."""
    return max(1, (os.cpu_count() or 1) // local_ranks)


def start(settings, path: str, on_worker_exit: Callable[[str], None]) -> tuple[LeaderEngine, Workers]:
    """Rank 0: spawn this machine's workers, meet them (and other nodes' ranks), send the config, load its shard."""
    world, local = settings.tensor_parallel_size, settings.ranks_per_node
    config = engine_config(settings.engine_config(), settings.seed if settings.seed is not None else torch.seed())
    init_method, folder = rendezvous(settings)
    group = Group(0, world, init_method, settings.collective_timeout, settings.device, local)
    workers = Workers.spawn(range(1, local), group, path, settings.dtype, folder)
    workers.watch(on_worker_exit)
    torch.set_num_threads(threads_per_rank(local))
    channel = group.join()
    config = dataclasses.replace(config, device=group.rank_device)
    channel.send(dataclasses.asdict(config))  # one seed for all: every rank samples the same tokens
    model, tokenizer = load_shard(path, group.rank_device, settings.dtype, config.quantize, Shard(0, world))
    engine = LeaderEngine(model, tokenizer, config, channel, world)
    capacity = engine.cache_capacity_bytes
    log.info("tensor parallel over %d ranks: each holds %d of the model's K/V heads; KV cache %s per rank, %s in "
             "all (2*B*L*T*(h_kv/N)*d_h*itemsize per rank)", world, engine.cache_terms()["h_kv"],
             format_bytes(capacity), format_bytes(world * capacity))
    return engine, workers


def run_node(settings, path: str) -> int:
    """A node other than 0: its ranks only, until they end; the exit code of the first that failed, else 0."""
    local = settings.ranks_per_node
    init_method, folder = rendezvous(settings)
    group = Group(0, settings.tensor_parallel_size, init_method, settings.collective_timeout, settings.device, local)
    first = settings.node_rank * local
    workers = Workers.spawn(range(first, first + local), group, path, settings.dtype, folder)
    codes = []
    for process in workers.processes.values():
        process.join()
        codes.append(process.exitcode)
    workers.end()
    return next((code for code in codes if code), 0)


def rendezvous(settings) -> tuple[str, str | None]:
    """Where the ranks meet: node 0's address and port, or on one machine a file in a folder of this server's;
    and that folder, for Workers.end to remove (None for an address)."""
    if settings.master_port:
        return f"tcp://{settings.master_addr}:{settings.master_port}", None
    folder = tempfile.mkdtemp(prefix="kvserve-tp-")
    return f"file://{folder}/rendezvous", folder


def run_worker(group: Group, path: str, dtype: str) -> None:
    """A worker process: meet the group, take rank 0's config, load its shard, follow rank 0 until told to stop
    or a peer is lost."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank {group.rank}: %(message)s")
    torch.set_num_threads(threads_per_rank(group.local_ranks))
    channel = group.join()
    config = dataclasses.replace(EngineConfig(**channel.receive()), device=group.rank_device)
    model, tokenizer = load_shard(path, group.rank_device, dtype, config.quantize, Shard(group.rank, group.world))
    engine = FollowerEngine(model, tokenizer, config, channel)
    log.info("rank %d of %d loaded its shard", group.rank, group.world)
    try:
        follow(engine, channel)
    except PeerLost as error:
        log.error("rank %d stops: %s", group.rank, error)
        os._exit(1)
    os._exit(0)  # gloo's teardown at interpreter exit can abort; the group's work is done


class Workers:
    """This machine's worker processes, and a thread that fails the server when one of them exits."""

    def __init__(self, processes: dict[int, multiprocessing.Process], folder: str | None):
        self.processes = processes  # rank -> process
        self.folder = folder  # the rendezvous file's, removed by end()

    @classmethod
    def spawn(cls, ranks: range, group: Group, path: str, dtype: str, folder: str | None) -> "Workers":
        context = multiprocessing.get_context("spawn")  # fork would copy the parent's threads and torch state
        processes = {}
        for rank in ranks:
            worker_group = dataclasses.replace(group, rank=rank)
            processes[rank] = context.Process(target=run_worker, name=f"kvserve-rank-{rank}", daemon=True,
                                              args=(worker_group, path, dtype))
            processes[rank].start()
        return cls(processes, folder)

    def watch(self, on_exit: Callable[[str], None]) -> None:
        """Call on_exit(message naming the rank) from a thread of its own when a worker exits, whatever its code."""
        if not self.processes:  # node 0's only rank is this process: the other nodes' exits show as lost peers
            return

        def run() -> None:
            sentinels = {process.sentinel: rank for rank, process in self.processes.items()}
            (ready, *_) = wait(list(sentinels))
            rank = sentinels[ready]
            process = self.processes[rank]
            process.join()
            on_exit(f"tensor-parallel worker rank {rank} (pid {process.pid}) exited with code {process.exitcode}")

        threading.Thread(target=run, name="kvserve-workers", daemon=True).start()

    def end(self) -> None:
        """Kill the workers still running (stopped ones have exited already) and remove the rendezvous folder."""
        for process in self.processes.values():
            if process.is_alive():
                process.kill()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
