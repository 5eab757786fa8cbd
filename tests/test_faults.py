"""Nothing kvserve keeps on disk can stop it: damaged, read-only and raced-on homes (real server, default model).

The damage is bench/faults.py's, the same as `python -m bench faults` reports on: each cache file cut short,
overwritten in its middle, emptied, or made unreadable (a folder in its place: these tests run as root, who
reads any file whatever its mode).
"""

from __future__ import annotations

import fcntl
import logging
import shutil
from pathlib import Path

import pytest

from bench import faults
from engine import cache_file
from engine.cache_file import CacheMiss
from server import compile_cache

MANIFEST_NAME = compile_cache.MANIFEST
FLAGS = ("--compile", "off", "--max-batch-size", "2", "--max-seq-len", "512")


@pytest.mark.parametrize("how", faults.DAMAGES)
def test_a_damaged_cache_file_is_a_miss_never_its_bytes(tmp_path, how):
    path = tmp_path / "kernels.so"
    cache_file.write(path, b"\x7fELF" + bytes(range(256)) * 64)
    assert cache_file.read(path).startswith(b"\x7fELF")
    faults.damage(path, how)
    with pytest.raises(CacheMiss) as miss:
        cache_file.read(path)
    assert miss.value.found
    cache_file.write(path, b"rebuilt")  # a folder in the file's place does not stop the rebuild either
    assert cache_file.read(path) == b"rebuilt"


def test_an_absent_cache_file_is_a_miss_that_found_nothing(tmp_path):
    with pytest.raises(CacheMiss) as miss:
        cache_file.read(tmp_path / "absent.json")
    assert not miss.value.found


@pytest.mark.parametrize("how", faults.DAMAGES)
def test_a_sealed_folder_with_a_damaged_file_is_a_miss(tmp_path, how):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.gguf").write_bytes(bytes(range(256)) * 1000)
    cache_file.seal(folder)
    cache_file.check_sealed(folder)
    faults.damage(folder / "model.gguf", how)
    with pytest.raises(CacheMiss, match="model.gguf"):
        cache_file.check_sealed(folder)


def compiled_folder(root: Path) -> Path:
    """A compile cache laid out as torch's is (generated code in two-letter folders, cache entries), recorded."""
    folder = root / "compiled"
    for name, data in (("ab/cabc.main.so", b"\x7fELF" + b"x" * 5000), ("ab/cabc.main.cpp", b"int main;"),
                       ("fxgraph/ab/fabc/entry", b"entry" * 100), ("kvserve/kernels-1.so", b"ours")):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    compile_cache.record(folder)
    return folder


@pytest.mark.parametrize("how", faults.DAMAGES)
def test_damaged_compiled_graphs_are_removed_before_anything_loads_them(tmp_path, caplog, how):
    folder = compiled_folder(tmp_path)
    faults.damage(folder / "ab/cabc.main.so", how)
    with caplog.at_level(logging.WARNING, "kvserve.compile_cache"):
        compile_cache.check(folder)
    assert compile_cache.files(folder) == [] and (folder / "kvserve/kernels-1.so").read_bytes() == b"ours"
    assert "cabc.main.so" in caplog.text and "to be compiled again" in caplog.text
    compile_cache.check(folder)  # nothing left to repair: nothing said
    assert caplog.text.count("cannot be used") == 1


def test_compiled_files_no_compile_recorded_go_unless_a_server_is_compiling(tmp_path, caplog):
    folder = compiled_folder(tmp_path)
    unfinished = folder / "cd/ccd.main.so"
    unfinished.parent.mkdir()
    unfinished.write_bytes(b"\x7fELF")  # cut short by a power cut before its compile recorded it
    with compile_cache.locked(folder, fcntl.LOCK_SH):  # another server on this home, compiling now
        compile_cache.check(folder)
    assert unfinished.exists()
    with caplog.at_level(logging.WARNING, "kvserve.compile_cache"):
        compile_cache.check(folder)
    assert not unfinished.exists() and (folder / "ab/cabc.main.so").exists()
    assert "removed 1 compiled files" in caplog.text


def test_a_read_only_compiled_folder_is_copied_for_the_process(tmp_path):
    folder = compiled_folder(tmp_path)
    try:
        with faults.read_only(folder):
            used = compile_cache.prepared(folder, owned=True)
    except PermissionError as e:
        pytest.skip(str(e))
    assert used != folder and (used / "ab/cabc.main.so").read_bytes() == (folder / "ab/cabc.main.so").read_bytes()
    shutil.rmtree(used)


