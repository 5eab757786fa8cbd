"""kvserve vs transformers on the same checkpoint, dtype and threads: decode, batch throughput, prefill."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from bench import llama_cpp
from bench.common import Timing, machine, machine_line, markdown_table, plot, timed, write_results
from engine import Engine, EngineConfig, SamplingParams
from engine.linear.dense import CpuLinear
from engine.linear.dense import PackedLinear
from engine.linear.quantized import WeightOnlyLinear
from engine.linear.two_forms import TwoForms
from weights.checkpoint import transformers_files
from weights.gguf_file import WEIGHTS_NAME, import_gguf
from weights.loading import load_engine


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM

    from weights.resolve import resolve_model

    new_tokens = 16 if args.quick else args.new_tokens
    repeats = 1 if args.quick else args.repeats
    path = resolve_model(args.model)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    # Prefix caching off: every timed run repeats its prompts, and must compute them as the reference does.
    ours = load_engine(path, EngineConfig(device="cpu", dtype=args.dtype, max_batch_size=8, max_seq_len=1024,
                                                     prefix_caching=False,
                                                     quantize=args.quantize, dense_copies=args.dense_copies == "on",
                                                     compile="on" if args.compile else "off"))
    started = time.perf_counter()
    compiled = ours.compile()
    compile_s = time.perf_counter() - started if compiled else None
    with tempfile.TemporaryDirectory() as scratch:
        theirs = AutoModelForCausalLM.from_pretrained(dense_folder(path, Path(scratch)), dtype=dtype).eval()
    quantized = f"{args.quantize} weights" if ours.quantized else None  # auto: as the GGUF stores them
    generator = torch.Generator().manual_seed(0)
    vocab = ours.model.config.vocab_size
    prompts = [torch.randint(3, vocab, (args.prompt_tokens,), generator=generator).tolist() for _ in range(8)]
    prefill_tokens = 64 if args.quick else 512
    long_prompt = torch.randint(3, vocab, (prefill_tokens,), generator=generator).tolist()

    def ours_generate(batch: list[list[int]], n: int):
        return ours.generate(batch, SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True))

    @torch.inference_mode()
    def theirs_generate(batch: list[list[int]], n: int):
        return theirs.generate(torch.tensor(batch), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=0)

    results: dict[str, dict[str, Timing]] = {}
    copies = args.dense_copies == "on" and "dense copies"
    parts = [part for part in (quantized, copies, compiled and "compiled") if part]
    ours_name = f"kvserve ({', '.join(parts)})" if parts else "kvserve"
    for name, gen in ((ours_name, ours_generate), ("transformers", theirs_generate)):
        one = timed(lambda: gen(prompts[:1], 1), repeats)
        full = timed(lambda: gen(prompts[:1], new_tokens), repeats)
        batch = timed(lambda: gen(prompts, new_tokens), repeats)
        prefill = timed(lambda: gen([long_prompt], 1), repeats)
        decode = Timing(*(((f - o) / (new_tokens - 1)) for f, o in (
            (full.median, one.median), (full.low, one.low), (full.high, one.high))), repeats)
        results[name] = {"decode_per_token": decode, "batch8": batch, "prefill": prefill}

    reference = reference_run(args, path, prompts, long_prompt, new_tokens, repeats)
    capacity = context_independence(ours.model, repeats)
    floor = matmul_floor(ours.model, repeats)
    rows, payload = [], {"machine": machine(), "model": str(path), "dtype": args.dtype, "quantize": quantized and args.quantize,
                         "compile_s": compile_s, "prompt_tokens": args.prompt_tokens, "new_tokens": new_tokens, "prefill_tokens": prefill_tokens,
                         "results": {}, "capacity": capacity, "matmul_floor": floor.as_dict()}
    for name, r in results.items():
        tps = 8 * new_tokens / r["batch8"].median
        rows.append([name, r["decode_per_token"].ms(), f"{tps:.1f}", r["prefill"].ms()])
        payload["results"][name] = {k: v.as_dict() for k, v in r.items()} | {"batch8_tokens_per_s": tps}
    k, t = results[ours_name], results["transformers"]
    ratios = {
        "decode_speedup": t["decode_per_token"].median / k["decode_per_token"].median,
        "batch8_speedup": t["batch8"].median / k["batch8"].median,
        "prefill_speedup": t["prefill"].median / k["prefill"].median,
    }
    ratios["ceiling_vs_transformers"] = t["decode_per_token"].median / floor.median
    rows.append(["transformers / kvserve", f"{ratios['decode_speedup']:.2f}x faster",
                 f"{ratios['batch8_speedup']:.2f}x", f"{ratios['prefill_speedup']:.2f}x faster"])
    if reference:
        payload["llama_cpp"] = reference
        ratios["vs_llama_cpp_decode"] = reference["decode_per_token_s"] / k["decode_per_token"].median
        ratios["vs_llama_cpp_prefill"] = reference["prefill_s"] / k["prefill"].median
        rows.append([f"llama.cpp {reference['version']} ({reference['gguf']})", f"{reference['decode_per_token_s'] * 1e3:.1f}",
                     "-", f"{reference['prefill_s'] * 1e3:.1f}"])
        rows.append(["llama.cpp / kvserve", f"{ratios['vs_llama_cpp_decode']:.2f}x faster", "-",
                     f"{ratios['vs_llama_cpp_prefill']:.2f}x faster"])
    payload["ratios"] = ratios
    table = "\n".join([
        f"# kvserve vs transformers ({args.dtype}{', kvserve with ' + quantized if quantized else ''}, "
        f"{Path(path).name})", "", machine_line(payload["machine"]), "",
        f"Prompt {args.prompt_tokens} tokens, {new_tokens} new tokens, greedy; median (min-max) of {repeats} runs.", "",
        markdown_table(["", "batch-1 decode ms/token", "batch-8 total tokens/s", f"prefill {prefill_tokens} tokens ms"], rows), "",
        f"Decode step at context 128: {capacity['ms_512']:.1f} ms with max_seq_len 512, {capacity['ms_8192']:.1f} ms "
        f"with max_seq_len 8192 (ratio {capacity['ratio']:.2f}; attention reads only the filled positions).", "",
        f"The step's matrix products alone (every linear layer once at batch 1, kvserve's weights and "
        f"kernels, nothing else): {floor.ms()} ms, {weight_bytes(ours.model) / floor.median / 1e9:.1f} GB/s of "
        f"weights. No implementation calling these kernels decodes faster, so at most "
        f"{ratios['ceiling_vs_transformers']:.2f}x transformers' batch-1 decode here.",
    ])
    stem = f"decode_{args.dtype}" + (f"_{args.quantize}" if quantized else "")
    write_results(args.out, stem, payload, table)
    plot(args.out, stem, f"Decode: kvserve vs transformers ({args.dtype})", "batch size",
         "output tokens/s", {name: ([1, 8], [1 / r["decode_per_token"].median, 8 * new_tokens / r["batch8"].median])
                             for name, r in results.items()})
    if compile_s is not None:
        table += f"\n\nkvserve's decode step compiled in {compile_s:.1f} s before the timings (every graph)."
    print(table)
    return payload


def dense_folder(path: Path, scratch: Path) -> Path:
    """The checkpoint as transformers reads it densely: a GGUF's weights dequantized into `scratch`.

    (transformers can read the GGUF itself, but then it may keep the blocks packed and compute in float32:
    not the dense `--dtype` model this bench compares with.)
    """
    if not transformers_files(path):
        return path
    return import_gguf(Path(path) / WEIGHTS_NAME, scratch, progress=False, dequantize=True)


def reference_run(args, path: Path, prompts, long_prompt, new_tokens: int, repeats: int) -> dict | None:
    """llama.cpp on the same weights as a GGUF, when llama_cpp is installed and the GGUF is at hand."""
    gguf = args.gguf or Path(path) / WEIGHTS_NAME
    if not llama_cpp.available() or not gguf.is_file():
        print(f"llama.cpp column skipped: {'no GGUF at ' + str(gguf) if llama_cpp.available() else 'llama_cpp is not installed'}")
        return None
    result = llama_cpp.measure(gguf, prompts[0], long_prompt, new_tokens, torch.get_num_threads(), repeats)
    return result | {"gguf": gguf.name}


def projections(model: torch.nn.Module, rows: int = 1) -> list[torch.nn.Module]:
    """Every matrix product of a decode step of `rows` sequences: the blocks' projections and the LM head, each
    in the form it takes for that many rows, whatever their kind."""
    products = (torch.nn.Linear, CpuLinear, PackedLinear, WeightOnlyLinear)

    def found(module: torch.nn.Module) -> list[torch.nn.Module]:
        if isinstance(module, TwoForms):
            return [module.form(rows)]
        if isinstance(module, products):
            return [module]
        return [p for child in module.children() for p in found(child)]

    return found(model.layers) + found(model.lm_head)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one batch-1 decode step reads through its matrix products."""
    return sum(t.numel() * t.element_size() for m in projections(model) for t in [*m.parameters(), *m.buffers()])


