"""Structured output: what a JSON-schema grammar costs per token, what compiling one costs, and how many outputs
follow the schema.

Cost per token: the same prompts and seeds decoded with the grammar and without it, each unconstrained
sequence running exactly as many tokens as its constrained twin (`ignore_eos`), so both runs have the same
batch shapes at every step; at batch 1 and at batch 16 (sixteen sequences decoded side by side).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jsonschema

from bench.common import machine, machine_line, markdown_table, write_results
from engine import EngineConfig, SamplingParams
from engine.grammar import json_schema_grammar
from weights.loading import load_engine

PERSON = {  # a typical response schema: nested object, enum, bounded array and integer, required fields
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "occupation": {"enum": ["engineer", "teacher", "doctor", "artist", "other"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                     "country": {"type": "string", "maxLength": 40}},
                    "required": ["city", "country"], "additionalProperties": False},
    },
    "required": ["name", "age", "occupation", "hobbies", "address"],
    "additionalProperties": False,
}
ASK = "Invent a person and describe them as a JSON object with name, age, occupation, hobbies and address."


def run(args: argparse.Namespace) -> dict:
    from weights.resolve import resolve_model

    batches = [1, 4] if args.quick else [1, 16]
    samples = 8 if args.quick else args.samples
    repeats = 1 if args.quick else args.repeats
    engine = load_engine(resolve_model(args.model), EngineConfig(
        device="cpu", dtype=args.dtype, max_batch_size=max(batches), max_seq_len=args.max_tokens + 256,
        prefix_caching=False, compile=args.compile, seed=0))
    engine.compile()
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": ASK}], parse_special=False)

    started = time.perf_counter()
    grammars = engine.grammars  # the tokenizer read into llguidance, once per engine
    tokenizer_s = time.perf_counter() - started
    grammar = json_schema_grammar(PERSON)
    started = time.perf_counter()
    grammars.compile(grammar)
    compile_s = time.perf_counter() - started
    hits = []
    for _ in range(100):
        started = time.perf_counter()
        grammars.compile(grammar)
        hits.append(time.perf_counter() - started)

    def timed_run(params: list[SamplingParams]) -> tuple[float, list]:
        started = time.perf_counter()
        completions = engine.generate([prompt] * len(params), params)
        return time.perf_counter() - started, completions

    rows, costs = [], {}
    for batch in batches:
        constrained = [SamplingParams(max_new_tokens=args.max_tokens, temperature=0.7, seed=i, grammar=grammar)
                       for i in range(batch)]
        timed_run(constrained)  # warm-up: graphs, allocator
        per_token = {"constrained": [], "free": []}
        for _ in range(repeats):
            seconds, done = timed_run(constrained)
            per_token["constrained"].append(seconds / sum(len(c.output_ids) for c in done))
            free = [SamplingParams(max_new_tokens=len(c.output_ids), temperature=0.7, seed=i, ignore_eos=True)
                    for i, c in enumerate(done)]
            seconds, twins = timed_run(free)
            per_token["free"].append(seconds / sum(len(c.output_ids) for c in twins))
        c, f = statistics.median(per_token["constrained"]), statistics.median(per_token["free"])
        costs[batch] = {"constrained_ms_per_token": c * 1e3, "free_ms_per_token": f * 1e3,
                        "overhead_pct": (c / f - 1) * 100}
        rows.append([batch, f"{f * 1e3:.2f}", f"{c * 1e3:.2f}", f"{(c / f - 1) * 100:+.1f}%"])

    valid, outputs = 0, []
    for first in range(0, samples, max(batches)):
        seeds = range(first, min(first + max(batches), samples))
        params = [SamplingParams(max_new_tokens=args.max_tokens, temperature=1.0, seed=100 + s, grammar=grammar)
                  for s in seeds]
        for completion in engine.generate([prompt] * len(params), params):
            try:
                jsonschema.validate(json.loads(completion.text), PERSON)
                valid += 1
            except (json.JSONDecodeError, jsonschema.ValidationError):
                pass
            outputs.append(completion.text)
    payload = {"machine": machine(), "compiled": bool(engine.compiled_graphs), "per_token": costs,
               "tokenizer_load_s": tokenizer_s, "grammar_compile_s": compile_s,
               "cache_hit_us_median": statistics.median(hits) * 1e6, "samples": samples, "valid": valid,
               "example": outputs[0] if outputs else None}
    table = "\n".join([
        f"# Structured output: a JSON-schema grammar vs none ({'compiled' if payload['compiled'] else 'eager'} decode, "
        f"temperature 0.7, median of {repeats} runs)", "", machine_line(payload["machine"]), "",
        markdown_table(["batch", "free ms/token", "with the grammar ms/token", "cost"], rows), "",
        f"The tokenizer read into llguidance: {tokenizer_s * 1e3:.0f} ms, once per engine. The schema compiled in "
        f"{compile_s * 1e3:.1f} ms; a compile of a grammar already kept: {payload['cache_hit_us_median']:.1f} us.",
        f"Sampled outputs (temperature 1.0) that parse and follow the schema: {valid} of {samples}.",
        f"An example: `{payload['example']}`",
    ])
    write_results(args.out, "structured", payload, table)
    print(table)
    return payload
