"""llama.cpp (llama-cpp-python) on a GGUF, timed as `bench decode` times kvserve; run in a process of its own.

`python -m bench.llama_cpp FILE.gguf` prints one JSON line. It lives in its own process because
llama.cpp's OpenMP runtime and threads must not share a process with torch's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path


def available() -> bool:
    return find_spec("llama_cpp") is not None


def measure(gguf: Path, prompt: list[int], long_prompt: list[int], new_tokens: int, threads: int,
            repeats: int) -> dict:
    """Runs this module on `gguf` in a subprocess: per-token decode seconds and prefill seconds, as medians."""
    request = {"prompt": prompt, "long_prompt": long_prompt, "new_tokens": new_tokens, "threads": threads,
               "repeats": repeats}
    result = subprocess.run([sys.executable, "-m", "bench.llama_cpp", str(gguf)], input=json.dumps(request),
                            capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"llama.cpp run failed: {result.stderr.strip()[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.llama_cpp", description=__doc__)
    parser.add_argument("gguf", type=Path)
    args = parser.parse_args()
    request = json.loads(sys.stdin.read())
    from llama_cpp import Llama

    n_ctx = len(request["long_prompt"]) + request["new_tokens"] + 8
    model = Llama(model_path=str(args.gguf), n_ctx=max(n_ctx, 1024), n_threads=request["threads"],
                  n_threads_batch=request["threads"], n_batch=512, verbose=False)

    def generate(prompt: list[int], n: int) -> tuple[float, float]:
        """(prefill seconds, seconds per decoded token): greedy, as kvserve runs it."""
        model.reset()
        started = time.perf_counter()
        model.eval(prompt)
        prefilled = time.perf_counter()
        for _ in range(n):
            model.eval([model.sample(temp=0.0)])
        return prefilled - started, (time.perf_counter() - prefilled) / max(n, 1)

    generate(request["prompt"], 4)  # warm-up
    decode = [generate(request["prompt"], request["new_tokens"])[1] for _ in range(request["repeats"])]
    prefill = [generate(request["long_prompt"], 0)[0] for _ in range(request["repeats"])]
    print(json.dumps({"decode_per_token_s": statistics.median(decode), "prefill_s": statistics.median(prefill),
                      "version": __import__("llama_cpp").__version__}))


if __name__ == "__main__":
    main()
