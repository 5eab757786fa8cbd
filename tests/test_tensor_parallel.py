"""Tensor parallelism on the CPU: 2 processes over gloo compute what one process computes, from half the weights."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from gguf import GGMLQuantizationType
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from bench.common import free_port
from engine import Engine, EngineConfig
from engine.config import ModelConfig
from engine.sampling import SamplingParams
from engine.linear.planner import Machine, codes_layer_class
from engine.linear.quantized import WeightOnlyLinear
from engine.tensor_parallel import Shard, cpu_group, shard_model
from weights.loading import load_shard
from engine.tokenizer import Tokenizer
from httpx_sse import connect_sse
from server.tensor_parallel import Channel, FollowerEngine, LeaderEngine, follow
from tests.server_harness import start_subprocess
from tests.test_gguf import write_gguf
from weights.checkpoint import load_checkpoint
from weights.gguf_file import import_gguf
from weights.loading import load_engine

PROMPTS = ["The quick brown fox", "Once upon a time there was"]
REPEATING = ["a b c a b c a b c a b", "one two one two one"]  # prompts whose n-grams recur: drafts to verify
SETTINGS = dict(device="cpu", dtype="float32", max_batch_size=2, max_seq_len=64, compile="off", seed=0)
GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)


def run_rank(rank: int, world: int, path: str, port: int, out: str) -> None:
    """One rank: its shard of the checkpoint, in an engine of its own, running what every rank runs."""
    torch.set_num_threads(1)
    with cpu_group(rank, world, port):
        config, state = load_checkpoint(Path(path), torch.float32)
        model = shard_model(config, state, Shard(rank, world), torch.device("cpu"))
        engine = Engine(model, Tokenizer.from_dir(Path(path)), EngineConfig(**SETTINGS))
        logits = engine.prompt_logits(PROMPTS[1])
        tokens = [c.output_ids for c in engine.generate(PROMPTS, GREEDY)]
        save_file({"logits": logits.contiguous()}, f"{out}/logits.{rank}.safetensors")
        Path(f"{out}/rank.{rank}.json").write_text(json.dumps(
            {"tokens": tokens, "cache_bytes": engine.cache.capacity_bytes, "kv_heads": engine.cache.num_kv_heads}))
    # Leave without finalizing the interpreter: gloo's worker threads may still hold tensors whose release
    # then aborts the process (SIGABRT, about one run in ten here; pytorch/pytorch pull request 179291 describes it).
    os._exit(0)


@pytest.mark.parametrize("variant", ["mha", "gqa", "mqa", "qwen2_bias", "tied"])
def test_two_ranks_compute_what_one_computes(model_dir, tmp_path, variant):
    path = model_dir(variant)
    mp.spawn(run_rank, args=(2, str(path), free_port(), str(tmp_path)), nprocs=2, join=True)
    whole = load_engine(path, EngineConfig(**SETTINGS))
    expected_logits = whole.prompt_logits(PROMPTS[1])
    expected_tokens = [c.output_ids for c in whole.generate(PROMPTS, GREEDY)]
    config = whole.model.config
    for rank in range(2):
        got = json.loads((tmp_path / f"rank.{rank}.json").read_text())
        torch.testing.assert_close(load_file(tmp_path / f"logits.{rank}.safetensors")["logits"], expected_logits,
                                   rtol=1e-4, atol=1e-4)
        assert got["tokens"] == expected_tokens  # greedy, token for token
        # Each rank's cache holds its K/V heads only: h_kv/2 of them, or the one it replicates (MQA).
        kv_heads = max(config.num_kv_heads // 2, 1)
        assert got["kv_heads"] == kv_heads
        assert got["cache_bytes"] == whole.cache.capacity_bytes * kv_heads // config.num_kv_heads


def run_speculating_rank(rank: int, world: int, path: str, port: int, out: str) -> None:
    """One rank of a speculating pair: rank 0 a LeaderEngine that drafts on every step it can, rank 1 a
    FollowerEngine following it over the commands' channel, as the server's ranks do."""
    torch.set_num_threads(1)
    with cpu_group(rank, world, port):
        config, state = load_checkpoint(Path(path), torch.float32)
        model = shard_model(config, state, Shard(rank, world), torch.device("cpu"))
        channel = Channel(dist.new_group(backend="gloo"), send_timeout=60)
        settings = EngineConfig(**SETTINGS, speculative="ngram")
        tokenizer = Tokenizer.from_dir(Path(path))
        if rank == 0:
            engine = LeaderEngine(model, tokenizer, settings, channel, world)
            engine.step_costs.threshold = lambda batch: 0.0  # every draft is verified, whatever this machine's timings
            tokens = [c.output_ids for c in engine.generate(REPEATING, GREEDY)]
            engine.close()
            Path(f"{out}/leader.json").write_text(json.dumps({"tokens": tokens, "drafts": engine.draft_totals}))
        else:
            follow(FollowerEngine(model, tokenizer, settings, channel), channel)
    os._exit(0)  # as run_rank


def test_two_ranks_verify_rank_0s_drafts_and_answer_as_one_process_without_them(model_dir, tmp_path):
    path = model_dir("gqa")
    mp.spawn(run_speculating_rank, args=(2, str(path), free_port(), str(tmp_path)), nprocs=2, join=True)
    got = json.loads((tmp_path / "leader.json").read_text())
    plain = load_engine(path, EngineConfig(**SETTINGS))
    assert got["tokens"] == [c.output_ids for c in plain.generate(REPEATING, GREEDY)]
    assert got["drafts"][0] > 0  # drafts were verified, the same rows on both ranks


def config_of(heads: int, kv_heads: int, intermediate: int = 128) -> ModelConfig:
    return ModelConfig(vocab_size=10, hidden_size=64, intermediate_size=intermediate, num_layers=1, num_heads=heads,
                       num_kv_heads=kv_heads, head_dim=16, max_position_embeddings=32)


def test_heads_that_cannot_be_split_are_refused():
    with pytest.raises(ValueError, match="query heads"):
        Shard(0, 2).check(config_of(heads=3, kv_heads=1))
    with pytest.raises(ValueError, match="neither be split"):
        Shard(0, 4).check(config_of(heads=12, kv_heads=6))
    Shard(1, 4).check(config_of(heads=8, kv_heads=2))  # each K/V head replicated on two ranks


def test_each_rank_reads_the_kv_heads_its_query_heads_use():
    gqa = config_of(heads=8, kv_heads=2)  # query heads 0-3 read K/V head 0, 4-7 head 1
    assert [list(Shard(r, 4).kv_heads(gqa)) for r in range(4)] == [[0], [0], [1], [1]]
    assert [list(Shard(r, 2).kv_heads(gqa)) for r in range(2)] == [[0], [1]]
    assert [list(Shard(r, 2).vocab_rows(9)) for r in range(2)] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]


def tensor_parallel_server(model: Path, port: int, *flags: str, **environ: str):
    """`python -m server --tensor-parallel-size 2` on the CPU, started as a user starts it."""
    env = dict(os.environ, KVSERVE_COMPILE="off", **environ)
    return start_subprocess("--model", str(model), "--port", str(port), "--device", "cpu", "--dtype", "float32",
                            "--tensor-parallel-size", "2", "--max-batch-size", "2", "--seed", "0", *flags, env=env)


def worker_pids(server_pid: int) -> list[int]:
    """The server's spawned worker processes (multiprocessing's spawn children), from /proc."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            if parent == server_pid and b"spawn_main" in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return pids


