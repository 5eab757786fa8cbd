"""Decode steps compiled ahead of time (engine/aot_steps.py): the eager step's bits in both packages, run by kvserve's op
as by torch's binding, a process that finds its packages serves without importing torch's compiler or copying them,
and a damaged package is built again."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch

from engine import EngineConfig, SamplingParams
from weights.loading import load_engine

PROMPTS = ["The quick brown fox jumps over", "Paris", "def add(a, b):\n    return a + b"]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def q4_model(tmp_path_factory):
    """A Q4_0 Qwen3 GGUF, imported: its products on kvserve's kernels, custom ops the packages call."""
    from gguf import GGMLQuantizationType

    from tests.tiny import write_gguf_model, write_model
    from weights.gguf_file import import_gguf

    folder = tmp_path_factory.mktemp("aot")
    src = write_model(folder / "src", kind="qwen3")
    write_gguf_model(src, folder / "q4.gguf", "qwen3", matrix_type=GGMLQuantizationType.Q4_0)
    return import_gguf(folder / "q4.gguf", folder / "imported", progress=False)


@pytest.fixture(scope="module")
def compiled_home(tmp_path_factory):
    return tmp_path_factory.mktemp("compiled")


def engine(model, compile: str):
    return load_engine(model, EngineConfig(device="cpu", max_batch_size=3, max_seq_len=64, seed=0, compile=compile,
                                           speculative="ngram" if compile != "off" else "off",
                                           num_speculative_tokens=3))


@pytest.fixture(scope="module")
def aot_engine(q4_model, compiled_home):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(compiled_home))
        made = engine(q4_model, "aot")
        assert made.compile() and made.compiled_graphs == ("1", "2+")
    return made


def test_packaged_steps_decode_as_eager_does(aot_engine, q4_model):
    eager = engine(q4_model, "off")
    assert [c.output_ids for c in aot_engine.generate(PROMPTS, GREEDY)] == [
        c.output_ids for c in eager.generate(PROMPTS, GREEDY)]
    assert aot_engine.generate(PROMPTS[:1], GREEDY)[0].output_ids == eager.generate(PROMPTS[:1], GREEDY)[0].output_ids


def test_a_row_gets_the_same_bits_alone_and_among_its_drafts(aot_engine):
    """A verification step's rows (one slot, consecutive positions: the many-row package) against each decoded
    alone (the one-row package) and eagerly."""
    executor = aot_engine.executor
    packages = dict(executor.graphs)
    prompt, rows = list(range(3, 13)), [5, 17, 33, 40]
    positions = [len(prompt) + j for j in range(4)]
    try:
        with torch.inference_mode():
            aot_engine.prompt_logits(prompt)  # the prompt's K/V in slot 0
            together = executor.forward(rows, [0] * 4, positions)  # (4, V)
            for graphs in (packages, {}):
                executor.graphs = graphs
                for j, position in enumerate(positions):  # each alone, in order: it rewrites its own K/V
                    assert torch.equal(executor.forward([rows[j]], [0], [position])[0], together[j]), (graphs, j)
    finally:
        executor.graphs = packages


def test_kvserves_op_runs_a_package_as_torchs_binding_does(aot_engine):
    """The packages run through kvserve's op, which frees the GIL while a step runs (torch's own binding of the
    loader holds it): the same logits, bit for bit, from the same package and tensors, at one row and at four."""
    from engine import aot_steps

    executor = aot_engine.executor
    packages = dict(executor.graphs)
    assert all(step.releases_gil for step in packages.values())
    constants = aot_steps.StepModule(executor).constants()
    twins = {name: aot_steps.LoadedStep(step.path, constants, release_gil=False) for name, step in packages.items()}
    assert not any(step.releases_gil for step in twins.values())
    prompt, rows = list(range(3, 13)), [5, 17, 33, 40]
    positions = [len(prompt) + j for j in range(4)]
    try:
        with torch.inference_mode():
            aot_engine.prompt_logits(prompt)  # the prompt's K/V in slot 0
            logits = []
            for graphs in (packages, twins):
                executor.graphs = graphs
                # each call rewrites the same K/V: a row's then depend on its inputs alone
                logits.append((executor.forward(rows[:1], [0], positions[:1]), executor.forward(rows, [0] * 4, positions)))
    finally:
        executor.graphs = packages
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(*logits))


def test_a_process_that_finds_its_packages_never_imports_the_compiler(aot_engine, q4_model, compiled_home, tmp_path):
    """... nor copies them into its temporary folder (a copy a SIGKILL would leave there)."""
    script = ("import sys, torch\n"
              "from engine import EngineConfig, SamplingParams\n"
              "from weights.loading import load_engine\n"
              f"engine = load_engine({str(q4_model)!r}, EngineConfig(device='cpu', max_batch_size=3, max_seq_len=64, "
              "seed=0, compile='aot', speculative='ngram', num_speculative_tokens=3))\n"
              "assert engine.compile()\n"
              "engine.generate(['Paris', 'Once'], SamplingParams(max_new_tokens=4, temperature=0))\n"
              "print('graphs', engine.compiled_graphs, 'compiler', any(m in sys.modules for m in "
              "('torch._dynamo', 'torch._inductor')))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(compiled_home), TMPDIR=str(tmp_path)))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "graphs ('1', '2+') compiler False" in result.stdout
    assert "built the decode step package" not in result.stderr  # both found, none built
    assert not list(tmp_path.glob("aotinductor_*"))


def test_a_damaged_package_is_built_again(aot_engine, q4_model, compiled_home, tmp_path, monkeypatch, caplog):
    """Damaged between two starts: a copy of the cache, as the running engine maps the files it loaded."""
    shutil.copytree(compiled_home / "kvserve", tmp_path / "kvserve")
    (package, *_) = sorted((tmp_path / "kvserve" / "steps").glob("step-*-1-1"))
    (library, *_) = package.rglob("*.so")
    library.write_bytes(library.read_bytes()[:1000])  # cut short, as by a full disk
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    again = engine(q4_model, "aot")
    with caplog.at_level(logging.INFO, logger="kvserve.aot_steps"):
        assert again.compile()
    assert f"the decode step package {package.name} cannot be used" in caplog.text
    assert "built the decode step package for batch 1" in caplog.text
    assert again.generate(PROMPTS[1:2], GREEDY)[0].output_ids == aot_engine.generate(PROMPTS[1:2], GREEDY)[0].output_ids
