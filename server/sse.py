"""Server-Sent Events framing."""

from __future__ import annotations

import json


def event(data: dict | str, space: bool = True) -> bytes:
    """One `data:` event; TGI writes `data:{...}`, OpenAI `data: {...}`."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data:{' ' if space else ''}{payload}\n\n".encode()
