"""Kernels of our own in C++, built at load for the CPU found (`-march=native`) and cached beside inductor's code.

A build takes about 10 seconds once per machine, torch version and source; later loads find the library
in the cache. Where no C++ compiler exists or the build fails (a CPU without AVX2, say), `load_kernels`
says why and the callers keep torch's kernels.
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
from pathlib import Path

import torch
from torch.utils import cpp_extension

from engine.device import cpu_description

log = logging.getLogger("kvserve.native")

NATIVE = Path(__file__).with_name("native")  # *.cpp compiled into one library, with the headers beside them


@functools.cache  # the ops register process-wide, once: a second build or load would only fail
def load_kernels() -> str | None:
    """Why kvserve's own kernels cannot run in this process, or None once they are loaded (torch.ops.kvserve)."""
    reason = load_or_build()
    if reason is not None:
        log.info("kvserve's own kernels are off (%s): torch's run instead", reason)
    return reason


def kernels_run_on(device: torch.device) -> bool:
    """Whether kvserve's kernels serve tensors on `device`: the CPU, where they loaded."""
    return device.type == "cpu" and load_kernels() is None


def cxx() -> str | None:
    """The C++ compiler the kernels are built with: $CXX, else g++; None where it is not installed."""
    return shutil.which(os.environ.get("CXX", "g++"))


@functools.cache  # its name hashes every source and asks the compiler its version: once per process
def kernels_library() -> Path:
    """Where this machine's build of the kernels lies (load_kernels finds or makes it there)."""
    return cached_library(cxx())


def load_or_build() -> str | None:
    compiler = cxx()
    if compiler is None:
        return "no C++ compiler"
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"they are written for x86-64, not {platform.machine()}"
    library = kernels_library()
    if not library.exists():
        try:
            build(compiler, library)
        except subprocess.CalledProcessError as error:
            lines = error.stderr.strip().splitlines()
            return f"the build failed: {lines[-1] if lines else error}"
    torch.ops.load_library(str(library))
    return None


def cached_library(compiler: str) -> Path:
    """The library's path, named by everything that changes what gets built: sources, torch, compiler and CPU."""
    key = hashlib.sha256()
    for source in sorted(NATIVE.iterdir()):
        key.update(source.read_bytes())
    key.update(torch.__version__.encode())
    key.update(subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout.encode())
    key.update((cpu_description() or platform.processor()).encode())  # -march=native builds for exactly this CPU
    from torch._inductor.runtime.cache_dir_utils import cache_dir  # TORCHINDUCTOR_CACHE_DIR, or torch's default

    return Path(cache_dir()) / "kvserve" / f"kernels-{key.hexdigest()[:20]}.so"


def build(compiler: str, library: Path, arch: str = "native") -> None:
    """The sources as one library at `library`, for -march=`arch` (tests build other targets than this CPU)."""
    library.parent.mkdir(parents=True, exist_ok=True)
    include = [f"-I{path}" for path in cpp_extension.include_paths()]
    (torch_lib,) = cpp_extension.library_paths()
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        partial = Path(scratch) / library.name  # renamed into place whole: processes that build at once don't clash
        command = [compiler, "-O3", f"-march={arch}", "-shared", "-fPIC", "-std=c++20", "-fopenmp",
                   f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}", *include,
                   *map(str, sorted(NATIVE.glob("*.cpp"))), f"-L{torch_lib}", "-lc10", "-ltorch", "-ltorch_cpu",
                   f"-Wl,-rpath,{torch_lib}", "-o", str(partial)]
        log.info("building kvserve's kernels for this CPU (once): %s", library.name)
        subprocess.run(command, check=True, capture_output=True, text=True)
        os.replace(partial, library)
