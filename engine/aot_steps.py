"""Decode steps compiled ahead of time by AOTInductor: one package on disk per bucket, run by torch's C++ loader.

torch.compile keeps its compiler in the serving process: dynamo's and inductor's modules, the traced graphs and
their guards (about 190 MB beside the default model's 96 MB of weights, once compiled). A package holds one step's
generated library instead, and loading it takes torch's C++ package loader alone, so a process that finds its
packages built (the server's compile child builds them first: server/compile_cache.py) never imports dynamo or
inductor. The weights are not in the package: the loaded step is handed the model's own tensors by name (constants
the caller manages), so memory holds them once.

A package is kept unpacked, as a sealed folder (engine/cache_file.py), and loaded from there: the loader given a
`.pt2` archive unpacks it into a temporary folder of its own, which a process killed with SIGKILL leaves behind
(4.5 MB a package, at every such restart); given the folder, it reads the library where it lies.

A package is named by everything that shapes its graph: kvserve's engine source, torch, the CPU and the kernels'
library, the model's config, each module's class and product forms (plain numbers in the graph), every constant's
name, shape, dtype and strides, the cache's layout and the bucket's batch sizes. The weights' values are not in
it: any checkpoint of the same shapes and plan runs the same package. A package that is absent or whose files fail
their digests is built again.

A row's logits are the eager step's bits, as in torch.compile's graphs (the same inductor options: executor.py).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
import zipfile
from pathlib import Path

import torch
from torch import nn

from engine import cache_file
from engine.device import cpu_description
from engine.linear.native import loaded
from engine.rope import RotaryTable

log = logging.getLogger("kvserve.aot_steps")

# Inductor's options for every package: as torch.compile's graphs (DecodeExecutor.compile), and the weights kept out
# of the library (the loaded step reads the model's tensors).
OPTIONS = {"emulate_precision_casts": True, "aot_inductor.package_constants_in_so": False}
ENGINE = Path(__file__).parent


class StepModule(nn.Module):
    """DecodeExecutor.step as a module for torch.export, tensors in, logits out: the model and the rotary tables are
    its constants, so each has a name the loaded package asks for. The tables are read as attributes at every call
    (export swaps a module's constants for its own tensors there, and only there)."""

    def __init__(self, executor):
        super().__init__()
        self.executor = executor  # not a module: its step() is what runs
        self.model = executor.model
        self.tables = tuple(executor.rotary.tables)
        for name, (cos, sin) in executor.rotary.tables.items():
            self.register_buffer(f"rope_{name}_cos", cos, persistent=False)
            self.register_buffer(f"rope_{name}_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor, slot_index: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                groups: tuple[torch.Tensor, ...]) -> torch.Tensor:
        rotary = RotaryTable.of({name: (getattr(self, f"rope_{name}_cos"), getattr(self, f"rope_{name}_sin"))
                                 for name in self.tables})
        return self.executor.step(tokens, slot_index, positions, mask, groups, rotary=rotary)

    @functools.cached_property
    def key(self) -> "hashlib._Hash":
        """The digest of everything but the bucket that shapes a package's graph (the module's doc), read once for
        all buckets."""
        key = hashlib.sha256()
        for source in sorted(ENGINE.rglob("*.py")):
            key.update(source.relative_to(ENGINE).as_posix().encode() + source.read_bytes())
        library = loaded().library
        key.update("\n".join([torch.__version__, cpu_description() or "", library.name if library else "no kernels",
                              repr(OPTIONS), repr(self.model.config)]).encode())
        for name, module in self.named_modules():
            key.update(f"{name} {type(module).__qualname__} {getattr(module, 'forms', None)!r}\n".encode())
        for name, tensor in self.constants().items():
            key.update(f"{name} {tuple(tensor.shape)} {tensor.stride()} {tensor.dtype}\n".encode())
        cache = self.executor.cache
        for group in cache.groups:
            key.update(f"{tuple(group.shape)} {group.stride()} {group.dtype}\n".encode())
        key.update(repr((cache.places, cache.capacities, cache.windows, cache.lookahead,
                         self.executor.reads_cache)).encode())
        return key

    def constants(self) -> dict[str, torch.Tensor]:
        """Every tensor the step reads besides its inputs, by the name export gives it (tied ones under each name)."""
        return dict(self.named_parameters(remove_duplicate=False)) | dict(self.named_buffers(remove_duplicate=False))


class LoadedStep:
    """A package's step, called as a compiled graph is: (tokens, slot_index, positions, mask, groups) -> logits.

    release_gil: run it by kvserve's op where its kernels are loaded (engine/linear/native/compiled_step.cpp), which
    releases the GIL for the step as torch's own binding of the loader does not: the server's event loop then
    streams tokens while a step runs. Elsewhere, or with release_gil=False, torch's binding runs it."""

    def __init__(self, path: Path, constants: dict[str, torch.Tensor], release_gil: bool = True):
        from engine.linear.native import load_kernels

        cache_file.check_sealed(path)
        self.path = path
        self.releases_gil = release_gil and load_kernels() is None
        # torch._inductor.aoti_load_package wraps torch's loader, but importing it imports inductor. kvserve's class
        # has the methods of torch's binding; only the run differs (an op, so that the dispatcher drops the GIL).
        try:
            if self.releases_gil:
                loader = torch.classes.kvserve.CompiledStep(str(path))
                self.run = functools.partial(torch.ops.kvserve.run_step, loader)
            else:
                loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
                self.run = loader.run
        except RuntimeError as e:  # whole, yet not loadable here
            raise cache_file.CacheMiss(path, f"it does not load ({str(e).splitlines()[0]})", found=True) from None
        names = loader.get_constant_fqns()
        missing = [name for name in names if name not in constants]
        if missing:
            raise cache_file.CacheMiss(path, f"it asks for constants the model lacks ({', '.join(missing[:3])})",
                                       found=True)
        # user-managed: the package keeps the model's tensors themselves, no copy
        loader.load_constants({name: constants[name] for name in names}, False, True, True)

    def __call__(self, tokens: torch.Tensor, slot_index: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                 groups: tuple[torch.Tensor, ...]) -> torch.Tensor:
        (logits,) = self.run([tokens, slot_index, positions, mask, *groups])
        return logits


def package_path(step: StepModule, smallest: int, largest: int | None) -> Path:
    """The folder of the package for batches of `smallest` to `largest` rows: named by everything that shapes its
    graph (the module's doc): the step's key, then the bucket."""
    key = step.key.copy()
    key.update(repr((smallest, largest)).encode())
    return cache_file.compiled_root() / "steps" / f"step-{key.hexdigest()[:24]}-{smallest}-{largest}"


def build(step: StepModule, smallest: int, largest: int | None, path: Path) -> None:
    """Export the step for batches of `smallest` to `largest` rows (None: no largest) and package it as the sealed
    folder `path` (minutes on a large model: inductor generates and compiles its C++)."""
    from torch._inductor import aoti_compile_and_package  # the compiler, in the process that builds only

    cache = step.executor.cache
    dynamic = largest != smallest
    # Example sizes: the smallest batch (as torch.compile's graphs take theirs: DecodeExecutor._scratch_step), and
    # a key count that is no head count or head width (a broadcast against one would be specialized to it).
    config = step.model.config
    taken = set(range(smallest + 1)) | {config.num_heads, config.num_kv_heads, config.head_dim}
    rows = smallest
    keys = next(n for n in range(smallest + 1, 4096) if n not in taken)  # keys of the example rows
    tokens = torch.zeros(rows, 1, dtype=torch.long, device=cache.device)
    slot_index = torch.zeros(rows, dtype=torch.long, device=cache.device)
    positions = torch.full((rows, 1), keys - 1, device=cache.device)
    mask = torch.ones(rows, 1, 1, keys, dtype=torch.bool, device=cache.device)
    batch = torch.export.Dim("rows", min=2, max=largest or step.executor.rows) if dynamic else None
    kv_len = torch.export.Dim("kv_len", min=2, max=cache.max_seq_len + cache.lookahead)
    by_row = {0: batch} if batch else {}  # tokens, slot_index, positions and mask: a row each
    shapes = (by_row, by_row, by_row, by_row | {3: kv_len}, tuple(None for _ in cache.groups))
    started = time.perf_counter()
    # Traced as the Python runs (torch.export's default), with tensors of its own: the live cache is read for its
    # layout only.
    with torch.no_grad():
        program = torch.export.export(step, (tokens, slot_index, positions, mask, cache.groups), dynamic_shapes=shapes)
    with cache_file.staging(path) as made:
        archive = made.with_name("package.pt2")
        # a copy: it adds keys of its own to the dict it is given
        aoti_compile_and_package(program, package_path=str(archive), inductor_configs=dict(OPTIONS))
        unpacked = made.with_name("unpacked")
        with zipfile.ZipFile(archive) as files:
            files.extractall(unpacked)
        (folder,) = unpacked.iterdir()  # the archive's one top folder: data/aotinductor/model/...
        cache_file.seal(folder)
        folder.rename(made)
    batches = f"batches of {smallest} to {largest or step.executor.rows}" if dynamic else f"batch {smallest}"
    log.info("built the decode step package for %s in %.1f s: %s", batches, time.perf_counter() - started, path.name)


def load_or_build(step: StepModule, smallest: int, largest: int | None) -> LoadedStep:
    """The package's step for batches of `smallest` to `largest` rows, built first where it is absent or unusable."""
    path = package_path(step, smallest, largest)
    try:
        return LoadedStep(path, step.constants())
    except cache_file.CacheMiss as miss:
        if miss.found:
            log.warning("the decode step package %s cannot be used (%s): building it again", path.name, miss.reason)
            cache_file.set_aside(path)
    build(step, smallest, largest, path)
    return LoadedStep(path, step.constants())