def test_a_server_over_two_ranks_answers_as_one_process_does(model_dir, tmp_path):
    path, port = model_dir("gqa"), free_port()
    process, lines = tensor_parallel_server(path, port, "--max-seq-len", "64", "--speculative", "auto",
                                            TMPDIR=str(tmp_path))
    try:
        assert len(list(tmp_path.glob("kvserve-tp-*/rendezvous"))) == 1  # where the ranks met
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/health").json() == {"status": "ok"}, "".join(lines)
        whole = load_engine(path, EngineConfig(**SETTINGS))
        (expected,) = whole.generate([PROMPTS[0]], SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True))
        info = httpx.get(f"{url}/info").json()
        # each rank's cache: h_kv/2 heads; /info gives one rank's and the total
        assert info["kv_cache"]["h_kv"] == 1 and info["tensor_parallel"]["size"] == 2
        assert info["speculative_decoding"]["method"] == "auto"  # and the answers below are those without it
        per_rank = whole.cache.capacity_bytes // 2
        assert info["tensor_parallel"] == {"size": 2, "kv_cache_bytes_per_rank": per_rank,
                                           "kv_cache_bytes_total": 2 * per_rank}
        body = {"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 10, "do_sample": False}}
        with httpx.Client(base_url=url, timeout=60) as client:
            with connect_sse(client, "POST", "/generate_stream", json=body) as source:
                events = [json.loads(e.data) for e in source.iter_sse()]
            assert [e["token"]["id"] for e in events] == expected.output_ids  # streamed, token for token
            completion = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 10,
                                                              "temperature": 0}).json()
            chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                             "max_tokens": 5}).json()
        assert completion["choices"][0]["text"] == expected.text
        assert chat["choices"][0]["message"]["role"] == "assistant" and chat["usage"]["completion_tokens"] >= 1
        assert any("tensor parallel over 2 ranks" in line for line in lines), "".join(lines)
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0  # the workers were told to stop: not a failure
        assert not list(tmp_path.glob("kvserve-tp-*"))  # the rendezvous folder went with them
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_dead_worker_ends_the_streams_and_the_server(model_dir):
    port = free_port()
    process, lines = tensor_parallel_server(model_dir("long"), port, "--max-seq-len", "4096")
    try:
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/health").status_code == 200, "".join(lines)
        (worker,) = worker_pids(process.pid)
        body = {"prompt": "hi", "stream": True, "max_tokens": 4000, "ignore_eos": True}
        with httpx.Client(base_url=url, timeout=60) as client, connect_sse(client, "POST", "/v1/completions", json=body) as source:
            events = source.iter_sse()
            assert json.loads(next(events).data)["object"] == "text_completion"
            os.kill(worker, signal.SIGKILL)
            rest = [e.data for e in events]  # the server ends the stream itself
        assert rest[-1] == "[DONE]"
        assert "rank 1" in json.loads(rest[-2])["error"]["message"]
        assert process.wait(60) == 1  # non-zero: a supervisor restarts it
        output = process.stdout.read()
        assert "tensor-parallel worker rank 1" in output
        assert "Traceback" not in output  # the lost rank is the message, not a crash of the engine loop
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_stuck_worker_fails_the_server_after_the_collective_timeout(model_dir):
    port = free_port()
    process, lines = tensor_parallel_server(model_dir("long"), port, "--max-seq-len", "4096", "--collective-timeout", "3")
    (worker,) = worker_pids(process.pid)
    try:
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/health").status_code == 200, "".join(lines)
        body = {"prompt": "hi", "stream": True, "max_tokens": 4000, "ignore_eos": True}
        with httpx.Client(base_url=url, timeout=60) as client, connect_sse(client, "POST", "/v1/completions", json=body) as source:
            events = source.iter_sse()
            assert json.loads(next(events).data)["object"] == "text_completion"
            os.kill(worker, signal.SIGSTOP)  # alive, but never answers: only the timeout can tell
            rest = [e.data for e in events]
        assert rest[-1] == "[DONE]"
        assert "collective" in json.loads(rest[-2])["error"]["message"]
        assert process.wait(60) == 1
    finally:
        os.kill(worker, signal.SIGKILL)
        if process.poll() is None:
            process.kill()
            process.wait()