# ---- the real server on damaged homes -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def warm_home(tmp_path_factory):
    """A home that served the default model once: imported, kernels built and their forms measured."""
    return faults.warm_home(tmp_path_factory.mktemp("warm") / "home", list(FLAGS))


def serves_paris(server: faults.Started) -> None:
    assert server.healthy_s is not None, "".join(server.lines[-30:])
    assert "Paris" in faults.ask(server)


@pytest.mark.default_model
@pytest.mark.parametrize("how", faults.DAMAGES)
def test_a_home_with_every_cache_file_damaged_starts_serves_and_logs_the_repairs(warm_home, tmp_path, how):
    home = faults.damaged_copy(warm_home, how, tmp_path / "home")
    damaged = faults.cache_files(warm_home)
    assert {p.name for p in damaged} >= {"model.gguf", "config.json", "tokenizer.json"}
    assert any(p.suffix == ".so" for p in damaged) and any(p.name.startswith("timings-") for p in damaged)
    with faults.serving(home, *FLAGS) as server:
        serves_paris(server)
        repairs = "\n".join(server.repairs)
    assert "kvserve's kernels" in repairs and "building them again" in repairs
    assert "measured timings" in repairs and "measuring them again" in repairs
    assert "cached model" in repairs and "importing it again" in repairs
    if how == "truncated":  # repaired for good: the next start finds nothing to repair (once: a start is seconds)
        with faults.serving(home, *FLAGS) as again:
            serves_paris(again)
            assert again.repairs == []


@pytest.mark.default_model
def test_a_read_only_home_whose_kernels_are_not_built_starts_and_serves(warm_home, tmp_path):
    home = tmp_path / "home"
    shutil.copytree(warm_home / "models", home / "models")
    try:
        with faults.read_only(home), faults.serving(home, *FLAGS) as server:
            serves_paris(server)
            repairs = "\n".join(server.repairs)
    except PermissionError as e:
        pytest.skip(str(e))
    assert "cannot be written: compiled code is kept in" in repairs  # kvserve's kernels are built there too


@pytest.mark.default_model
def test_two_servers_racing_on_a_damaged_home_both_come_up(warm_home, tmp_path):
    home = faults.damaged_copy(warm_home, "garbled", tmp_path / "home")
    with faults.serving(home, *FLAGS, count=2) as (one, two):  # started together: they repair at once
        serves_paris(one)
        serves_paris(two)
    cache_file.check_sealed(home / "models" / "smollm2-135m-instruct")  # what they left is whole
    library = next((home / "compiled" / "kvserve").glob("kernels-*.so"))
    cache_file.read(library)


def test_kernels_whose_cache_cannot_be_written_are_built_for_the_process(tmp_path):
    """TORCHINDUCTOR_CACHE_DIR read-only and empty: the kernels are built in a folder of the process's own and
    load (in a process of its own: the ops register once per process)."""
    import os
    import subprocess
    import sys

    folder = tmp_path / "compiled"
    folder.mkdir()
    script = ("import logging; logging.basicConfig(level=logging.INFO)\n"
              "from engine.linear.native import load_kernels, kernels_library\n"
              "print('reason', load_kernels()); print('library', kernels_library())\n")
    try:
        with faults.read_only(folder):
            result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                                    env=dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(folder)))
    except PermissionError as e:
        pytest.skip(str(e))
    if "reason None" not in result.stdout and "no C++ compiler" in result.stdout:
        pytest.skip("no C++ compiler here")
    assert "reason None" in result.stdout, result.stdout + result.stderr
    assert f"{folder / 'kvserve'} cannot be written: building kvserve's kernels in" in result.stderr
    assert str(folder) not in result.stdout.split("library ", 1)[1]


def test_a_compile_cache_the_environment_names_is_left_as_torch_keeps_it(tmp_path):
    """TORCHINDUCTOR_CACHE_DIR names a folder other programs share (torch sets it to its default for every
    process that compiles): nothing there is removed, though no manifest lists it."""
    folder = compiled_folder(tmp_path)
    (folder / MANIFEST_NAME).unlink()
    assert compile_cache.prepared(folder, owned=False) == folder
    assert len(compile_cache.files(folder)) == 3
