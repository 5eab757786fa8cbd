"""Server-Sent Events framing."""

from __future__ import annotations

import json


def event(data: dict | str, space: bool = True, name: str | None = None) -> bytes:
    """One `data:` event, named when `name` is given (Anthropic's `event: message_start`); TGI writes
    `data:{...}`, OpenAI and Anthropic `data: {...}`."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    named = f"event: {name}\n" if name is not None else ""
    return f"{named}data:{' ' if space else ''}{payload}\n\n".encode()