def test_two_nodes_meet_at_the_master_address(model_dir):
    """--nnodes 2 on one machine: node 1 runs rank 1 only and reaches node 0 at --master-addr:--master-port."""
    path, port, master = model_dir("gqa"), free_port(), free_port()
    flags = ["--model", str(path), "--device", "cpu", "--dtype", "float32", "--tensor-parallel-size", "2",
             "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(master), "--max-seq-len", "64",
             "--seed", "0"]
    node1 = subprocess.Popen([sys.executable, "-m", "server", *flags, "--node-rank", "1"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    process, lines = start_subprocess(*flags, "--port", str(port), "--max-batch-size", "2",
                                      env=dict(os.environ, KVSERVE_COMPILE="off"))
    try:
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/health").status_code == 200, "".join(lines)
        whole = load_engine(path, EngineConfig(**SETTINGS))
        (expected,) = whole.generate([PROMPTS[0]], SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True))
        completion = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0,
                                                                "ignore_eos": True}, timeout=60).json()
        assert completion["choices"][0]["text"] == expected.text
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
        assert node1.wait(60) == 0  # told to stop by rank 0
    finally:
        for p in (process, node1):
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_two_gpus_over_nccl_answer_as_one_gpu_does(model_dir):
    path, port = model_dir("gqa"), free_port()
    env = dict(os.environ, KVSERVE_COMPILE="off")
    process, lines = start_subprocess("--model", str(path), "--port", str(port), "--device", "cuda", "--dtype",
                                      "float32", "--tensor-parallel-size", "2", "--max-seq-len", "64", "--seed", "0",
                                      env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/health").status_code == 200, "".join(lines)
        whole = load_engine(path, EngineConfig(**(SETTINGS | {"device": "cuda"})))
        (expected,) = whole.generate([PROMPTS[0]], SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True))
        completion = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 10, "temperature": 0,
                                                                "ignore_eos": True}, timeout=60).json()
        assert completion["choices"][0]["text"] == expected.text
        assert httpx.get(f"{url}/info").json()["device"] == "cuda:0"
    finally:
        process.kill()
        process.wait()


