"""Damaged caches: a copy of a warm KVSERVE_HOME with every cache file damaged one way, and the server on it.

Each file kvserve keeps under its home (its kernels library, their measured forms, the compiled graphs, the
imported default model) is damaged the same way in a fresh copy of a home that has served once: cut short,
overwritten in the middle, emptied, or made unreadable (a folder where the file was: root reads any file
whatever its mode). The server must start, answer the default model's "Paris" question, and log what it
repaired; the time from its start to /health 200 is reported. Two more cases: a read-only home (a read-only
bind mount, where this user may make one) whose kernels are not built yet, and two servers racing on one
damaged home.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.common import free_port, machine, machine_line, markdown_table, write_results

DAMAGES = ("truncated", "garbled", "emptied", "unreadable")
QUESTION = "What is the capital of France? Answer in one sentence."
REPAIRED = ("cannot be used", "cannot be written")  # the words of every repair's log line
READY, FAILED = "ready:", "failed to load"
# The log lines after which a compiling server has nothing left to write to its home.
SETTLED = ("recorded the digests of", "decode stays eager", "compiling the decode step failed")


@dataclass
class Started:
    """A server started on a home: how long until /health said 200, what it answered, and its log."""

    process: subprocess.Popen
    url: str
    started_at: float
    lines: list[str] = field(default_factory=list)
    healthy_s: float | None = None
    answer: str | None = None

    def keep_reading(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)

    @property
    def repairs(self) -> list[str]:
        return [line.strip() for line in self.lines if any(words in line for words in REPAIRED)]


def cache_files(home: Path) -> list[Path]:
    """The files kvserve keeps in `home`: its kernels and the timings measured, the model's files, and, of the compiled
    graphs, the largest generated library and one entry of each of torch's caches."""
    compiled = home / "compiled"
    found = sorted((compiled / "kvserve").glob("kernels-*.so")) + sorted((compiled / "kvserve").glob("timings-*.json"))
    model = home / "models" / "smollm2-135m-instruct"
    found += [model / name for name in ("model.gguf", "config.json", "tokenizer.json")]
    generated = [p for p in compiled.rglob("*.so") if "kvserve" not in p.parts]
    if generated:
        found.append(max(generated, key=lambda p: p.stat().st_size))
    for cache in ("fxgraph", "aotautograd"):
        entries = sorted(p for p in (compiled / cache).rglob("*") if p.is_file()) if (compiled / cache).is_dir() else []
        found += entries[:1]
    return [p for p in found if p.is_file()]


def damage(path: Path, how: str) -> None:
    """Damage one file `how` (one of DAMAGES)."""
    size = path.stat().st_size
    if how == "truncated":
        os.truncate(path, min(1000, size // 2))
    elif how == "garbled":  # 4 kB (or the middle half of a smaller file) overwritten in its middle
        length = min(4096, max(1, size // 2))
        with open(path, "r+b") as file:
            file.seek((size - length) // 2)
            file.write(os.urandom(length))
    elif how == "emptied":
        os.truncate(path, 0)
    elif how == "unreadable":
        path.unlink()
        path.mkdir()
    else:
        raise ValueError(f"unknown damage {how!r}: one of {DAMAGES}")


def damaged_copy(home: Path, how: str, into: Path) -> Path:
    """A copy of `home` at `into` with every cache file damaged `how`; returns the copy."""
    shutil.copytree(home, into, symlinks=True)
    for path in cache_files(into):
        damage(path, how)
    return into


def launch(home: Path, *flags: str) -> Started:
    """`python -m server` on `home` (KVSERVE_HOME), on a free port, just started."""
    port = free_port()
    env = dict(os.environ, KVSERVE_HOME=str(home))
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # the home's own compiled folder
    started_at = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "server", "--port", str(port), *flags], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=env)
    return Started(process, f"http://127.0.0.1:{port}", started_at)


def wait_ready(server: Started) -> Started:
    """Returns once the server logged that it is ready (or failed, or exited), with /health read then."""
    for line in server.process.stdout:  # the log is the synchronisation: uvicorn listens before the model loads
        server.lines.append(line)
        if READY in line or FAILED in line:
            break
    if READY in "".join(server.lines[-1:]) and httpx.get(f"{server.url}/health", timeout=10).status_code == 200:
        server.healthy_s = time.perf_counter() - server.started_at
    threading.Thread(target=server.keep_reading, daemon=True).start()  # a full pipe would block the server
    return server


def ask(server: Started) -> str:
    """The server's greedy answer to QUESTION."""
    reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 20,
        "temperature": 0})
    reply.raise_for_status()
    server.answer = reply.json()["choices"][0]["message"]["content"]
    return server.answer


def stop(server: Started) -> None:
    server.process.terminate()
    server.process.wait(60)


@contextlib.contextmanager
def serving(home: Path, *flags: str, count: int = 1):
    """`count` servers on `home`, started at once, until the block ends: one Started, or a list of them."""
    servers = [launch(home, *flags) for _ in range(count)]
    try:
        for server in servers:
            wait_ready(server)
        yield servers[0] if count == 1 else servers
    finally:
        for server in servers:
            stop(server)


@contextlib.contextmanager
def read_only(folder: Path):
    """`folder` mounted read-only over itself until the block ends; raises PermissionError where this user may
    not mount."""
    result = subprocess.run(["mount", "--bind", str(folder), str(folder)], capture_output=True, text=True)
    if result.returncode != 0:
        raise PermissionError(f"cannot bind-mount {folder}: {result.stderr.strip()}")
    try:
        result = subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], capture_output=True, text=True)
        if result.returncode != 0:
            raise PermissionError(f"cannot remount {folder} read-only: {result.stderr.strip()}")
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], capture_output=True)


