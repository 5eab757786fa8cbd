"""Speculative decoding: tokens per second with drafts verified vs without, on tasks whose output can and cannot be
guessed from their input, and whether the output stayed the same.

Two engines on the same model, side by side in one process: plain decoding and speculation on, a pair of runs
at a time with their steps interleaved (each side timing its own steps), so that both meet the same moments of a
shared machine; the speedup is the median of the pairs' ratios. Speculation must reproduce plain decoding's tokens
exactly (on a quantized model, compiled or not: every graph gives a row the eager step's bits). A single stream's
rate is its decode rate (the tokens after the first over the steps after it); the mixed streams' is their tokens
over the steps in which every stream has a request in the engine (each sends its next request as its last ends).
Each run starts with an empty suffix index: a repeated request is drafted from its own history, as a new one is
(the mixed streams' 48 requests of 4 prompts still draft from each other's replies within a run).
With --llama-bin, llama.cpp's llama-server runs the single-stream tasks on the same GGUF file, with its n-gram
speculation and without (its own decode rate, `timings.predicted_per_second`), as the reference.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Generator

import httpx
import torch

from bench.common import machine, machine_line, markdown_table, write_results
from bench.families import llama_server
from bench.structured import PERSON
from engine import Engine, EngineConfig, SamplingParams, Tokenizer
from engine.grammar import json_schema_grammar
from weights.loading import load_model

PASSAGE = ("The KV cache holds, for every sequence slot, every layer and every position, the keys and values of the "
           "attention heads, so that a decode step computes attention for one new token against everything before "
           "it without running the prompt again. Its size is two times the slots times the layers times the positions "
           "times the key-value heads times the head width, in the cache's element size. Grouped-query attention "
           "shares each key-value head among several query heads, which divides the cache by that ratio.")
MIXED = ("quote", "chat", "rename", "chat")  # the mixed streams' tasks, in turn
MIXED_ROUNDS = 3  # requests each mixed stream sends, one after another

# About 300 tokens of Python (engine/drafts.py's NgramIndex as it stood in session 36, cut mid-method as the
# task has always been): what the rename task rewrites. Kept here, so that editing that file leaves the task be.
SNIPPET = '''@dataclass
class NgramIndex:
    """For every n-gram (n in NGRAM_SIZES) of a token list, where it last ended, kept as the list grows.

    `propose` looks up the n-gram that ends at the newest token among those that ended earlier: each position
    is indexed once the next token exists, so the newest n-gram never matches itself, and a match's
    continuation always has at least one token.
    """

    tokens: list[int] = field(default_factory=list)
    ends: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> index of its last token, latest

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            end = len(self.tokens) - 1  # the previous newest token now has a successor
            self.ends.update((key, end) for key in ngrams_ending(self.tokens, end))
            self.tokens.append(token)

    def match(self) -> tuple[int, int] | None:
        """(n, end of the earlier occurrence) of the longest n-gram ending at the newest token seen before."""
        for n in NGRAM_SIZES:
            if len(self.tokens) > n:
                end'''


def tasks() -> dict[str, tuple[str, dict]]:
    """name -> (the user's message, SamplingParams overrides)."""
    return {
        "rename": ("Rewrite this Python code with the attribute `tokens` renamed to `ids`. Reply with the code only."
                   f"\n\n```python\n{SNIPPET}\n```", {}),
        "quote": (f"Repeat the following paragraph exactly, word for word:\n\n{PASSAGE}", {}),
        "json": ("Invent a person and describe them as a JSON object with name, age, occupation, hobbies and address.",
                 {"grammar": json_schema_grammar(PERSON), "temperature": 0.7, "seed": 1}),
        "chat": ("Write a short story about a lighthouse keeper who finds a message in a bottle.", {}),
    }


def run(args: argparse.Namespace) -> dict:
    from weights.resolve import resolve_model

    streams = 4 if args.quick else args.streams
    max_tokens = 32 if args.quick else args.max_tokens
    path = resolve_model(args.model)

    def config(speculative: str) -> EngineConfig:
        return EngineConfig(device="cpu", dtype=args.dtype, max_batch_size=streams, max_seq_len=2048,
                            prefix_caching=False, compile=args.compile, seed=0, speculative=speculative,
                            num_speculative_tokens=args.num_speculative_tokens)

    # One model under both engines: the same weights in the same pages, so that neither side's placement in memory
    # (huge pages or not, which lines share a cache set) is what the ratio measures.
    model, tokenizer = load_model(path, config("off")), Tokenizer.from_dir(path)
    plain, fast = Engine(model, tokenizer, config("off")), Engine(model, tokenizer, config(args.speculative))
    for made in (plain, fast):
        made.compile()
    chosen = tasks()
    chat = plain.tokenizer.chat_template is not None  # a base model (gemma-3-270m) continues the text itself
    prompts = {name: plain.tokenizer.encode_chat([{"role": "user", "content": text}], parse_special=False) if chat
               else plain.tokenizer.encode(text) for name, (text, _) in chosen.items()}

    def params(name: str) -> SamplingParams:
        return SamplingParams(**({"max_new_tokens": max_tokens, "temperature": 0} | chosen[name][1]))

    def paired(measure, load) -> tuple[list[float], list[float], bool, list[list[int]], tuple[int, int]]:
        """Runs of the load without and with speculation, their steps interleaved: (plain rates, speculative rates,
        whether every speculative run's tokens were the plain runs', the tokens, the speculative runs' draft tokens
        verified and kept). Each side's rate counts its own steps' time only, so both meet the same stretches of a
        shared machine, whose speed moves by tens of percent within seconds; the speedup is the median of the
        pairs' ratios. Every other pair steps the speculative engine first."""
        plain_rates, rates, same, ids, drafts = [], [], True, None, (0, 0)
        for pair in range(1 if args.quick else args.repeats):
            fast.forget_replies()  # else `auto` drafts a repeated request from its own earlier reply
            order = (fast, plain) if pair % 2 else (plain, fast)
            results = interleaved([(engine, lambda engine=engine: measure(engine, load)) for engine in order])
            (plain_rate, ids, _), (rate, got, verified) = results[::-1] if pair % 2 else results
            plain_rates.append(plain_rate)
            rates.append(rate)
            same = same and got == ids
            drafts = (drafts[0] + verified[0], drafts[1] + verified[1])
        return plain_rates, rates, same, ids, drafts

    warm = [(prompts["chat"], SamplingParams(max_new_tokens=8, temperature=0))]
    paired(decoding, warm)
    rows, results = [], {}
    # Stream s's i-th request is MIXED's task s + i (in turn, wrapping), one request after another.
    mixed = [[(prompts[MIXED[(s + i) % len(MIXED)]], params(MIXED[(s + i) % len(MIXED)])) for i in range(MIXED_ROUNDS)]
             for s in range(streams)]
    loads = {name: (decoding, [(prompts[name], params(name))]) for name in chosen} | {
        f"{streams} streams, mixed": (streaming, mixed)}
    for name, (measure, load) in loads.items():
        plain_rates, rates, same, ids, (drafted, kept) = paired(measure, load)
        plain_rate, rate = statistics.median(plain_rates), statistics.median(rates)
        ratios = [s / p for p, s in zip(plain_rates, rates)]
        speedup = statistics.median(ratios)
        results[name] = {"plain_tok_s": plain_rate, "speculative_tok_s": rate, "speedup": speedup,
                         "pairs": [[p, s] for p, s in zip(plain_rates, rates)],
                         "tokens": sum(map(len, ids)), "draft_tokens": drafted, "accepted_tokens": kept,
                         "identical": same}
        rows.append([name, f"{plain_rate:.1f}", f"{rate:.1f}", f"{speedup:.2f}x",
                     f"{min(ratios):.2f}-{max(ratios):.2f}x", f"{kept}/{drafted}", "yes" if same else "NO"])
    reference = {}
    if args.llama_bin:
        gguf = args.gguf or path / "model.gguf"
        threads = args.threads or torch.get_num_threads()
        for flags in ("none", "ngram-simple"):
            extra = () if flags == "none" else ("--spec-type", flags, "--spec-ngram-simple-size-n", "3",
                                                "--spec-ngram-simple-size-m", str(args.num_speculative_tokens))
            with llama_server(args.llama_bin / "llama-server", gguf, threads, extra=extra) as url:
                reference[flags] = {name: llama_rate(url, text, chosen[name][1], max_tokens,
                                                     1 if args.quick else args.repeats, chat)
                                    for name, (text, _) in chosen.items()}
        for name in chosen:
            theirs = reference["ngram-simple"][name]
            results[name]["llama_server_ngram_tok_s"] = theirs
            results[name]["vs_llama_server_ngram"] = results[name]["speculative_tok_s"] / theirs
            results[name]["llama_server_plain_tok_s"] = reference["none"][name]
            rows[list(chosen).index(name)] += [f"{theirs:.1f} ({theirs / reference['none'][name]:.2f}x)",
                                               f"{results[name]['vs_llama_server_ngram']:.2f}x"]
        for row in rows[len(chosen):]:
            row += ["-", "-"]
    payload = {"machine": machine(), "model": str(path), "speculative": fast.speculation, "streams": streams,
               "max_tokens": max_tokens, "results": results, "llama_server": reference}
    table = "\n".join([
        f"# Speculative decoding ({args.speculative}, up to {args.num_speculative_tokens} drafts a step) vs none "
        f"({'compiled' if fast.compiled_graphs else 'eager'} decode, greedy but json, median of "
        f"{1 if args.quick else args.repeats} pairs of runs, each without and with, their steps interleaved)", "",
        machine_line(payload["machine"]), "",
        markdown_table(["load", "plain tok/s", "speculative tok/s", "speedup (median of pairs)", "pairs",
                        "kept/drafted", "same tokens"]
                       + (["llama-server n-gram tok/s (vs its plain)", "kvserve / llama-server n-gram"]
                          if reference else []), rows), "",
        f"A decode step's cost fit in its rows (seconds): {fast.speculation['step_seconds']}.",
    ])
    write_results(args.out, "spec", payload, table)
    print(table)
    return payload


def interleaved(runs: list[tuple[Engine, Callable[[], Generator]]]) -> list:
    """(engine, start) pairs, start() a generator that steps that engine once per yield (decoding, streaming): each
    run stepped in turn until all have ended, and the value each returned, in order. A run that ends while others
    go on starts again (its figures dropped), so that every timed step of every run alternates with another
    run's: a step that follows another engine's finds its caches as the other left them, one that follows its
    own does not, and the side that ends first (speculation, on a task it guesses well) would otherwise have had
    every step follow another's and the other side not. The repeats are cancelled at the end."""
    going = [start() for _, start in runs]
    results, ended = [None] * len(runs), [False] * len(runs)
    while not all(ended):
        for i, (_, start) in enumerate(runs):
            try:
                next(going[i])
            except StopIteration as end:
                if not ended[i]:
                    results[i], ended[i] = end.value, True
                if not all(ended):
                    going[i] = start()
    for engine, _ in runs:
        for request_id in engine.request_ids:
            engine.abort(request_id)
        while engine.has_work:  # the cancelled requests leave their slots
            engine.step()
    return results


def decoded(engine, batch: list[tuple[list[int], SamplingParams]]) -> tuple[float, list[list[int]]]:
    """decoding's result, run alone."""
    return interleaved([(engine, lambda: decoding(engine, batch))])[0]


def counted(drafts: tuple[int, int], events: list) -> tuple[int, int]:
    """(draft tokens verified, kept) with those of a step's events added."""
    for event in events:
        if getattr(event, "draft", None) is not None:
            drafts = (drafts[0] + event.draft.proposed, drafts[1] + event.draft.accepted)
    return drafts


def decoding(engine, batch: list[tuple[list[int], SamplingParams]]):
    """Every request to its end through Engine.step, a step per yield: returns (tokens/s, each request's tokens,
    (draft tokens verified, kept)).
    One request: its decode rate, the tokens after its first over the steps after its first; several: all their
    tokens over all the steps. Only this engine's steps count: another's may run between them."""
    requests = [engine.add_request(prompt, params) for prompt, params in batch]
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    seconds, steps, drafts = 0.0, 0, (0, 0)
    while engine.has_work:
        started = time.perf_counter()
        events = engine.step()
        elapsed = time.perf_counter() - started
        if steps or len(batch) > 1:  # one request: its first step (the prompt and first token) does not count
            seconds += elapsed
        steps += 1
        for event in events:
            tokens[event.request_id].append(event.token_id)
        drafts = counted(drafts, events)
        yield
    ids = [tokens[r.request_id] for r in requests]
    return (sum(map(len, ids)) - (len(batch) == 1)) / seconds, ids, drafts


def streaming(engine, streams: list[list[tuple[list[int], SamplingParams]]]):
    """Streams that each send their requests one after another, the next as soon as the last ends, all through
    Engine.step, a step per yield: returns (tokens/s over the steps in which every stream had a request in the
    engine, each request's tokens, stream by stream, (draft tokens verified, kept)). Only those steps count: at a
    closed batch's end the streams that finished first leave their slots empty, and that end measures how the batch
    drains (speculation finishes the requests it guesses well first), not the rate at which the streams are served."""
    ids = [[[] for _ in sent] for sent in streams]
    running: dict[str, tuple[int, int]] = {}  # request id -> (stream, its request's index), while in the engine

    def send(stream: int, i: int) -> None:
        prompt, params = streams[stream][i]
        running[engine.add_request(prompt, params).request_id] = (stream, i)

    for stream in range(len(streams)):
        send(stream, 0)
    tokens, seconds, drafts = 0, 0.0, (0, 0)
    while engine.has_work:
        every_stream = len(running) == len(streams)
        started = time.perf_counter()
        events = engine.step()
        if every_stream:
            tokens, seconds = tokens + len(events), seconds + time.perf_counter() - started
        for event in events:
            stream, i = running[event.request_id]
            ids[stream][i].append(event.token_id)
            if event.finish_reason is not None:
                del running[event.request_id]
                if i + 1 < len(streams[stream]):
                    send(stream, i + 1)
        drafts = counted(drafts, events)
        yield
    return tokens / seconds, [request for sent in ids for request in sent], drafts


def llama_rate(url: str, text: str, overrides: dict, max_tokens: int, repeats: int, chat: bool) -> float:
    """llama-server's decode rate on one request (greedy, or as the task's overrides say), the median of runs: a
    chat request, or for a model without a chat template the text itself to continue (its /completion)."""
    body = {"max_tokens": max_tokens, "temperature": overrides.get("temperature", 0), "seed": overrides.get("seed", 0)}
    if chat:
        route, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": text}]
        if "grammar" in overrides:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    else:
        route, body["prompt"], body["n_predict"] = "/completion", text, max_tokens
        if "grammar" in overrides:
            body["json_schema"] = PERSON
    rates = []
    for _ in range(repeats + 1):  # the first warms it
        timings = httpx.post(f"{url}{route}", json=body, timeout=600).json()["timings"]
        rates.append(timings["predicted_per_second"])
    return statistics.median(rates[1:])
