"""What every benchmark shares: the machine line, repeated timing, Markdown tables, JSON and plots."""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch


def machine() -> dict:
    cpu = platform.processor() or "unknown"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    info = {"cpu": cpu, "cores": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "device": "cpu"}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
    return info


def machine_line(info: dict) -> str:
    return (f"Machine: {info['cpu']} ({info['cores']} cores, {info['threads']} torch threads, "
            f"{info['cpu_capability']}), torch {info['torch']}, device {info['device']}")


@dataclass(frozen=True)
class Timing:
    median: float
    low: float
    high: float
    runs: int

    def ms(self) -> str:
        return f"{self.median * 1e3:.1f} ({self.low * 1e3:.1f}-{self.high * 1e3:.1f})"

    def as_dict(self) -> dict:
        return {"median_s": self.median, "min_s": self.low, "max_s": self.high, "runs": self.runs}


def timed(fn: Callable[[], object], repeats: int, warmup: int = 1) -> Timing:
    """Median over `repeats` runs after `warmup` runs, with min and max."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return Timing(statistics.median(samples), min(samples), max(samples), repeats)


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_results(out: Path, name: str, payload: dict, table: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(payload, indent=2))
    (out / f"{name}.md").write_text(table + "\n")


def plot(out: Path, name: str, title: str, xlabel: str, ylabel: str, series: dict[str, tuple[list, list]],
         logx: bool = False, logy: bool = False) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