def matmul_floor(model: torch.nn.Module, repeats: int, rows: int = 1) -> Timing:
    """One decode step's matrix products alone for `rows` sequences, back to back: the lower bound of a step with
    these kernels."""
    dtype = model.dtype  # the blocks' dtype (the embedding may be codes)
    layers = projections(model, rows)
    shapes = [(m.in_features, getattr(m, "compute_dtype", dtype)) for m in layers]  # inputs as each kernel takes them
    inputs = {shape: torch.randn(rows, shape[0], dtype=shape[1]) for shape in shapes}
    calls = [(m, inputs[shape]) for m, shape in zip(layers, shapes)]

    @torch.inference_mode()
    def products():
        for m, x in calls:
            m(x)

    return timed(products, 5 if repeats == 1 else repeats * 5, warmup=2)


def context_independence(model, repeats: int) -> dict:
    """Decode step time at context 128 whether the cache holds 512 or 8192 positions per slot."""
    timings = {}
    for capacity in (512, 8192):
        engine = Engine(model, None, EngineConfig(max_batch_size=1, max_seq_len=capacity, device="cpu"))
        request = engine.add_request(list(range(10, 138)), SamplingParams(max_new_tokens=capacity - 200, temperature=0,
                                                                            ignore_eos=True))
        engine.step()  # prefill: 128 positions held
        timings[capacity] = timed(engine.step, 3 if repeats == 1 else repeats * 5, warmup=1).median * 1e3
        engine.abort(request.request_id)
    return {"ms_512": timings[512], "ms_8192": timings[8192], "ratio": timings[8192] / timings[512]}
