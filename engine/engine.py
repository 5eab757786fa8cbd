"""The engine: continuous batching of requests over a fixed set of KV-cache slots."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Callable, Iterator, Sequence

import torch

from engine.batch import PrefillBatch
from engine.drafts import NGRAM_SIZES, SPECULATIVE_MODES, MatchBudgets, NgramIndex, StepCosts, SuffixCorpus
from engine.executor import COMPILE_MODES, DecodeExecutor, compile_unsupported
from engine.grammar import Grammars, allowed_from, allowed_tokens, bitmasks_along, short
from engine.kv_cache import KVCache, format_bytes, parse_bytes
from engine.linear.planner import QUANTIZE_MODES, summary
from engine.linear.quantized import WeightOnlyLinear
from engine.models.model import Transformer, weights_bytes
from engine.request import Draft, FinishReason, Request, RequestFailed, Status, TokenEvent
from engine.rope import RotaryTable
from engine.sampler import Choice, score, select_tokens
from engine.sampling import InvalidParameter, SamplingParams
from engine.scheduler import Scheduler, SlotState
from engine.tokenizer import IncrementalDetokenizer, Tokenizer

MAX_SPECULATIVE_TOKENS = 16  # drafts verified per request and step, at most
SCORE_ROWS = 256  # prompt positions per LM-head pass when scoring a prompt: 256 x V float32 logits at a time

log = logging.getLogger("kvserve.engine")


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 8  # KV-cache slots: sequences decoded together
    max_seq_len: int | None = None  # positions per slot; None = min(model's context, 2048)
    kv_cache_memory: str | int | None = None  # size the slots from a budget instead ("1GiB")
    device: str = "auto"
    dtype: str = "auto"
    prefill_chunk_size: int = 512  # prompt tokens per forward pass; bounds prefill memory
    seed: int | None = None  # seeds the seeds of requests that bring none
    # How weights.load_engine builds the model (engine/linear/planner.py), then the engine runs it as built.
    # Weight-only quantized products (CPU, bfloat16 activations). auto: a GGUF's quantized matrices served as
    # stored when dtype is auto or bfloat16, else dense; none: dense; int4, int8: float weights quantized at load.
    quantize: str = "auto"
    # Quantized layers on the CPU also keep a dense bfloat16 copy, run from the row count where it was measured
    # faster (prefill, large batches): faster for the memory of the copies (four times int4 codes).
    dense_copies: bool = False
    # Engine.compile(), where it can run: "auto" and "aot" load the CPU's steps compiled ahead of time (built first where
    # absent), "on" compiles them with torch.compile in this process; on CUDA all three capture CUDA graphs.
    compile: str = "off"
    prefix_caching: bool = True  # a new request reuses the K/V a free slot kept of a shared prompt prefix
    # Sliding-window layers (Gemma 3) keep T positions, as global ones do, instead of a ring of their window:
    # more memory, and any shared prefix reusable (llama.cpp's --swa-full).
    full_windows: bool = False
    # Speculative decoding (engine/drafts.py): a decode step also runs up to num_speculative_tokens guessed tokens
    # per request through the model and keeps those the sampler would have produced there: more tokens per step
    # where the text can be guessed, and never a different output. off | ngram (the request's own prompt and
    # output) | suffix (recently finished requests' outputs) | auto (both); a grammar's forced tokens are drafted
    # whenever it is not off.
    speculative: str = "off"
    num_speculative_tokens: int = 4  # at most; fewer where they do not pay (engine/drafts.py's MatchBudgets)
    suffix_tokens: int = 16384  # tokens of finished requests the suffix method drafts from, at most

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        if self.prefill_chunk_size < 1:
            raise ValueError(f"prefill_chunk_size must be >= 1, got {self.prefill_chunk_size}")
        if isinstance(self.kv_cache_memory, str):
            parse_bytes(self.kv_cache_memory)  # fails now, with the text, rather than at start
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}, got {self.compile!r}")
        if self.speculative not in SPECULATIVE_MODES:
            raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_MODES)}, got {self.speculative!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {self.num_speculative_tokens}")
        if self.suffix_tokens < 0:
            raise ValueError(f"suffix_tokens must be >= 0, got {self.suffix_tokens}")
        if self.quantize not in QUANTIZE_MODES:
            raise ValueError(f"quantize must be one of {', '.join(QUANTIZE_MODES)}, got {self.quantize!r}")
        if self.quantize in ("int4", "int8") and self.dtype not in ("auto", "bfloat16"):
            raise ValueError(f"quantize={self.quantize!r} computes in bfloat16 (torch's float32 weight-only kernels are "
                             f"slower than dense float32); use dtype 'bfloat16' or 'auto', not {self.dtype!r}")


@dataclass(frozen=True)
class Completion:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    logprobs: list[float]  # of each output token
    finish_reason: FinishReason
    seed: int
    top_logprobs: list[tuple[tuple[int, float], ...]]  # per output token: params.top_logprobs (id, logprob), best first
    prompt_logprobs: list[Choice] | None  # prompt tokens 1.. scored by their prefix, when params.prompt_logprobs
    reused_prompt_tokens: int  # leading prompt tokens whose K/V a slot kept from an earlier request


class Engine:
    def __init__(self, model: Transformer, tokenizer: Tokenizer | None, config: EngineConfig = EngineConfig()):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        model_config = model.config
        self.device, self.dtype = model.device, model.dtype
        max_seq_len = config.max_seq_len or min(model_config.max_position_embeddings, 2048)
        if max_seq_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_seq_len {max_seq_len} exceeds the model's max_position_embeddings "
                f"{model_config.max_position_embeddings}"
            )
        # Speculative decoding verifies a request's drafts as rows of its slot at the positions after its newest
        # token: a ring (a sliding layer that keeps only its window) then holds K more entries than its window.
        drafts = config.num_speculative_tokens if self.speculative != "off" else 0
        slots = self._slots(model_config, max_seq_len, drafts)
        self.cache = KVCache(model_config, slots, max_seq_len, self.device, self.dtype, config.full_windows, drafts)
        self.rotary = RotaryTable(model_config, max_seq_len, self.device, self.dtype)
        self.scheduler = Scheduler(slots, config.prefix_caching, copy_min_tokens=config.prefill_chunk_size,
                                   ring=self.cache.ring_window)
        self.executor = DecodeExecutor(model, self.rotary, self.cache, rows=slots * (1 + drafts))
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._seeds = torch.Generator().manual_seed(config.seed if config.seed is not None else torch.seed())
        self._grammars: Grammars | None = None
        self._grammars_made = threading.Lock()
        self.draft_totals = (0, 0)  # draft tokens verified, and kept, since the engine started
        self.step_costs = StepCosts()  # what a decode row costs here: how many drafts pay (DraftBudget)
        self.corpus = SuffixCorpus(config.suffix_tokens) if self.speculative in ("suffix", "auto") else None
        for entry in summary(list(model.plan)):  # which layer serves each product, decided as the model was built
            log.info("linear %s (x%d): %s, %s", entry["matrices"], entry["count"], entry["layer"], entry["reason"])
        log.info("weights: %s", model.pages.describe())
        log.info(self.cache.describe())

    def _slots(self, model_config, max_seq_len: int, lookahead: int) -> int:
        if self.config.kv_cache_memory is None:
            return self.config.max_batch_size
        budget = self.config.kv_cache_memory
        budget = parse_bytes(budget) if isinstance(budget, str) else budget
        slots = KVCache.slots_for_budget(model_config, max_seq_len, budget, self.dtype, self.config.full_windows,
                                         lookahead)
        if slots < 1:
            raise ValueError(
                f"kv_cache_memory {format_bytes(budget)} holds no sequence of {max_seq_len} tokens; "
                "raise it or lower max_seq_len"
            )
        return slots

    # ---- the public API --------------------------------------------------------------------

    @property
    def weights_bytes(self) -> int:
        """The model's parameters and buffers as held in memory (quantized ones as packed codes and scales)."""
        return weights_bytes(self.model)

    @property
    def tensor_parallel_size(self) -> int:
        """Ranks the model is split over; this engine holds one of them (its cache: h_kv/N heads)."""
        return 1

    @property
    def quantized(self) -> bool:
        """Whether any product runs on quantized weights."""
        return any(isinstance(m, WeightOnlyLinear) for m in self.model.modules())

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The tokenizer's end-of-sequence ids (none without a tokenizer)."""
        return self.tokenizer.eos_token_ids if self.tokenizer else ()

    @property
    def max_seq_len(self) -> int:
        """The one context length: positions per cache slot."""
        return self.cache.max_seq_len

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams = SamplingParams(),
                    request_id: str | None = None) -> Request:
        prompt_ids = self._prompt_ids(prompt)
        self.check_fits(len(prompt_ids), params.max_new_tokens)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidParameter(f"request id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, (), generator=self._seeds))
        request = Request(
            request_id=request_id,
            prompt_ids=prompt_ids,
            params=params,
            seed=seed,
            detokenizer=IncrementalDetokenizer(self.tokenizer) if self.tokenizer else None,
            grammar=self.grammars.start(params.grammar) if params.grammar else None,
        )
        self.requests[request_id] = request
        self.scheduler.enqueue(request)
        return request

    @property
    def grammars(self) -> Grammars:
        """Grammars compiled for this model's tokenizer (any thread may compile): made on first use, since
        reading a large vocabulary into llguidance takes about a second."""
        with self._grammars_made:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise InvalidParameter("a grammar needs the model's tokenizer, and this engine has none")
                self._grammars = Grammars(self.tokenizer.backend.to_str(), self.model.config.vocab_size,
                                          self.tokenizer.eos_token_ids)
            return self._grammars

    @property
    def compile_blocker(self) -> str | None:
        """Why Engine.compile would not compile (the config says off, or this machine cannot), else None."""
        if self.config.compile == "off":
            return "compile is off"
        return compile_unsupported(self.device)

    @property
    def compile_generates_code(self) -> bool:
        """Whether compile() generates code (the CPU: inductor, minutes on a large model), rather than having the
        steps captured as CUDA graphs while they run."""
        return self.executor.compiles_code

    def compile(self) -> bool:
        """Compile the decode step (the CPU, blocking: seconds to minutes; decoding goes on eagerly meanwhile if
        another thread steps), or from the next step on capture it as CUDA graphs (CUDA), unless something blocks
        it. True if compiled or captured."""
        reason = self.compile_blocker
        if reason:
            log.info("decode stays eager: %s", reason)
            return False
        if not self.executor.compiles_code:
            self.executor.capture()
        elif self.config.compile in ("auto", "aot") and self.model.embedding_scale is None:
            self.executor.load_packages()
        else:
            if self.config.compile != "on":  # Gemma's graph break (Transformer.forward) has no place in one program
                log.info("decode steps compiled by torch.compile, not ahead of time: a scaled embedding breaks "
                         "the step in two")
            self.executor.compile()
        return True

    def check_prompt_ids(self, prompt_ids: Sequence[int]) -> None:
        """A prompt is at least one token id, each in the model's vocabulary."""
        if not prompt_ids:
            raise InvalidParameter("the prompt is empty")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise InvalidParameter(f"prompt token ids must be in [0, {vocab})")

    def check_fits(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """A request must fit in one slot: prompt + generated tokens <= max_seq_len."""
        if prompt_tokens + max_new_tokens > self.max_seq_len:
            raise InvalidParameter(
                f"prompt ({prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) = "
                f"{prompt_tokens + max_new_tokens} exceeds the context length max_seq_len = {self.max_seq_len}"
            )

    def close(self) -> None:
        """Release what the engine holds beyond its memory; nothing here (a tensor-parallel leader stops its
        workers)."""

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its slot is free for the next step. False if it had already finished."""
        request = self.requests.get(request_id)
        if request is None or request.finished:
            return False
        self._finish(request, FinishReason.ABORT)
        return True

    def forget_replies(self) -> None:
        """Empty the suffix index of finished requests' replies, so that a request sent again is drafted from its own
        history alone, as a new one is (a benchmark's repeated runs)."""
        if self.corpus is not None:
            self.corpus = SuffixCorpus(self.corpus.max_tokens)

    @torch.inference_mode()
    def step(self) -> list[TokenEvent | RequestFailed]:
        """One unit of work: admit waiting requests, write the next chunks of the prompts not yet written (at
        most `prefill_chunk_size` tokens, a pass each: _prefill), then one decode step for the requests past theirs.

        A long prompt is written over several steps, so running requests keep getting tokens meanwhile.
        Every request past its prefill gets one new token per step (more where speculation verified drafts),
        or fails alone (RequestFailed).
        """
        decoding = [r for r in self.scheduler.decoding() if r.output_ids]
        for request in self.scheduler.admit():
            if request.copy_from is not None:  # a prefix a running request holds: copied, not computed
                self.cache.copy_prefix(request.copy_from, request.slot, request.reused_tokens)
        events = self._prefill([r for r in self.scheduler.running.values() if not r.output_ids])  # oldest first
        if decoding:
            events += self._decode_step(decoding)
        return events

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] = SamplingParams()) -> list[Completion]:
        """Offline generation: every prompt to completion, batched over the slots."""
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        requests = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        events: dict[str, list[TokenEvent]] = {r.request_id: [] for r in requests}
        while any(not r.finished for r in requests):
            for event in self.step():
                if isinstance(event, RequestFailed):
                    raise RuntimeError(f"request {event.request_id} failed: {event.message}")
                events[event.request_id].append(event)
        return [self._completion(r, events[r.request_id]) for r in requests]

    @torch.inference_mode()
    def prompt_logits(self, prompt: str | Sequence[int], last_only: bool = False) -> torch.Tensor:
        """Logits (n, V) float32 at every position of one prompt (or (1, V) for the last), through the prefill path."""
        prompt_ids = self._prompt_ids(prompt)
        if len(prompt_ids) > self.max_seq_len:
            raise InvalidParameter(f"prompt of {len(prompt_ids)} tokens exceeds max_seq_len {self.max_seq_len}")
        if not self.scheduler.free_slots:
            raise RuntimeError("prompt_logits needs a free cache slot")
        chunks = list(self._forward_prompt(prompt_ids, self.scheduler.borrow()))
        hidden = chunks[-1][:, -1:] if last_only else torch.cat(chunks, dim=1)
        return self.model.logits(hidden)[0]

    # ---- the state the server reports: a narrow, read-only view (no cache, requests or scheduler handed out) ----

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def cache_used_bytes(self) -> int:
        """Cache bytes holding the tokens of running requests."""
        return sum(self.cache.used_bytes(r.cached_tokens) for r in self.scheduler.running.values())

    @property
    def cache_kept_bytes(self) -> int:
        """Cache bytes that free slots keep for reuse by later requests sharing their prefix."""
        return sum(self.cache.used_bytes(n) for n in self.scheduler.kept_lengths)

    @property
    def compiled_graphs(self) -> tuple[str, ...]:
        """Decode batch buckets that run as compiled graphs, by the batch sizes they serve ("1", "2+"; the rest run
        eagerly), or on CUDA the captured graphs ("b4·k512")."""
        return self.executor.graph_names

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def slots(self) -> int:
        """Sequences decoded side by side: the KV cache's slots."""
        return self.cache.slots

    @property
    def request_ids(self) -> tuple[str, ...]:
        """The requests in flight, running or waiting for a slot."""
        return tuple(self.requests)

    def waits(self, request_id: str) -> bool | None:
        """Whether a request in flight still waits for a slot; None once it has finished (or was never added)."""
        request = self.requests.get(request_id)
        return None if request is None else request.status is Status.WAITING

    def slot_states(self) -> tuple[SlotState, ...]:
        """Every slot as it stands: free (keeping tokens for reuse), in prefill or in decode, and whose."""
        return tuple(self.scheduler.slot_states())

    @property
    def cache_capacity_bytes(self) -> int:
        return self.cache.capacity_bytes

    def cache_terms(self) -> dict:
        """The KV cache's size and its formula's terms (KVCache.terms)."""
        return self.cache.terms()

    @property
    def model_config(self):
        """The model's architecture (a frozen ModelConfig)."""
        return self.model.config

    @property
    def speculative(self) -> str:
        """The speculative decoding method: the config's (every cache verifies drafts, rings with their lookahead)."""
        return self.config.speculative

    @property
    def speculation(self) -> dict:
        """What speculative decoding does here: the method, the drafts
        per step at most, the drafts verified and kept so far, and the fit of a step's cost in its rows."""
        line = self.step_costs.line()
        return {"method": self.speculative, "requested": self.config.speculative,
                "num_speculative_tokens": self.config.num_speculative_tokens if self.speculative != "off" else 0,
                "suffix_tokens": self.corpus.tokens if self.corpus is not None else 0,
                "draft_tokens": self.draft_totals[0], "accepted_tokens": self.draft_totals[1],
                "step_seconds": None if line is None else {"fixed": line[0], "per_row": line[1]}}

    @property
    def plan(self) -> tuple:
        """Which layer serves each linear product and why (engine/linear/planner.py), decided as the model was built."""
        return tuple(self.model.plan)

    # ---- the work ---------------------------------------------------------------------------

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidParameter("this engine has no tokenizer; pass token ids")
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = [int(t) for t in prompt]
        self.check_prompt_ids(prompt_ids)
        return prompt_ids

    def _forward_prompt(self, prompt_ids: list[int], slot: int) -> Iterator[torch.Tensor]:
        """One sequence's prompt into `slot`, chunk by chunk; yields each chunk's hidden states (1, n, hidden)."""
        tokens = torch.tensor(prompt_ids, device=self.device)
        for start in range(0, len(tokens), self.config.prefill_chunk_size):
            length = min(self.config.prefill_chunk_size, len(tokens) - start)
            batch = PrefillBatch([slot], [start], [length], self.device)
            yield self.model(tokens[None, start:start + length], self.rotary, self.cache, batch)

    def _isolated(self, run: Callable[[list[Request]], list[list[Choice]]],
                  requests: list[Request]) -> list[TokenEvent | RequestFailed]:
        """run(requests) -> each one's next tokens, in order (none: not yet); if it raises, each request again
        alone, so one request's failure ends only that request.

        Running a pass again is safe: it rewrites the same cache positions with the same values, and
        tokens are appended only once the whole pass has sampled.
        """
        try:
            choices = run(requests)
        except Exception as e:
            if len(requests) > 1:
                return [event for r in requests for event in self._isolated(run, [r])]
            log.exception("request %s failed", requests[0].request_id)
            return [self._fail(requests[0], f"generation failed: {type(e).__name__}: {e}")]
        events = []
        for request, chosen in zip(requests, choices):
            for choice in chosen:  # until one ends the request (EOS, a stop string, the grammar)
                events.append(self._append(request, choice))
                if request.finished:
                    break
        return events

    def _fail(self, request: Request, message: str, by_grammar: bool = False) -> RequestFailed:
        self._finish(request, FinishReason.ERROR)
        return RequestFailed(request.request_id, message, by_grammar)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        """The request ends: its slot (or queue place) is free for the next step, keeping the tokens it wrote
        (none if its pass failed: then what the cache holds is unknown)."""
        request.finish_reason = reason
        written = (request.prompt_ids + request.output_ids)[: request.cached_tokens]
        self.scheduler.release(request, keep=written if reason is not FinishReason.ERROR else [])
        self.requests.pop(request.request_id, None)
        if self.corpus is not None and reason is not FinishReason.ERROR:  # the prompt's end leads into the output
            self.corpus.add(request.prompt_ids[-max(NGRAM_SIZES):] + request.output_ids)

    def _prefill(self, requests: list[Request]) -> list[TokenEvent | RequestFailed]:
        """The next prompt chunk of some of `requests` (oldest first), each in a forward pass of its own: the
        oldest always gets a chunk, later ones join while the step's chunks stay within `prefill_chunk_size`
        tokens in all. Each chunk starts where its slot's prompt positions end (`prefilled`: after a reused
        prefix, or after the chunks of earlier steps), and is min(prompt left, prefill_chunk_size) long.

        A pass of its own, because a prompt's bits must not depend on what else is prefilled beside it: in a
        shared pass a shorter prompt's rows are padded to the longest one (its attention reads over the longer
        row's key length, in another order) and the pass's row count chooses the products' form. A near tie that
        flips with its neighbours would make what a request gets depend on what else arrived, and speculative
        decoding, which changes when requests end and others are admitted, would change it.
        """
        limit = self.config.prefill_chunk_size
        pieces: dict[str, int] = {}  # request id -> prompt tokens its pass writes
        for request in requests:
            n = min(request.prompt_left, limit)
            if not pieces or sum(pieces.values()) + n <= limit:
                pieces[request.request_id] = n
        chosen = [r for r in requests if r.request_id in pieces]
        return [event for r in chosen for event in self._isolated(lambda one: self._prefill_pass(one, pieces), [r])]

    def _prefill_pass(self, requests: list[Request], pieces: dict[str, int]) -> list[Choice | None]:
        """Write pieces[id] more prompt tokens of each request; the ones whose prompt is then complete sample
        their first token (the others get None). Request state changes only once the whole pass succeeded."""
        starts, lengths = [r.prefilled for r in requests], [pieces[r.request_id] for r in requests]
        batch = PrefillBatch([r.slot for r in requests], starts, lengths, self.device)
        tokens = torch.zeros(len(requests), max(lengths), dtype=torch.long, device=self.device)  # right-padded
        for row, (request, start, n) in enumerate(zip(requests, starts, lengths)):
            tokens[row, :n] = torch.tensor(request.prompt_ids[start:start + n], device=self.device)
        hidden = self.model(tokens, self.rotary, self.cache, batch)  # (n, width, hidden)
        scores = {}
        for row, (request, start, n) in enumerate(zip(requests, starts, lengths)):
            if request.params.prompt_logprobs:  # never reused: position i scores prompt token i + 1
                targets = request.prompt_ids[start + 1: start + 1 + n]
                scores[row] = self._score_prompt(hidden[row, : len(targets)], targets, request.params.top_logprobs)
        done = [row for row, (request, start, n) in enumerate(zip(requests, starts, lengths))
                if start + n == len(request.prompt_ids)]
        choices = {}
        if done:
            rows, offsets = batch.last_index()
            logits = self.model.logits(hidden[rows[done], offsets[done]])  # (done, V): each last prompt position
            choices = dict(zip(done, self._select(logits, [requests[row] for row in done])))
        for row, (request, n) in enumerate(zip(requests, lengths)):
            request.prefilled += n
            if row in scores:
                request.prompt_logprobs = (request.prompt_logprobs or []) + scores[row]
        return [[choices[row]] if row in choices else [] for row in range(len(requests))]

    def _score_prompt(self, hidden: torch.Tensor, targets: list[int], top_n: int) -> list[Choice]:
        """hidden (m, hidden) of prompt positions -> the log-probability of each next prompt token in `targets`.

        The LM head runs over a few hundred positions at a time: (m, V) float32 logits of a long
        prompt would be gigabytes.
        """
        scores: list[Choice] = []
        for i in range(0, len(targets), SCORE_ROWS):
            logits = self.model.logits(hidden[i: i + SCORE_ROWS])  # (rows, V)
            rows = torch.tensor(targets[i: i + SCORE_ROWS], device=self.device)
            scores += score(logits, rows, [top_n] * len(rows))
        return scores

    def _decode_step(self, requests: list[Request]) -> list[TokenEvent | RequestFailed]:
        """One new token for each request, or, where speculation drafted some, one to k + 1 (verified in one pass
        with the rows that have none). Without drafts this step runs as compiled (or captured)."""
        if self.speculative == "off":
            return self._isolated(self._decode, requests)
        drafts = self._drafts(requests)
        started = time.perf_counter()
        if not drafts:
            events = self._isolated(self._decode, requests)
        else:
            events = self._isolated(lambda group: self._verify(group, [drafts.get(r.request_id, ("", []))[1]
                                                                       for r in group]), requests)
        rows = len(requests) + sum(len(tokens) for _, tokens in drafts.values())
        self.step_costs.observe(rows, time.perf_counter() - started)
        return self._report_drafts(events, {r.request_id: r for r in requests}, drafts)

    def _drafts(self, requests: list[Request]) -> dict[str, tuple[str, list[int]]]:
        """Each request's (method, draft tokens), for those with any: how many pay follows this process's own
        timings (StepCosts), so under tensor parallelism rank 0 decides them and the other ranks take its."""
        threshold = self.step_costs.threshold(len(requests))
        drafts = {r.request_id: d for r in requests if (d := self._draft(r, threshold)) is not None}
        # Every request's first K drafts fit the step's rows (the slots' 1 + K each); forced tokens past K take
        # the rows left, first come first served.
        k = self.config.num_speculative_tokens
        spare = self.executor.rows - len(requests) - sum(min(len(tokens), k) for _, tokens in drafts.values())
        for request_id, (method, tokens) in drafts.items():
            extra = min(max(len(tokens) - k, 0), spare)
            drafts[request_id] = (method, tokens[:min(len(tokens), k) + extra])
            spare -= extra
        return drafts

    @property
    def forced_limit(self) -> int:
        """A grammar's forced tokens one step verifies for a request, at most. They nearly always pass, so a whole
        forced run (a JSON key with its quotes and colon, a tool call's envelope) takes one step rather than one per
        K: up to MAX_SPECULATIVE_TOKENS, or K where a ring holds only K positions past its window (and past K, only
        the step's spare rows: _drafts)."""
        return self.config.num_speculative_tokens if self.cache.ring_window is not None else MAX_SPECULATIVE_TOKENS

    def _report_drafts(self, events: list[TokenEvent | RequestFailed], requests: dict[str, Request],
                       drafts: dict[str, tuple[str, list[int]]]) -> list[TokenEvent | RequestFailed]:
        """Each drafted request's first event of the step gains its Draft (proposed, and kept: the leading tokens
        it emitted that were its drafts); its budget learns from it."""
        emitted: dict[str, list[int]] = {}
        for event in events:
            if isinstance(event, TokenEvent):
                emitted.setdefault(event.request_id, []).append(event.token_id)
        reported = set()
        for i, event in enumerate(events):
            request_id = event.request_id
            if request_id not in drafts or request_id in reported or not isinstance(event, TokenEvent):
                continue
            reported.add(request_id)
            method, proposed = drafts[request_id]
            tokens = emitted[request_id]
            accepted = next((j for j, (a, b) in enumerate(zip(tokens, proposed)) if a != b),
                            min(len(tokens), len(proposed)))
            budget = requests[request_id].budget  # forced tokens say nothing of how guessable the text is
            if method != "grammar" and budget is not None:
                budget.update(len(proposed), accepted)
            events[i] = replace(event, draft=Draft(method, len(proposed), accepted))
            self.draft_totals = (self.draft_totals[0] + len(proposed), self.draft_totals[1] + accepted)
        return events

    def _decode(self, requests: list[Request]) -> list[list[Choice]]:
        logits = self.executor.forward([r.output_ids[-1] for r in requests], [r.slot for r in requests],
                                       [r.cached_tokens for r in requests])  # (b, V)
        return [[choice] for choice in self._select(logits, requests)]

    def _draft(self, request: Request, threshold: float) -> tuple[str, list[int]] | None:
        """(method, tokens) guessed to follow the request's newest token, or None: its grammar's forced tokens,
        else a match of its newest n-gram in its own tokens (ngram) or in recently finished requests (suffix),
        the longer match where both are on (auto). At most what the request may still emit, less one: the
        verification adds the sampler's own token after them; forced tokens up to forced_limit, n-gram drafts up to
        K, as many as pay at the request's rate of right drafts after matches of that length (MatchBudgets, against
        `threshold`, StepCosts')."""
        room = min(request.params.max_new_tokens - len(request.output_ids) - 1, self.max_seq_len - request.num_tokens)
        if room <= 0:
            return None
        if request.grammar is not None and not (request.grammar.is_stopped() or request.grammar.is_error()):
            forced = self.grammars.forced(request.grammar)[:min(room, self.forced_limit)]
            if forced:
                return "grammar", forced
        room = min(room, self.config.num_speculative_tokens)
        if request.budget is None:
            request.budget = MatchBudgets(self.config.num_speculative_tokens)
            request.ngrams = NgramIndex()
            request.ngrams.extend(request.prompt_ids)
        index = request.ngrams
        index.extend(request.output_ids[len(index.tokens) - len(request.prompt_ids):])
        own = index.propose(room) if self.speculative in ("ngram", "auto") else (0, [])
        shared = self.corpus.propose(index.tokens, room) if self.corpus is not None else (0, [])
        if own[1] and own[0] >= shared[0]:
            method, (n, tokens) = "ngram", own
        elif shared[1]:
            method, n, tokens = "suffix", *shared
        else:
            return None
        k = request.budget.allowed(method, n, threshold)
        return (method, tokens[:k]) if k else None

    def _verify(self, requests: list[Request], drafts: list[list[int]]) -> list[list[Choice]]:
        """One decode forward over each request's newest token and its drafts, a row per position (k + 1 rows of
        its slot at consecutive positions: each row's K/V is written before any row attends, so each reads the
        drafts before it), then the plain sampler's token at every position, as if the drafts before it were kept
        (its output and grammar past them: Position), all in one pass. Walking them, a request keeps its drafts up
        to the first that is not the sampler's token there, and that token too; so it gets exactly the tokens
        plain decoding gives it; a request without drafts gets one token, as in _decode.

        Rows rather than a prompt-like pass over k + 1 positions: the same kernels at the same shapes per row as
        a decode step, so a verified token's logits are a decoded token's, not a prefill's (which differ in the
        last bits, enough to flip a near tie). The K/V of rejected drafts stay past the request's length, unread,
        until overwritten. The request itself does not change (its grammar ends where it began), so a failed pass
        can run again.
        """
        rows = [[r.output_ids[-1], *d] for r, d in zip(requests, drafts)]
        lengths = [len(row) for row in rows]
        logits = self.executor.forward([t for row in rows for t in row],
                                       [r.slot for r, n in zip(requests, lengths) for _ in range(n)],
                                       [r.cached_tokens + j for r, n in zip(requests, lengths) for j in range(n)])
        positions, masks, passable = [], [], []
        for request, tokens in zip(requests, drafts):
            grammar = request.grammar
            along = bitmasks_along(grammar, tokens) if grammar is not None else [None] * (len(tokens) + 1)
            # Past draft j only if the request goes on after it: not its end (EOS), and its grammar took it.
            ends = next((j for j, token in enumerate(tokens) if request.params.ends_at(token, self.eos_token_ids)),
                        len(tokens))
            passable.append(min(ends, len(along) - 1))
            positions += [Position(request, tokens[:j]) for j in range(len(tokens) + 1)]
            masks += along + [None] * (len(tokens) + 1 - len(along))  # positions never reached: any token
        picks = select_tokens(logits, positions, allowed_from(masks, logits.shape[-1], logits.device))
        chosen: list[list[Choice]] = []
        start = 0
        for tokens, n, length in zip(drafts, passable, lengths):
            chosen.append([])
            for j, choice in enumerate(picks[start: start + length]):
                chosen[-1].append(choice)
                if j >= n or choice.token != tokens[j]:
                    break
            start += length
        return chosen

    def _select(self, logits: torch.Tensor, requests: list[Request]) -> list[Choice]:
        """Each request's next token from its logits row (b, V), within what its grammar allows."""
        allowed = allowed_tokens([r.grammar for r in requests], logits.shape[-1], logits.device)
        return select_tokens(logits, requests, allowed)

    def _append(self, request: Request, choice: Choice) -> TokenEvent | RequestFailed:
        token = choice.token
        grammar = request.grammar
        # The matcher fails only past one of its limits (a step's work, say), or where it allowed no token at all.
        if grammar is not None and (grammar.is_error() or not grammar.consume_token(token)):
            return self._fail(request, f"the grammar failed after {len(request.output_ids)} tokens: "
                                       f"{short(grammar.get_error()) or 'it allows no token here'}", by_grammar=True)
        request.output_ids.append(token)
        text = request.detokenizer.push(token) if request.detokenizer else ""
        reason, stop_string = self._finish_reason(request, token, text)
        if reason is not None:
            if request.detokenizer:
                text += request.detokenizer.flush()
            self._finish(request, reason)
        special = self.tokenizer is not None and token in self.tokenizer.special_ids
        first = len(request.output_ids) == 1
        prompt_logprobs = tuple(request.prompt_logprobs) if first and request.prompt_logprobs is not None else None
        return TokenEvent(request.request_id, len(request.output_ids) - 1, token, text, choice.logprob, special,
                          reason, stop_string, choice.top, prompt_logprobs, request.reused_tokens if first else None)

    def _finish_reason(self, request: Request, token: int, piece: str) -> tuple[FinishReason | None, str | None]:
        params = request.params
        if params.ends_at(token, self.eos_token_ids):
            return FinishReason.EOS, None
        if request.grammar is not None and request.grammar.is_stopped():  # complete: nothing may follow but EOS
            return FinishReason.EOS, None
        if params.stop and piece:
            # Only a stop string that ends inside the new piece can be new: earlier text was checked already.
            window = request.text[-(len(piece) + max(map(len, params.stop)) - 1):]
            for stop in params.stop:
                if stop in window:
                    return FinishReason.STOP, stop
        if len(request.output_ids) >= params.max_new_tokens or request.num_tokens >= self.max_seq_len:
            return FinishReason.LENGTH, None
        return None, None

    def _completion(self, request: Request, events: list[TokenEvent]) -> Completion:
        return Completion(request.request_id, request.prompt_ids, request.output_ids, request.text,
                          [e.logprob for e in events], request.finish_reason, request.seed,
                          [e.top_logprobs for e in events], request.prompt_logprobs, request.reused_tokens)


@dataclass(frozen=True)
class Position:
    """A request as the sampler sees it at a verified position (a SamplingState): its output so far plus the drafts
    before the position, as if they were kept (the seeded draw's step and the penalties' counts follow them). The
    output is joined only where the sampler reads it (a sampled or penalized request), not for every greedy row."""

    request: Request
    drafts: list[int]

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def seed(self) -> int:
        return self.request.seed

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt_ids

    @cached_property
    def output_ids(self) -> list[int]:
        return self.request.output_ids + self.drafts


__all__ = ["Completion", "Engine", "EngineConfig"]
