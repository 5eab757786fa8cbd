"""The process heap: memory that loading and compiling freed, handed back to the system."""

from __future__ import annotations

import ctypes
import gc


def release_freed_memory() -> bool:
    """Hand the heap that loading or compiling freed back to the system; glibc's allocator keeps it for reuse.
    Unpacking and repacking a GGUF's blocks goes through temporaries about the model's size (a 1B Q4_K_M model's
    server held 2.4 GB resident instead of 1.4), parsing a tokenizer through its JSON too (Gemma 3's tokenizer of
    262,144 tokens and 514,847 merges: 290 MB, of which 96 remain), and a cold compile of the decode step leaves
    about 80 MB (the default model: resident +273 MB after it, +194 MB after this). Whether there was an allocator
    to ask (glibc's malloc_trim)."""
    gc.collect()  # objects in reference cycles free their memory first
    try:
        ctypes.CDLL(None).malloc_trim(0)  # 1 if memory was released, 0 if there was none to release
        return True
    except (OSError, AttributeError):  # not glibc
        return False