def run_quantized_rank(rank: int, world: int, path: str, port: int, out: str) -> None:
    """One rank of a GGUF served as stored: its shard of the codes, as the server loads it."""
    torch.set_num_threads(1)
    with cpu_group(rank, world, port):
        model, tokenizer = load_shard(Path(path), "cpu", "auto", "auto", Shard(rank, world))
        engine = Engine(model, tokenizer, EngineConfig(**(SETTINGS | {"dtype": "auto"})))
        save_file({"logits": engine.prompt_logits(PROMPTS[1]).contiguous()}, f"{out}/logits.{rank}.safetensors")
        kinds = {type(m).__name__ for m in engine.model.modules() if isinstance(m, WeightOnlyLinear)}
        lookup = type(engine.model.embed_tokens.inner).__name__
        head = type(engine.model.lm_head.inner).__name__
        Path(f"{out}/rank.{rank}.json").write_text(json.dumps({"kinds": sorted(kinds), "embedding": lookup, "head": head}))
    os._exit(0)  # as run_rank


@pytest.mark.parametrize("variant", ["tied", "gqa"])
def test_two_ranks_serve_a_quantized_gguf_as_one_does(model_dir, tmp_path, variant):
    """Each rank's embedding rows are its part of the codes, looked up there: the head's (tied), or the table's own."""
    write_gguf(model_dir(variant), tmp_path / "q.gguf", override_type=GGMLQuantizationType.Q4_0)
    imported = import_gguf(tmp_path / "q.gguf", tmp_path / "imported", progress=False)
    mp.spawn(run_quantized_rank, args=(2, str(imported), free_port(), str(tmp_path)), nprocs=2, join=True)
    whole = load_engine(imported, EngineConfig(**(SETTINGS | {"dtype": "auto"})))
    assert whole.quantized
    expected = whole.prompt_logits(PROMPTS[1]).log_softmax(-1)
    for rank in range(2):
        # every matrix split as codes (o and down by whole groups of inputs), none dequantized
        kinds = json.loads((tmp_path / f"rank.{rank}.json").read_text())
        codes = codes_layer_class(4, Machine.found(torch.device("cpu")))
        assert kinds["kinds"] == [codes.__name__]
        # the rank's table read from codes: its own (untied), or its head's where the head is codes alone (a tied
        # head may also take the dense table from a row count measured for the rank's shape: then it is dense)
        kernels = Machine.found(torch.device("cpu")).kernels_off is None
        from_codes = kernels and (variant == "gqa" or kinds["head"] != "TwoForms")
        assert kinds["embedding"] == ("CodesEmbedding" if from_codes else "Embedding")
        got = load_file(tmp_path / f"logits.{rank}.safetensors")["logits"].log_softmax(-1)
        # the same codes; bfloat16 partial sums added by the all-reduce round at other points than one product
        kl = torch.nn.functional.kl_div(got, expected, log_target=True, reduction="none").sum(-1)
        assert kl.max().item() < 1e-3
