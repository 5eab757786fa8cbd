"""Inductor's disk cache of compiled decode steps under KVSERVE_HOME, kept as a cache that heals; and
`python -m server.compile_cache [the server's flags]`, which fills it.

The server runs that command in a child process before it compiles in its own. Most of a first compile
(about a minute per graph for 30 layers on 2 cores) is Python that holds the GIL, and in the server's
process it would starve the thread that decodes. In a child process it costs CPU only; the server's own
compile then finds the generated code on disk and takes seconds (a warm restart's time).

Torch writes each file of that cache whole (a rename), but does not check one before it loads it: a
generated library cut short kills the process by SIGBUS inside dlopen. So once the server has compiled,
`record` writes a manifest of every file there with its digest (engine/cache_file.py), and at the next
start `check` reads it before anything is loaded: if a listed file fails, the compiled graphs are
removed and compiled again (torch's entries refer to one another, so none of them is kept). A file that
no manifest lists was left by a compile that did not finish (a crash, a power cut): it is removed too,
unless a server on the same home is compiling now (it holds COMPILING shared, and its files are not
listed yet), which the check tells by failing to take that lock exclusively. kvserve's kernels (the
`kvserve/` folder) are checked where they load. A folder named by TORCHINDUCTOR_CACHE_DIR is not kvserve's
to clear (torch names its default one there for every program of the user's): it is used as torch uses it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

from engine import cache_file
from engine.cache_file import CacheMiss
from weights.loading import load_engine

log = logging.getLogger("kvserve.compile_cache")

MANIFEST = "kvserve-compiled.json"
COMPILING = "kvserve-compiling.lock"  # held shared by every server while it compiles here
OWN = "kvserve"  # kvserve's kernels and their forms: cache files of their own, checked when they load
UNRECORDED = ("locks",)  # folders of lock files, which torch rewrites


class CompileCache:
    """The compiled-code folder one server uses: filled first by a child process, recorded once compiled."""

    def __init__(self, folder: Path, argv: list[str], owned: bool):
        self.folder = folder
        self.argv = argv  # the server's flags, which the child takes too
        self.owned = owned  # kvserve's own folder, recorded and checked; else another's, left as torch keeps it
        self.children: list[subprocess.Popen] = []

    @contextlib.contextmanager
    def in_use(self) -> Iterator[None]:
        """COMPILING held shared while the block compiles: another server starting meanwhile keeps the files
        this compile has not recorded yet (in kvserve's own folder: nothing is checked in another's)."""
        with locked(self.folder, fcntl.LOCK_SH) if self.owned else contextlib.nullcontext():
            yield

    def warm(self) -> None:
        """A child process with the same flags and environment compiles first (see the module's doc)."""
        child = subprocess.Popen([sys.executable, "-m", "server.compile_cache", *self.argv],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                 env=dict(os.environ, KVSERVE_COMPILE_PARENT=str(os.getpid())))
        self.children.append(child)
        _, errors = child.communicate()
        if child.returncode != 0:
            log.warning("compiling in a child process failed (compiling in-process instead): %s", errors.strip()[-2000:])

    def record(self) -> None:
        if self.owned:
            record(self.folder)

    def end(self) -> None:
        """Stop a child still compiling (the server is stopping)."""
        for child in self.children:
            child.kill()


@contextlib.contextmanager
def locked(folder: Path, mode: int) -> Iterator[bool]:
    """COMPILING in `folder` held in `mode` (fcntl.LOCK_SH or LOCK_EX, maybe | LOCK_NB) for the block; yields
    whether it was taken (False: a non-blocking request another process's lock refused)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / COMPILING, "a") as file:
        try:
            fcntl.flock(file, mode)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(file, fcntl.LOCK_UN)


def prepared(folder: Path, owned: bool) -> Path:
    """The folder inductor's cache is to use this process: `folder`, checked when kvserve `owned` it (its
    home's, not one the environment names, which other programs may share), or, where it cannot be written
    (a read-only home), a temporary copy of it, with one log line."""
    if not cache_file.writable(folder):
        scratch = Path(tempfile.mkdtemp(prefix="kvserve-compiled-"))
        copied = folder.is_dir()
        if copied:
            shutil.copytree(folder, scratch, dirs_exist_ok=True, ignore=shutil.ignore_patterns(*UNRECORDED),
                            ignore_dangling_symlinks=True)
        log.warning("%s cannot be written: compiled code is kept in %s for this process%s", folder, scratch,
                    " (a copy of what the home holds)" if copied else "")
        folder = scratch
    if owned:
        check(folder)
    return folder


def check(folder: Path) -> None:
    """Every file `folder`'s manifest lists, checked against its digest; if one fails, the compiled graphs are
    removed, and files no manifest lists are removed unless a server is compiling here (one log line each)."""
    with locked(folder, fcntl.LOCK_EX | fcntl.LOCK_NB) as nobody_compiling:
        try:
            listed = recorded(folder)
            for name, digest in listed.items():
                cache_file.check_digest(folder / name, digest)
        except CacheMiss as miss:
            if not miss.found:  # no manifest yet: every file is unlisted
                listed = {}
            else:  # a damaged file: what refers to it cannot be told from what does not
                removed = clear(folder)
                log.warning("the compiled graphs in %s cannot be used (%s: %s): removed %d files, to be compiled "
                            "again", folder, miss.path.name, miss.reason, removed)
                return
        unlisted = [path for path in files(folder) if path.relative_to(folder).as_posix() not in listed]
        if unlisted and nobody_compiling:
            for path in unlisted:
                remove(path)
            log.warning("removed %d compiled files in %s that no finished compile recorded (%s, ...): to be "
                        "compiled again", len(unlisted), folder, unlisted[0].relative_to(folder))


def recorded(folder: Path) -> dict[str, str]:
    """The manifest in `folder`: relative path -> sha256; CacheMiss if none can be used."""
    manifest = folder / MANIFEST
    data = cache_file.read(manifest)
    try:
        listed = json.loads(data)
        if isinstance(listed, dict) and all(isinstance(v, str) for v in listed.values()):
            return listed
    except ValueError:
        pass
    raise CacheMiss(manifest, "it holds no digests", found=True)


def record(folder: Path) -> None:
    """The manifest of what `folder` holds now, after a compile (a failure to write it is a log line)."""
    listed = {}
    for path in sorted(files(folder)):
        try:
            with open(path, "rb") as file:
                listed[path.relative_to(folder).as_posix()] = cache_file.file_sha256(file)
        except OSError:  # removed meanwhile by another server's compile: not listed
            continue
    try:
        cache_file.write(folder / MANIFEST, json.dumps(listed, indent=0).encode())
        log.info("recorded the digests of %d compiled files in %s", len(listed), folder / MANIFEST)
    except OSError as e:
        log.warning("the manifest of compiled graphs could not be written in %s (%s)", folder, cache_file.describe(e))


def files(folder: Path) -> list[Path]:
    """The files of torch's cache in `folder`: not kvserve's own, not locks, not the manifest."""
    found = []
    for root, dirs, names in os.walk(folder):
        if Path(root) == folder:
            dirs[:] = [d for d in dirs if d != OWN and d not in UNRECORDED]
        found += [Path(root) / name for name in names
                  if not name.startswith(MANIFEST) and not name.endswith(".lock") and name != COMPILING]
    return found


def clear(folder: Path) -> int:
    """Remove torch's cache in `folder` (every entry beside kvserve's own, the locks and COMPILING) and the
    manifest; how many files it held."""
    count = len(files(folder))
    for entry in folder.iterdir() if folder.is_dir() else []:
        if entry.name not in (OWN, COMPILING, *UNRECORDED):
            remove(entry)
    return count


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def die_with_parent(parent: int) -> None:
    """This process is killed when the server that started it dies (kill -9 included): an orphan compile would
    hold both cores for minutes and write into the cache beside the server that replaces it."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the server died before the request took effect
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    from server.settings import parse
    from weights.resolve import resolve_model

    if "KVSERVE_COMPILE_PARENT" in os.environ:
        die_with_parent(int(os.environ["KVSERVE_COMPILE_PARENT"]))
    settings = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = load_engine(resolve_model(settings.model, progress=False), settings.engine_config())
    engine.compile()
    return 0


if __name__ == "__main__":
    sys.exit(main())
