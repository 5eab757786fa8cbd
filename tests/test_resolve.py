"""What --model accepts, and what a user is told when it names nothing usable."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.test_gguf import write_gguf
from weights.default_model import ModelUnavailable
from weights.resolve import resolve_model


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_a_folder_is_used_as_it_is(tiny_dir, home):
    assert resolve_model(str(tiny_dir)) == tiny_dir


def test_a_gguf_file_is_imported_once_into_the_cache(tiny_dir, home, tmp_path):
    gguf = tmp_path / "tiny.gguf"
    write_gguf(tiny_dir, gguf)
    first = resolve_model(str(gguf), progress=False)
    assert first.parent == home / "models" and (first / "config.json").is_file()
    assert (first / "model.gguf").read_bytes() == gguf.read_bytes()  # served as stored, not dequantized
    assert not list(first.glob("*.safetensors"))
    stamp = (first / "config.json").stat().st_mtime_ns
    again = resolve_model(str(gguf), progress=False)
    assert again == first and (again / "config.json").stat().st_mtime_ns == stamp


def test_nothing_there_names_what_is_accepted(home):
    with pytest.raises(ModelUnavailable, match="no such folder or file.*Hugging Face folder, a .gguf file"):
        resolve_model("./no/such/model")


def test_a_hub_id_offline_is_a_clear_error(home, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelUnavailable, match="could not fetch someorg/somemodel"):
        resolve_model("someorg/somemodel")


def test_server_with_a_bad_model_exits_1_saying_why(tmp_path):
    env = dict(os.environ, KVSERVE_HOME=str(tmp_path))
    result = subprocess.run([sys.executable, "-m", "server", "--model", str(tmp_path / "missing"), "--port", "0"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 1
    assert "missing: no such folder or file" in result.stderr
