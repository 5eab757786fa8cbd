"""Choosing the device and dtype: "auto" resolves once, at engine start."""

from __future__ import annotations

from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available here")
    if not (name == "cpu" or name.startswith("cuda")):
        raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'auto', got {name!r}")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on CUDA and on CPUs with native bf16 arithmetic, else float32."""
    if name == "auto":
        native_bf16 = device.type == "cuda" or cpu_has_native_bf16()
        return torch.bfloat16 if native_bf16 else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)} or 'auto', got {name!r}")
    return DTYPES[name]


def cpu_has_native_bf16() -> bool:
    flags = cpu_description()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_description() -> str:
    """The CPU's model and flags lines from /proc/cpuinfo (empty where there is none)."""
    try:
        lines = Path("/proc/cpuinfo").read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))
