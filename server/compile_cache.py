"""python -m server.compile_cache [the server's flags]: compile the decode step once, to fill inductor's disk cache.

The server runs this in a child process before it compiles in its own. Most of a first compile
(about a minute per graph for 30 layers on 2 cores) is Python that holds the GIL, and in the server's
process it would starve the thread that decodes. In a child process it costs CPU only; the server's own
compile then finds the generated code on disk and takes seconds (a warm restart's time).
"""

from __future__ import annotations

import logging
import sys

from engine import Engine
from server.settings import parse


def main(argv: list[str] | None = None) -> int:
    settings = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from weights.resolve import resolve_model

    engine = Engine.from_pretrained(resolve_model(settings.model, progress=False), settings.engine_config())
    engine.compile()
    return 0


if __name__ == "__main__":
    sys.exit(main())
