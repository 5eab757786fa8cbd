"""Kernels of our own in C++, built at load for the CPU found (`-march=native`) and cached beside inductor's code.

A build takes tens of seconds on 2 cores (one compiler per source, side by side), once per machine, torch
version and source; later loads find the library
in the cache, and load it only once it matches the digest recorded when it was built (a library cut short
would kill the process by SIGBUS inside dlopen). Where no C++ compiler exists or the build fails (a CPU
without AVX2, say), `load_kernels` says why and the callers keep torch's kernels.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils import cpp_extension

from engine import cache_file
from engine.cache_file import CacheMiss
from engine.device import cpu_description

log = logging.getLogger("kvserve.native")

NATIVE = Path(__file__).with_name("native")  # *.cpp compiled into one library, with the headers beside them


def load_kernels() -> str | None:
    """Why kvserve's own kernels cannot run in this process, or None once they are loaded (torch.ops.kvserve)."""
    return loaded().reason


@dataclass(frozen=True)
class Loaded:
    """The outcome of loading the kernels: the library that was loaded, or why none was."""

    library: Path | None
    reason: str | None


@functools.cache  # the ops register process-wide, once: a second build or load would only fail
def loaded() -> Loaded:
    outcome = load_or_build()
    if outcome.reason is not None:
        log.info("kvserve's own kernels are off (%s): torch's run instead", outcome.reason)
    return outcome


def kernels_run_on(device: torch.device) -> bool:
    """Whether kvserve's kernels serve tensors on `device`: the CPU, where they loaded."""
    return device.type == "cpu" and load_kernels() is None


def cxx() -> str | None:
    """The C++ compiler the kernels are built with: $CXX, else g++; None where it is not installed."""
    return shutil.which(os.environ.get("CXX", "g++"))


def kernels_library() -> Path | None:
    """The library the kernels were loaded from in this process (beside it, engine/linear/timing.py keeps
    their measured forms), or None where they are off."""
    return loaded().library


def load_or_build() -> Loaded:
    """The kernels loaded from the cached library once it is checked against its digest (engine/cache_file.py),
    else built again first: a damaged library is never opened. Where the cache cannot be written, the build
    goes to a folder of this process's own."""
    compiler = cxx()
    if compiler is None:
        return Loaded(None, "no C++ compiler")
    if platform.machine() not in ("x86_64", "AMD64"):
        return Loaded(None, f"they are written for x86-64, not {platform.machine()}")
    library = cached_library(compiler)
    try:
        return load(library)
    except CacheMiss as miss:
        if miss.found:
            log.warning("kvserve's kernels at %s cannot be used (%s): building them again", library, miss.reason)
    if not cache_file.writable(library.parent):
        scratch = Path(tempfile.mkdtemp(prefix="kvserve-kernels-"))
        log.warning("%s cannot be written: building kvserve's kernels in %s for this process", library.parent, scratch)
        library = scratch / library.name
    try:
        build(compiler, library)
    except subprocess.CalledProcessError as error:
        lines = error.stderr.strip().splitlines()
        return Loaded(None, f"the build failed: {lines[-1] if lines else error}")
    except OSError as error:  # the disk filled, say
        return Loaded(None, f"the build could not be written: {cache_file.describe(error)}")
    try:
        return load(library)
    except CacheMiss as miss:  # written and at once unusable: a disk that loses what it is given
        return Loaded(None, f"the library just built cannot be used: {miss.reason}")


def load(library: Path) -> Loaded:
    """The ops registered from `library`, checked first; CacheMiss if it cannot be used."""
    with cache_file.loadable(library) as path:
        try:
            torch.ops.load_library(path)
        except OSError as e:  # whole, yet not loadable here (a library for another CPU copied in, say)
            raise CacheMiss(library, f"it does not load ({e})", found=True) from None
    return Loaded(library, None)


def cached_library(compiler: str) -> Path:
    """The library's path, named by everything that changes what gets built: sources, torch, compiler and CPU."""
    key = hashlib.sha256()
    for source in sorted(NATIVE.iterdir()):
        key.update(source.read_bytes())
    key.update(torch.__version__.encode())
    key.update(subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout.encode())
    key.update((cpu_description() or platform.processor()).encode())  # -march=native builds for exactly this CPU
    return cache_file.compiled_root() / f"kernels-{key.hexdigest()[:20]}.so"


def build(compiler: str, library: Path, arch: str = "native") -> None:
    """The sources as one library at `library`, for -march=`arch` (tests build other targets than this CPU)."""
    library.parent.mkdir(parents=True, exist_ok=True)
    include = [f"-I{path}" for path in cpp_extension.include_paths()]
    (torch_lib,) = cpp_extension.library_paths()
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        partial = Path(scratch) / library.name  # renamed into place whole: processes that build at once don't clash
        flags = ["-O3", f"-march={arch}", "-fPIC", "-std=c++20", "-fopenmp",
                 f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}", *include]
        log.info("building kvserve's kernels for this CPU (once): %s", library.name)
        sources = sorted(NATIVE.glob("*.cpp"))
        objects = [Path(scratch) / f"{source.stem}.o" for source in sources]
        # One compiler per source, side by side (each takes seconds of torch's headers), then one link.
        compiling = [(subprocess.Popen([compiler, *flags, "-c", str(source), "-o", str(obj)], stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True), source) for source, obj in zip(sources, objects)]
        for process, source in compiling:
            output, errors = process.communicate()
            if process.returncode != 0:
                raise subprocess.CalledProcessError(process.returncode, [compiler, str(source)], output, errors)
        subprocess.run([compiler, "-shared", "-fopenmp", *map(str, objects), f"-L{torch_lib}", "-lc10", "-ltorch",
                        "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}", "-o", str(partial)], check=True, capture_output=True,
                       text=True)
        cache_file.publish(partial, library)
