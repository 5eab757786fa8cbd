"""python -m bench {memory,speed,cache,decode,serve,prefix,soak,storm,structured,faults,tp,families,quants,perplexity,spec}: measured comparisons, as tables, JSON and plots."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def add_common(parser: argparse.ArgumentParser, suppress: bool) -> None:
    """The options every subcommand takes, before or after its name.

    After the name they default to SUPPRESS, so a value given before the name is not overwritten.
    """
    def default(value):
        return argparse.SUPPRESS if suppress else value

    parser.add_argument("--out", type=Path, default=default(Path("bench/results")),
                        help="folder for the tables, JSON and PNGs")
    parser.add_argument("--quick", action="store_true", default=default(False),
                        help="a small run that finishes in under a minute")
    parser.add_argument("--threads", type=int, default=default(None), help="torch threads (default: torch's choice)")

def weights(command: argparse.ArgumentParser) -> None:
    """The weight flags of the servers a bench starts."""
    command.add_argument("--quantize", default="auto", choices=["auto", "none", "int4", "int8"],
                         help="the server's --quantize")
    command.add_argument("--dense-copies", default="off", choices=["on", "off"], help="the server's --dense-copies")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    add_common(parser, suppress=False)
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help)
        add_common(sub, suppress=True)
        return sub

    memory = command("memory", help="KV cache bytes: MHA vs GQA vs MQA, formula vs allocated")
    memory.add_argument("--model", default=None, help="take the shape from a checkpoint folder")
    memory.add_argument("--layers", type=int, default=None)
    memory.add_argument("--heads", type=int, default=None)
    memory.add_argument("--head-dim", type=int, default=None)
    memory.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])

    speed = command("speed", help="decode and prefill speed of MHA vs GQA vs MQA (random weights)")
    speed.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])

    cache = command("cache", help="cached incremental decode vs recomputing the prefix per token")
    cache.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])

    decode = command("decode", help="kvserve vs transformers on one checkpoint")
    decode.add_argument("--model", default=None, help="checkpoint (default: the default model)")
    decode.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    decode.add_argument("--prompt-tokens", type=int, default=32)
    decode.add_argument("--new-tokens", type=int, default=128)
    decode.add_argument("--repeats", type=int, default=3)
    decode.add_argument("--compile", action="store_true",
                        help="compile kvserve's decode step first (reports the compile time)")
    decode.add_argument("--gguf", type=Path, default=None,
                        help="the GGUF llama.cpp runs beside kvserve, when llama_cpp is installed "
                             "(default: the model folder's model.gguf, which the default model keeps)")
    decode.add_argument("--quantize", default="auto", choices=["auto", "none", "int4", "int8"],
                        help="kvserve's weights (auto: a GGUF's quantized matrices as stored); transformers stays dense")
    decode.add_argument("--dense-copies", default="off", choices=["on", "off"],
                        help="kvserve's quantized layers also keep dense copies for many rows")

    serve = command("serve", help="load on the HTTP server: TTFT, inter-token latency, throughput")
    serve.add_argument("--url", default=None, help="a running server (default: start one on a free port)")
    serve.add_argument("--model", default=None, help="model for the server this starts (default: the default model)")
    serve.add_argument("--concurrency", default="1,4,16", help="comma-separated numbers of concurrent streams")
    serve.add_argument("--prompt-tokens", type=int, default=32)
    serve.add_argument("--new-tokens", type=int, default=64)
    serve.add_argument("--requests", type=int, default=None, help="requests per level (default: 2x concurrency)")
    serve.add_argument("--dtype", default="auto")
    serve.add_argument("--max-batch-size", type=int, default=16)
    weights(serve)
    serve.add_argument("--compile", default="off", choices=["auto", "on", "aot", "off"],
                       help="the server's --compile; with auto or on, timings start once its compile thread is done")

    prefix = command("prefix", help="prefix caching on vs off over HTTP: a growing chat, one system prompt for many "
                                     "users, and a long prompt arriving while a stream decodes")
    prefix.add_argument("--model", default=None, help="model for the servers this starts (default: the default model)")
    prefix.add_argument("--new-tokens", type=int, default=16)
    prefix.add_argument("--dtype", default="auto")
    weights(prefix)
    prefix.add_argument("--compile", default="off", choices=["auto", "on", "off"])

    soak = command("soak", help="mixed requests from C clients for N minutes: errors, server memory, inter-token "
                                 "latency per 30 s window, metrics vs clients")
    soak.add_argument("--minutes", type=float, default=30)
    soak.add_argument("--concurrency", type=int, default=16)
    soak.add_argument("--model", default=None, help="model for the server this starts (default: the default model)")
    soak.add_argument("--dtype", default="auto")
    weights(soak)
    soak.add_argument("--compile", default="auto", choices=["auto", "on", "off"])

    structured = command("structured", help="a JSON-schema grammar's cost per token, its compile time, and how many "
                                             "sampled outputs follow the schema")
    structured.add_argument("--model", default=None, help="checkpoint (default: the default model)")
    structured.add_argument("--dtype", default="auto")
    structured.add_argument("--compile", default="off", choices=["auto", "on", "off"])
    structured.add_argument("--max-tokens", type=int, default=200)
    structured.add_argument("--repeats", type=int, default=3)
    structured.add_argument("--samples", type=int, default=100, help="sampled outputs checked against the schema")

    storm = command("storm", help="storms of dropped streams (leaked slots) and more requests at once than the queue "
                                   "takes (only 200/429, RSS flat)")
    storm.add_argument("--storms", type=int, default=3)
    storm.add_argument("--streams", type=int, default=64, help="streams opened and dropped per storm")
    storm.add_argument("--requests", type=int, default=200, help="requests sent at once in the overload")
    storm.add_argument("--max-queue", type=int, default=32, help="the overloaded server's --max-queue")
    storm.add_argument("--new-tokens", type=int, default=32)
    storm.add_argument("--model", default=None, help="model for the servers this starts (default: the default model)")
    storm.add_argument("--max-batch-size", type=int, default=16)
    storm.add_argument("--dtype", default="auto")
    weights(storm)
    storm.add_argument("--compile", default="off", choices=["auto", "on", "off"])

    faults = command("faults", help="a warm home's cache files damaged (cut short, garbled, emptied, unreadable), "
                                     "read-only, and raced on: the server must start, answer and log the repair")
    faults.add_argument("--compile", default="auto", choices=["auto", "on", "off"])

    tp = command("tp", help="tensor parallelism on this machine: a decode step at TP 2 vs TP 1, and its all-reduces")
    tp.add_argument("--model", default=None, help="checkpoint, served dense (default: random weights of the default "
                                                  "model's sizes, with heads that split over 2 ranks)")
    tp.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])

    families = command("families", help="Qwen3 and Gemma 3 beside a Llama of the same sizes (decode per token), Gemma 3's "
                                         "KV cache with windows vs full length, gemma-3-270m over HTTP vs llama-server")
    families.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    families.add_argument("--llama-server", type=Path, default=None, help="llama.cpp's llama-server binary")
    families.add_argument("--repeats", type=int, default=3)
    families.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                          help="the kvserve server's --compile (timings start once its compile is done)")

    quants = command("quants", help="kvserve vs llama.cpp on the same GGUF files: 1 and N streams over HTTP, a long prompt's "
                                     "prefill, llama-bench tg and pp, resident memory, the read-bandwidth floor")
    quants.add_argument("--gguf", type=Path, nargs="+", required=True, help="GGUF files to serve")
    quants.add_argument("--llama-bin", type=Path, help="folder with llama.cpp's llama-server and llama-bench")
    quants.add_argument("--streams", type=int, nargs="+", default=[1, 4], help="concurrent streams (1 first)")
    quants.add_argument("--new-tokens", type=int, default=64)
    quants.add_argument("--prefill-tokens", type=int, default=512, help="the long prompt whose prefill is timed")
    quants.add_argument("--max-seq-len", type=int, default=1024,
                        help="kvserve's positions per slot (llama-server's slots hold 1024, as here by default)")
    quants.add_argument("--repeats", type=int, default=3)
    quants.add_argument("--turns", type=int, default=8,
                        help="one stream again, a request to each server and a llama-bench tg run in turn, this "
                             "many turns (0: none)")
    quants.add_argument("--compile", choices=("auto", "on", "aot", "off"), default="auto")

    spec = command("spec", help="speculative decoding vs none: tasks that quote their input, JSON, free chat, mixed "
                                "streams; tokens/s and whether the output stayed the same")
    spec.add_argument("--model", default=None, help="checkpoint (default: the default model)")
    spec.add_argument("--dtype", default="auto")
    spec.add_argument("--compile", default="auto", choices=["auto", "on", "aot", "off"],
                      help="as the server's --compile (default: its default)")
    spec.add_argument("--speculative", default="auto", choices=["ngram", "suffix", "auto"])
    spec.add_argument("--num-speculative-tokens", type=int, default=4)
    spec.add_argument("--streams", type=int, default=16, help="requests of the mixed load, decoded side by side")
    spec.add_argument("--max-tokens", type=int, default=200)
    spec.add_argument("--repeats", type=int, default=5, help="pairs of runs, without then with speculation")
    spec.add_argument("--llama-bin", type=Path, help="folder with llama.cpp's llama-server: its n-gram speculation "
                                                     "on the same GGUF as the reference")
    spec.add_argument("--gguf", type=Path, help="the GGUF file llama-server reads (default: the model's model.gguf)")

    perplexity = command("perplexity", help="kvserve's perplexity beside llama-perplexity's on the same GGUF file and "
                                             "text, chunked as llama.cpp chunks it")
    perplexity.add_argument("--gguf", type=Path, required=True, help="the GGUF file both sides read")
    perplexity.add_argument("--llama-bin", type=Path, help="folder with llama.cpp's llama-perplexity and llama-tokenize")
    perplexity.add_argument("--ctx", type=int, default=128, help="tokens per chunk (llama-perplexity's -c)")
    perplexity.add_argument("--text", type=Path, help="a text file to score in place of the built-in paragraphs "
                                                      "(more tokens, a steadier perplexity)")

    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from importlib import import_module

    try:
        module = import_module(f"bench.{args.command}")
    except ModuleNotFoundError as e:  # the bench's own dependencies are an extra, not the server's
        if e.name is None or e.name.split(".")[0] in ("bench", "engine", "server", "weights"):
            raise
        print(f"python -m bench {args.command} needs {e.name}, which the [bench] extra installs: "
              f"pip install -e \".[bench]\"", file=sys.stderr)
        return 2
    module.run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

