"""A streamed POST's Server-Sent Events, read off a socket with as little client work per event as HTTP allows.

The bench's client runs on the cores of the server it measures, so the CPU it spends on an event is taken from the
server's threads: with as many compute threads as cores, every moment the client runs holds one of them, and the
others wait for it at the step's next barrier. So the response is read with asyncio's own streams (the status line,
the headers, the chunked body's frames, each event's `data:` as JSON) rather than through an HTTP client's layers:
less than half httpx's CPU an event (bench/README.md, session 46). Both servers, kvserve's and llama-server, are
read by it.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import AsyncIterator
from urllib.parse import urlsplit


class HTTPStatusError(Exception):
    """The server answered with a status other than 200."""

    def __init__(self, status: int):
        super().__init__(f"HTTP {status}")
        self.status = status


async def events(url: str, path: str, body: dict) -> AsyncIterator[tuple[float, dict]]:
    """POST `body` as JSON to url + path on a connection of its own (closed after the answer: no kept-alive
    connection for a server to close under the next request) and yield (arrival time, payload) for every event's
    `data:` JSON, up to the end of the body ("[DONE]" is not yielded). Raises HTTPStatusError for a status other
    than 200, OSError or asyncio.IncompleteReadError for a connection that fails."""
    address = urlsplit(url)
    reader, writer = await asyncio.open_connection(address.hostname, address.port)
    try:
        content = json.dumps(body).encode()
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {address.netloc}\r\nContent-Type: application/json\r\n"
                     f"Accept: text/event-stream\r\nContent-Length: {len(content)}\r\nConnection: close\r\n\r\n".encode()
                     + content)
        status_line = (await reader.readline()).split()
        if len(status_line) < 2:
            raise ConnectionError("the connection closed before the status line")
        status = int(status_line[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip().lower()
        if status != 200:
            raise HTTPStatusError(status)
        pending = b""
        async for piece in body_pieces(reader, "chunked" in headers.get("transfer-encoding", "")):
            arrived = time.perf_counter()
            *whole, pending = (pending + piece).replace(b"\r\n", b"\n").split(b"\n\n")  # events end at a blank line
            for event in whole:
                for line in event.split(b"\n"):
                    if line.startswith(b"data:") and (data := line[5:].strip()) != b"[DONE]":
                        yield arrived, json.loads(data)
    finally:
        writer.close()


async def body_pieces(reader: asyncio.StreamReader, chunked: bool) -> AsyncIterator[bytes]:
    """The body as it arrives: a chunked body's chunks without their framing, or whatever a plain one's reads give
    up to the connection's end."""
    if not chunked:
        while piece := await reader.read(65536):
            yield piece
        return
    while size := int((await reader.readline()).split(b";")[0], 16):
        yield await reader.readexactly(size)
        await reader.readexactly(2)  # the CRLF after a chunk's bytes
