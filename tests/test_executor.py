"""The compiled decode step: the same greedy tokens as eager, no recompiles, and eager where it cannot run."""

from __future__ import annotations

import logging

import pytest
import torch
from torch._dynamo.utils import counters

from engine import SamplingParams
from engine import executor as executor_module
from weights.loading import load_engine

PROMPTS = ["The quick brown fox jumps over", "Paris", "def add(a, b):\n    return a + b", "Once upon a time there"]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def compiled_engine(tiny_dir):
    from engine import EngineConfig

    engine = load_engine(tiny_dir, EngineConfig(device="cpu", dtype="float32", max_batch_size=4,
                                                           max_seq_len=64, seed=0, compile="on"))
    assert engine.compile() and engine.compiled_graphs == ("1", "2+")
    return engine


def test_compiled_greedy_tokens_equal_eager(compiled_engine, make_engine):
    eager = make_engine(max_batch_size=4, max_seq_len=64)
    frames = counters["frames"]["total"]
    # A batch that shrinks as requests finish, then one request that fills its slot to the last position.
    lengths = [40, 12, 25, 33]
    together = compiled_engine.generate(PROMPTS, [greedy(n) for n in lengths])
    assert [c.output_ids for c in together] == [c.output_ids for c in eager.generate(PROMPTS, [greedy(n) for n in lengths])]
    room = 64 - len(compiled_engine.tokenizer.encode(PROMPTS[1]))
    (alone,) = compiled_engine.generate([PROMPTS[1]], greedy(room))
    assert alone.output_ids == eager.generate([PROMPTS[1]], greedy(room))[0].output_ids
    assert len(alone.output_ids) == room
    assert counters["frames"]["total"] == frames  # every step ran on the two graphs compiled up front


def test_compiled_logits_match_eager(compiled_engine, make_engine):
    eager = make_engine(max_batch_size=4, max_seq_len=64)
    ids = compiled_engine.tokenizer.encode("The quick brown fox")
    with torch.inference_mode():
        for engine in (compiled_engine, eager):
            engine.prompt_logits(ids)  # writes the prompt into slot 0
        got = compiled_engine.executor.forward([5, 5], [0, 1], [len(ids), 0])
        want = eager.executor.forward([5, 5], [0, 1], [len(ids), 0])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_the_padded_steps_cuda_graphs_replay_decode_as_eager_does(make_engine):
    """What a GPU captures, run eagerly on the CPU: batches padded to a power of two by repeating their first row,
    keys read to a power of two (at least 64) behind the mask. The capture itself is tested in test_cuda.py."""
    eager, padded = make_engine(max_batch_size=4), make_engine(max_batch_size=4)
    padded.executor.capture(graphs=False)
    lengths = [90, 12, 25, 33]  # 4 rows, then 3 (padded to 4), 2, 1; the longest past 64 keys into 128
    got = padded.generate(PROMPTS, [greedy(n) for n in lengths])
    assert [c.output_ids for c in got] == [c.output_ids for c in eager.generate(PROMPTS, [greedy(n) for n in lengths])]
    assert set(padded.compiled_graphs) == {"b4·k64", "b2·k64", "b1·k64", "b1·k128"}
    seeded = SamplingParams(max_new_tokens=20, temperature=0.9, seed=3, ignore_eos=True)
    assert padded.generate(PROMPTS[:3], seeded)[2].output_ids == eager.generate(PROMPTS[2:3], seeded)[0].output_ids


def test_without_a_compiler_decode_stays_eager(make_engine, monkeypatch, caplog):
    monkeypatch.setattr(executor_module.shutil, "which", lambda name: None)  # the fault: no C++ compiler
    engine = make_engine(compile="auto")
    with caplog.at_level(logging.INFO, logger="kvserve.engine"):
        assert engine.compile() is False
    assert "decode stays eager: no C++ compiler" in caplog.text
    assert engine.compiled_graphs == ()
    assert len(engine.generate(PROMPTS[:2], greedy(5))[0].output_ids) == 5


def test_compile_off_compiles_nothing(make_engine):
    engine = make_engine(compile="off")
    assert engine.compile() is False and engine.compiled_graphs == ()


def test_compile_cache_child_fills_inductors_disk_cache(model_dir, tmp_path):
    """What the server runs before compiling in-process: the same flags, a child process, code left on disk."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "compiled"))
    result = subprocess.run([sys.executable, "-m", "server.compile_cache", "--model", str(model_dir("gqa")),
                             "--device", "cpu", "--dtype", "float32", "--max-batch-size", "4", "--max-seq-len", "64",
                             "--compile", "on"], capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "compiled decode step for batches of 2 or more" in result.stderr
    assert any((tmp_path / "compiled").rglob("*.py"))  # inductor's generated code, for the server to find


def test_a_row_gets_the_same_bits_alone_and_among_its_drafts_in_every_graph(model_dir, tmp_path):
    """A Q8_0 Gemma 3 GGUF in bfloat16, compiled: a token's logits are the same bits decoded alone (the one-row
    graph), as a later row of four in one slot (speculative decoding's verification, the many-row graph), and
    eagerly. On gemma-3-270m its scaled embedding broke this: the many-row graph fused the bfloat16 multiply
    into the norm after it and read the product unrounded, so a verified draft could flip a near tie (its JSON
    task in `bench spec`). This model, of its width, kept the bits even before that fix (the fusion is inductor's
    choice); it guards the invariant, and bench spec's "same tokens" the real model."""
    from gguf import GGMLQuantizationType

    from engine import EngineConfig
    from tests.tiny import write_gguf_model
    from weights.gguf_file import import_gguf

    from tests.conftest import GEMMA3
    from tests.tiny import write_model

    # Gemma 3 270M's width (640), its embedding read from the tied head's Q8_0 codes
    src = write_model(tmp_path / "src", kind="gemma3", **dict(GEMMA3, hidden_size=640, intermediate_size=256,
                                                              query_pre_attn_scalar=16, num_hidden_layers=2,
                                                              layer_types=["sliding_attention", "full_attention"]))
    write_gguf_model(src, tmp_path / "q8.gguf", "gemma3", matrix_type=GGMLQuantizationType.Q8_0)
    imported = import_gguf(tmp_path / "q8.gguf", tmp_path / "imported", progress=False)
    engine = load_engine(imported, EngineConfig(device="cpu", dtype="bfloat16", max_batch_size=2,
                                                           max_seq_len=64, seed=0, compile="on",
                                                           speculative="ngram"))
    assert engine.compile()
    executor = engine.executor
    graphs = dict(executor.graphs)
    prompt = list(range(3, 13))
    rows = [5, 17, 33, 40, 7, 21, 2, 60]  # two steps of four rows: the newest token and three drafts each
    with torch.inference_mode():
        engine.prompt_logits(prompt)  # the prompt's K/V in slot 0
        for start in (0, 4):
            positions = [len(prompt) + start + j for j in range(4)]
            together = executor.forward(rows[start: start + 4], [0] * 4, positions)  # (4, V)
            for mode in ("compiled", "eager"):
                executor.graphs = graphs if mode == "compiled" else {}
                for j, position in enumerate(positions):  # each alone, in order: it rewrites its own K/V
                    alone = executor.forward([rows[start + j]], [0], [position])[0]
                    assert torch.equal(alone, together[j]), (mode, start + j)
            executor.graphs = graphs
