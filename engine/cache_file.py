"""Files kvserve keeps as caches (its kernels, their measured forms, compiled graphs' records, imported models):
each written whole and checked before use.

A cache file is put in place by a rename, so no reader sees it half written, and the sha256 of its bytes is
recorded beside it (`NAME.sha256`) after the rename. A reader reads the digest first and then the file, and
uses the file only if the two agree: a file cut short by a power cut or a full disk, overwritten in part,
emptied, or one that cannot be read is a miss, to be built again, never something to `dlopen` or parse.
A writer racing another can make a reader see one's digest beside the other's file: that too is a miss, so
the reader builds the file once more; it never uses a file that does not match.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

DIGEST_SUFFIX = ".sha256"
MANIFEST = "kvserve-digests.json"  # in a sealed folder: each file's size and sha256


class CacheMiss(Exception):
    """A cache file that cannot be used; `found` says whether anything was there (damage, not absence)."""

    def __init__(self, path: Path, reason: str, found: bool):
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason
        self.found = found


def digest_path(path: Path) -> Path:
    return path.with_name(path.name + DIGEST_SUFFIX)


def file_sha256(file) -> str:
    """The sha256 of an open binary file's bytes from where it stands to its end."""
    digest = hashlib.sha256()
    for block in iter(lambda: file.read(1 << 20), b""):
        digest.update(block)
    return digest.hexdigest()


def read(path: Path) -> bytes:
    """The bytes of the cache file at `path`, checked against its digest; CacheMiss if they cannot be used."""
    with opened(path) as file:
        return file.read()


@contextlib.contextmanager
def opened(path: Path) -> Iterator:
    """The cache file at `path`, checked against its digest, open at its start: what is used is what was
    checked, even if a writer replaces the file meanwhile. CacheMiss if it cannot be used."""
    try:
        recorded = digest_path(path).read_text().strip()
    except FileNotFoundError:
        raise CacheMiss(path, "no digest is recorded beside it" if os.path.lexists(path) else "absent",
                        found=os.path.lexists(path)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise CacheMiss(path, f"its digest cannot be read ({describe(e)})", found=True) from None
    try:
        file = open(path, "rb")
    except OSError as e:
        raise CacheMiss(path, f"it cannot be opened ({describe(e)})", found=os.path.lexists(path)) from None
    with file:
        try:
            actual = file_sha256(file)
        except OSError as e:
            raise CacheMiss(path, f"it cannot be read ({describe(e)})", found=True) from None
        if actual != recorded:
            raise CacheMiss(path, f"its {os.fstat(file.fileno()).st_size} bytes do not match the digest recorded "
                                  "when it was written (cut short, overwritten or emptied)", found=True)
        file.seek(0)
        yield file


@contextlib.contextmanager
def loadable(path: Path) -> Iterator[str]:
    """A path for `dlopen` that names the checked file itself (/proc/self/fd/N of the open, checked file), so
    no file replaced after the check is loaded; CacheMiss if it cannot be used."""
    with opened(path) as file:
        by_descriptor = f"/proc/self/fd/{file.fileno()}"
        yield by_descriptor if os.path.exists(by_descriptor) else str(path)


def write(path: Path, data: bytes) -> None:
    """`data` as the cache file at `path`, with its digest."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}-", delete=False) as file:
        file.write(data)
    publish(Path(file.name), path)


def publish(partial: Path, path: Path) -> None:
    """The complete file `partial` (in `path`'s folder) renamed to `path`, then its digest recorded."""
    with open(partial, "rb") as file:
        digest = file_sha256(file)
    discard_unusable(path)
    os.replace(partial, path)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}-", delete=False) as file:
        file.write(digest + "\n")
    os.replace(file.name, digest_path(path))


def discard_unusable(path: Path) -> None:
    """Whatever lies at `path` that a rename cannot replace (a folder where a file belongs)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)


def seal(folder: Path) -> None:
    """Record the size and digest of every file in `folder` inside it, before the folder is renamed into place
    (the folder arrives whole, its manifest with it)."""
    manifest = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        with open(path, "rb") as file:
            manifest[path.relative_to(folder).as_posix()] = {"size": path.stat().st_size, "sha256": file_sha256(file)}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))


def check_sealed(folder: Path) -> None:
    """Nothing, when every file `folder`'s manifest lists is there with its size and digest; else CacheMiss."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        entries = [(folder / name, entry["size"], entry["sha256"]) for name, entry in manifest.items()]
    except FileNotFoundError:
        raise CacheMiss(folder, "no manifest of its files" if os.path.lexists(folder) else "absent",
                        found=os.path.lexists(folder)) from None
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise CacheMiss(folder, f"its manifest cannot be read ({describe(e)})", found=True) from None
    for path, size, digest in entries:
        try:
            check_digest(path, digest, size)
        except CacheMiss as miss:
            raise CacheMiss(folder, f"{path.name}: {miss.reason}", found=True) from None


def check_digest(path: Path, digest: str, size: int | None = None) -> None:
    """Nothing, when the file at `path` has the sha256 `digest` (and `size` bytes, when given); else CacheMiss."""
    try:
        with open(path, "rb") as file:
            if (size is not None and os.fstat(file.fileno()).st_size != size) or file_sha256(file) != digest:
                raise CacheMiss(path, "it does not match the digest recorded when it was written (cut short, "
                                      "overwritten or emptied)", found=True)
    except OSError as e:
        raise CacheMiss(path, f"it cannot be read ({describe(e)})", found=True) from None


@contextlib.contextmanager
def staging(target: Path) -> Iterator[Path]:
    """A path in a scratch folder beside `target` for the block to make a sealed folder at; renamed to `target`
    when the block ends. The rename is atomic, so the cache holds the folder whole or not at all: a killed build
    leaves only a hidden scratch folder, which nothing reads. Where another process put its folder in place first,
    that one stays (it is checked when read)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}-partial-") as scratch:
        made = Path(scratch) / "made"
        yield made
        try:
            os.replace(made, target)
        except OSError:
            if not (target / MANIFEST).is_file():  # not a concurrent build that got there first
                raise


def set_aside(folder: Path) -> None:
    """A damaged cached folder out of the way, whole (renamed, then removed), so that it can be made again;
    where it cannot be moved (a read-only home), it stays, and nothing reads it."""
    aside = folder.with_name(f".{folder.name}-damaged-{os.getpid()}")
    try:
        os.replace(folder, aside)
    except OSError:
        return  # gone already (another process set it aside), or not ours to move
    if aside.is_dir() and not aside.is_symlink():
        shutil.rmtree(aside, ignore_errors=True)
    else:
        aside.unlink(missing_ok=True)


def compiled_root() -> Path:
    """The folder of what kvserve compiles for this machine (its kernels, their timings, compiled decode steps):
    `kvserve/` in torch's compile cache (TORCHINDUCTOR_CACHE_DIR, or torch's default). Read from the environment
    where it is set (a server always sets it): torch's own lookup imports its compiler, over 100 MB, which a
    process serving steps compiled ahead of time never needs."""
    named = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if named:
        return Path(os.path.abspath(named)) / "kvserve"
    from torch._inductor.runtime.cache_dir_utils import cache_dir  # torch's default folder, which it then names

    return Path(cache_dir()) / "kvserve"


def writable(folder: Path) -> bool:
    """Whether files can be created in `folder` (made if missing): a read-only mount or a foreign owner says no."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def describe(error: Exception) -> str:
    return getattr(error, "strerror", None) or type(error).__name__