def warm_home(into: Path, flags: list[str]) -> Path:
    """A home that has served once with `flags`: the model imported, the kernels built and measured, and, when
    compiling, every graph compiled and recorded."""
    into.mkdir(parents=True, exist_ok=True)
    with serving(into, *flags) as server:
        if server.healthy_s is None:
            raise RuntimeError("the server did not start on a fresh home:\n" + "".join(server.lines[-20:]))
        if "off" not in flags and settled_s(server) is None:
            raise RuntimeError("the server died while compiling")
    return into


def settled_s(server: Started) -> float | None:
    """Seconds from the server's start until its compile thread was done (None if it ended without)."""
    while not any(marker in line for line in list(server.lines) for marker in SETTLED):
        if server.process.poll() is not None:
            return None
        time.sleep(1)  # a bench polling a background compile's log, not a test's synchronisation
    return time.perf_counter() - server.started_at


def case(name: str, servers: list[Started], compiling: bool = False) -> dict:
    """One case's row: each server's time to healthy, its answer, what it logged it repaired, and, when
    `compiling`, the time until its compile was done and recorded."""
    for server in servers:
        if server.healthy_s is not None:
            ask(server)
    settled = [settled_s(s) for s in servers] if compiling else []
    return {"case": name, "healthy_s": [s.healthy_s for s in servers], "answers": [s.answer for s in servers],
            "paris": all(s.answer and "Paris" in s.answer for s in servers), "compiled_s": settled,
            "compiled": [any("decode compiled for every batch size" in line for line in s.lines) for s in servers]
            if compiling else [],
            "repairs": sorted({r.split(": ", 1)[-1] for s in servers for r in s.repairs})}


def seconds(values: list[float | None]) -> str:
    return ", ".join(f"{s:.1f}" if s is not None else "never" for s in values) or "-"


def run(args: argparse.Namespace) -> dict:
    flags = ["--compile", args.compile]
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvserve-faults-") as scratch:
        scratch = Path(scratch)
        home = warm_home(scratch / "warm", flags)
        damaged = {p.relative_to(home).as_posix() for p in cache_files(home)}
        compiling = "off" not in flags
        with serving(home, *flags) as server:
            rows.append(case("undamaged (warm restart)", [server], compiling))
        for how in DAMAGES[:1] if args.quick else DAMAGES:
            with serving(damaged_copy(home, how, scratch / how), *flags) as server:  # compiled again for one only
                rows.append(case(f"every cache file {how}", [server], compiling and how == DAMAGES[0]))
        racing = damaged_copy(home, "truncated", scratch / "racing")
        with serving(racing, *flags, count=2) as both:
            rows.append(case("two servers racing on a truncated home", both))
        fresh = scratch / "read-only"
        shutil.copytree(home / "models", fresh / "models")  # the model, without kernels or compiled graphs
        try:
            with read_only(fresh), serving(fresh, *flags) as server:
                rows.append(case("read-only home, kernels not built", [server]))
        except PermissionError as e:
            rows.append({"case": "read-only home", "skipped": str(e)})
    payload = {"machine": machine(), "flags": flags, "damaged_files": sorted(damaged), "cases": rows}
    table = rendered(payload)
    write_results(args.out, "faults", payload, table)
    print(table)
    return payload


REPAIR_NAMES = {"kvserve's kernels at": "kernels rebuilt", "measured timings": "timings measured again",
                "cached model": "model imported again", "compiled graphs in": "compiled graphs removed",
                "compiled files in": "unrecorded compiled files removed", "cannot be written": "a temporary folder"}


def rendered(payload: dict) -> str:
    """The Markdown table of a run's payload (each repair by a short name; the JSON has the log lines)."""
    def repaired(row: dict) -> str:
        names = [name for words, name in REPAIR_NAMES.items() if any(words in line for line in row.get("repairs", []))]
        return ", ".join(names) or row.get("skipped", "nothing")

    rows = payload["cases"]
    return "\n".join([
        f"# Damaged caches (python -m server {' '.join(payload['flags'])})", "", machine_line(payload["machine"]), "",
        "Damaged in each copy: " + ", ".join(f"`{p}`" for p in payload["damaged_files"]), "",
        markdown_table(["case", "healthy after (s)", "answered Paris", "compiled after (s)", "what the server repaired"],
                       [[r["case"], seconds(r.get("healthy_s", [])), r.get("paris", "-"), seconds(r.get("compiled_s", [])),
                         repaired(r)] for r in rows])])
