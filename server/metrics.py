"""Prometheus metrics, in a registry of their own (never the process-wide default).

Fed from request timestamps by the routes; gauges read the runner's last snapshot when scraped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from engine.request import Draft
    from server.runner import EngineRunner

# Buckets wide enough for a 2-core CPU (tens of ms per token) and a GPU (a few ms).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class Metrics:
    def __init__(self, runner: "EngineRunner"):
        self.registry = CollectorRegistry()
        r = self.registry
        self.time_to_first_token = Histogram(
            "kvserve_time_to_first_token_seconds", "Arrival to first generated token.", buckets=REQUEST_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            "kvserve_inter_token_latency_seconds", "Gap between consecutive tokens of a request.",
            buckets=LATENCY_BUCKETS, registry=r)
        self.request_duration = Histogram(
            "kvserve_request_duration_seconds", "Arrival to last token.", buckets=REQUEST_BUCKETS, registry=r)
        self.request_queue = Histogram(
            "kvserve_request_queue_seconds", "Arrival to getting a KV-cache slot.", buckets=REQUEST_BUCKETS, registry=r)
        self.engine_step = Histogram(
            "kvserve_engine_step_seconds", "One engine step: admissions, the next prompt chunks, one decode of every running "
            "request (a stall shows here as a step of seconds).", buckets=LATENCY_BUCKETS, registry=r)
        runner.step_observers.append(self.engine_step.observe)
        self.prompt_tokens = Counter("kvserve_prompt_tokens", "Prompt tokens of accepted requests.", registry=r)
        self.prefix_queried_tokens = Counter(
            "kvserve_prefix_cache_queried_tokens", "Prompt tokens of requests that reached their first token.", registry=r)
        self.prefix_hit_tokens = Counter(
            "kvserve_prefix_cache_hit_tokens", "Of those, tokens whose K/V a slot had kept (hit rate = hit / queried).",
            registry=r)
        self.generation_tokens = Counter("kvserve_generation_tokens", "Tokens sent to clients.", registry=r)
        self.requests = Counter("kvserve_requests", "Finished requests.", ["finish_reason"], registry=r)
        self.failures = Counter("kvserve_request_failures", "Requests refused or failed.", ["reason"], registry=r)
        self.draft_tokens = Counter("kvserve_spec_decode_draft_tokens", "Draft tokens speculative decoding verified.",
                                    ["method"], registry=r)
        self.accepted_tokens = Counter("kvserve_spec_decode_accepted_tokens",
                                       "Of those, the ones kept (what the sampler produced there anyway).", ["method"],
                                       registry=r)
        self.accepted_by_position = Counter(
            "kvserve_spec_decode_accepted_tokens_per_position", "Kept drafts by their place in a step's drafts (1: "
            "the first after the request's newest token).", ["position"], registry=r)
        gauges = {
            "kvserve_requests_running": ("Requests holding a KV-cache slot.", lambda: runner.snapshot.running),
            "kvserve_requests_waiting": ("Requests waiting for a slot.", lambda: runner.snapshot.waiting),
            "kvserve_kv_cache_capacity_bytes": ("KV cache allocation: 2*B*L*T*h_kv*d_h*itemsize.", lambda: runner.snapshot.capacity_bytes),
            "kvserve_kv_cache_used_bytes": ("KV cache bytes holding the tokens of running requests.",
                                            lambda: runner.snapshot.used_bytes),
            "kvserve_kv_cache_kept_bytes": ("KV cache bytes that free slots keep for prefix reuse.",
                                            lambda: runner.snapshot.kept_bytes),
            "kvserve_kv_cache_usage_ratio": ("used / capacity.", lambda: runner.snapshot.usage_ratio),
            "kvserve_kv_cache_slots": ("KV cache slots (B).", lambda: runner.snapshot.slots),
            "kvserve_kv_cache_slots_in_use": ("Slots held by running requests.", lambda: runner.snapshot.running),
            "kvserve_model_weights_bytes": ("The model's weights as held in memory (quantized ones packed).",
                                            lambda: runner.snapshot.weights_bytes),
        }
        for name, (doc, read) in gauges.items():
            Gauge(name, doc, registry=r).set_function(read)

    def observe_draft(self, draft: Draft) -> None:
        self.draft_tokens.labels(method=draft.method).inc(draft.proposed)
        self.accepted_tokens.labels(method=draft.method).inc(draft.accepted)
        for position in range(1, draft.accepted + 1):
            self.accepted_by_position.labels(position=str(position)).inc()

    def summary(self) -> dict[str, float | None]:
        """The figures a live view shows, read from the same series /metrics exports: tokens so far, and the mean
        time to first token and inter-token latency (None before any)."""
        def mean(name: str) -> float | None:
            count = self.registry.get_sample_value(f"{name}_count") or 0
            return self.registry.get_sample_value(f"{name}_sum") / count if count else None

        return {"generation_tokens_total": self.registry.get_sample_value("kvserve_generation_tokens_total"),
                "time_to_first_token_mean_s": mean("kvserve_time_to_first_token_seconds"),
                "inter_token_latency_mean_s": mean("kvserve_inter_token_latency_seconds")}

    def render(self) -> bytes:
        return generate_latest(self.registry)
