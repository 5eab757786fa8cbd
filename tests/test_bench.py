"""`python -m bench --quick` of memory, cache and serve: they run, and their figures have the right structure.

Timings are never asserted (they belong to bench/, on a noisy shared machine); exact formula values are.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def bench(tmp_path, *args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "bench", "--out", str(tmp_path), "--quick", *args],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_memory_rows_equal_the_formula(tmp_path):
    result = bench(tmp_path, "memory", "--dtype", "bfloat16")
    payload = json.loads((tmp_path / "memory.json").read_text())
    shape = payload["shape"]
    assert (shape["num_layers"], shape["num_heads"], shape["head_dim"]) == (30, 9, 64)
    assert {r["variant"] for r in payload["rows"]} == {"MHA", "GQA (9q/3kv)", "MQA"}
    for row in payload["rows"]:
        formula = 2 * row["B"] * shape["num_layers"] * row["T"] * row["h_kv"] * shape["head_dim"] * 2
        assert row["formula_bytes"] == formula
        assert row["allocated_bytes"] == formula
        assert row["ratio_to_mha"] == pytest.approx(row["h_kv"] / shape["num_heads"])
        per_sequence = formula // row["B"]
        assert row["sequences_fit"]["1 GiB"] == (1 << 30) // per_sequence
    assert (tmp_path / "memory.png").stat().st_size > 0 and (tmp_path / "memory.md").is_file()
    assert "| MHA | 1 | 256 | 17,694,720 | 17,694,720 |" in result.stdout
    assert result.stdout.count("Machine:") == 1


def test_cache_compares_cached_decode_with_recompute(tmp_path):
    bench(tmp_path, "cache")
    payload = json.loads((tmp_path / "cache.json").read_text())
    assert [r["position"] for r in payload["rows"]] == [32, 64, 128]
    for row in payload["rows"]:
        assert row["speedup"] == pytest.approx(row["recompute"]["median_s"] / row["cached"]["median_s"])
        assert row["cached"]["min_s"] <= row["cached"]["median_s"] <= row["cached"]["max_s"]
    assert (tmp_path / "cache.png").stat().st_size > 0


def test_serve_load_agrees_with_the_servers_metrics(tmp_path, model_dir):
    bench(tmp_path, "serve", "--model", str(model_dir("long")), "--concurrency", "1,4", "--dtype", "float32")
    payload = json.loads((tmp_path / "serve.json").read_text())
    assert [level["concurrency"] for level in payload["levels"]] == [1, 4]
    for level in payload["levels"]:
        assert level["errors"] == 0
        assert level["output_tokens"] == level["requests"] * payload["new_tokens"]
        assert level["ttft_p50_s"] <= level["ttft_p99_s"]
    assert payload["server_view"]["kvserve_generation_tokens_total"] == payload["client_tokens"]
    assert payload["server_view"]["requests"] == payload["client_requests"]
    assert payload["products_floor_s"] > 0 and payload["references_tokens_per_s"] == {}  # --quick: no references
    assert (tmp_path / "serve.png").stat().st_size > 0


def test_common_options_work_after_the_subcommand(tmp_path):
    result = subprocess.run([sys.executable, "-m", "bench", "memory", "--quick", "--out", str(tmp_path / "after"),
                             "--layers", "2", "--heads", "4", "--head-dim", "16"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "after" / "memory.json").is_file()


def test_prefix_caching_bench_counts_what_was_reused(tmp_path, model_dir):
    bench(tmp_path, "prefix", "--model", str(model_dir("long")), "--dtype", "float32", "--new-tokens", "4")
    results = json.loads((tmp_path / "prefix.json").read_text())["results"]
    on, off = results["on"], results["off"]
    assert [turn["cached_tokens"] for turn in off["chat"]] == [0] * len(off["chat"])
    assert all(turn["cached_tokens"] > 0 for turn in on["chat"][1:])  # each turn resends the previous ones
    assert on["shared"]["queried_tokens"] == off["shared"]["queried_tokens"] == off["shared"]["computed_tokens"]
    # The system prompt is computed once, not once per user: with it alone, 4 users send about 4x.
    assert on["shared"]["computed_tokens"] < 0.5 * off["shared"]["computed_tokens"]
    assert on["arrival"]["gaps_during"] > 0 and (tmp_path / "prefix.png").stat().st_size > 0


def test_soak_reports_errors_memory_and_windows(tmp_path, model_dir):
    bench(tmp_path, "soak", "--model", str(model_dir("long")), "--dtype", "float32", "--compile", "off")
    payload = json.loads((tmp_path / "soak.json").read_text())
    assert payload["errors"] == 0 and payload["requests"] > 0
    assert payload["tokens_agree"] and payload["client_tokens"] == payload["server_tokens"] > 0
    assert {"rss_growth_pct", "itl_p99_ms_first_window", "itl_p99_ms_last_window"} <= payload.keys()
    assert payload["engine_steps"] > 0 and 0 <= payload["engine_steps_over_1s"] <= payload["engine_steps"]
    assert all(w["p50_ms"] <= w["p99_ms"] for w in payload["windows"])
    assert (tmp_path / "soak.png").stat().st_size > 0


def test_storm_frees_every_dropped_stream_and_overload_answers_200_or_429(tmp_path, model_dir):
    bench(tmp_path, "storm", "--model", str(model_dir("long")), "--dtype", "float32", "--max-batch-size", "4",
          "--max-queue", "8", "--new-tokens", "128")  # 128 steps a request: 40 arrive long before 12 can finish
    payload = json.loads((tmp_path / "storm.json").read_text())
    (storm,) = payload["storms"]
    assert storm["streamed"] == storm["streams"] == 16 and payload["leaked_slots"] == storm["left_waiting"] == 0
    overload = payload["overload"]
    # 40 at once, twice, to 4 slots and a queue of 8: some are refused, each with Retry-After, and nothing else.
    assert overload["only_200_and_429"] and overload["statuses"]["429"] > 0 and overload["429_without_retry_after"] == 0
    assert overload["statuses"]["200"] + overload["statuses"]["429"] == 80 and overload["health_after"] == 200


def test_structured_bench_checks_every_sample_against_the_schema(tmp_path, model_dir):
    bench(tmp_path, "structured", "--model", str(model_dir("long")), "--dtype", "float32", "--max-tokens", "1200")
    payload = json.loads((tmp_path / "structured.json").read_text())
    assert payload["valid"] == payload["samples"] == 8  # the grammar, not the random model, makes them valid
    assert set(payload["per_token"]) == {"1", "4"}
    assert all(cost["free_ms_per_token"] > 0 and cost["constrained_ms_per_token"] > 0 for cost in payload["per_token"].values())
    assert payload["grammar_compile_s"] > 0 and payload["cache_hit_us_median"] >= 0


def test_tp_times_two_ranks_against_one(tmp_path, tiny_dir):
    bench(tmp_path, "tp", "--model", str(tiny_dir))
    payload = json.loads((tmp_path / "tp.json").read_text())
    assert payload["all_reduces_per_step"] == 2 * 2  # two per layer, the tiny model's two layers
    assert payload["tp1_step_ms"] > 0 and payload["tp2_step_ms"] > 0 and payload["tp2_all_reduce_ms"] > 0
    assert (tmp_path / "tp.md").is_file()


def test_a_bench_without_its_extra_names_the_extra(tmp_path):
    """After the README's plain install (no [bench] extra), `python -m bench soak` says what to install rather
    than dying on an import: the missing package is simulated by a module that fails to import as a missing one
    does."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "httpx.py").write_text("raise ModuleNotFoundError(\"No module named 'httpx'\", name='httpx')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(shadow), os.getcwd()]))
    result = subprocess.run([sys.executable, "-m", "bench", "soak", "--quick"], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "needs httpx" in result.stderr and '.[bench]' in result.stderr


def test_perplexity_chunks_the_text_as_llama_perplexity_does():
    from bench.perplexity import chunks

    ids = [1] + list(range(100, 109))  # BOS, then 9 tokens: two whole chunks of 4, the rest dropped
    assert chunks(ids, 4, bos=1) == [[1, 100, 101, 102], [1, 104, 105, 106]]  # each chunk led by BOS
    assert chunks(ids, 4, bos=None) == [[1, 100, 101, 102], [103, 104, 105, 106]]


def test_perplexity_bench_scores_a_gguf_against_its_own_weights_in_float32(tmp_path, tiny_dir):
    from tests.test_gguf import write_gguf

    from bench.perplexity import TEXT
    from engine.tokenizer import Tokenizer

    write_gguf(tiny_dir, tmp_path / "tiny.gguf")
    (tmp_path / "long.txt").write_text(TEXT * 2)  # a text of one's own: more tokens, the same chunking
    bench(tmp_path, "perplexity", "--gguf", str(tmp_path / "tiny.gguf"), "--ctx", "32", "--text", str(tmp_path / "long.txt"))
    payload = json.loads((tmp_path / "perplexity.json").read_text())
    assert payload["text"] == "long.txt" and payload["tokens"] == len(Tokenizer.from_dir(tiny_dir).encode(TEXT * 2))
    assert payload["chunks"] == payload["tokens"] // 32 >= 2
    scores = payload["kvserve"]
    assert scores["perplexity"] > 1 and scores["float32 perplexity"] > 1
    assert 0 <= scores["kl_divergence"] < 0.5 and 0 <= scores["same_top"] <= 1
    assert "llama.cpp" not in payload and "llama.cpp not run" in (tmp_path / "perplexity.md").read_text()


def test_quants_serves_a_gguf_and_times_its_decode_streams_and_prefill(tmp_path, tiny_dir):
    from tests.test_gguf import write_gguf

    write_gguf(tiny_dir, tmp_path / "tiny.gguf")
    bench(tmp_path, "quants", "--gguf", str(tmp_path / "tiny.gguf"), "--streams", "1", "2", "--new-tokens", "8",
          "--repeats", "1", "--prefill-tokens", "40", "--max-seq-len", "256", "--compile", "off")
    payload = json.loads((tmp_path / "quants.json").read_text())
    assert payload["prefill_tokens"] == 40 and list(payload["files"]) == ["tiny.gguf"]
    ours = payload["files"]["tiny.gguf"]["kvserve"]
    assert ours["one"]["tokens_per_s"] > 0 and ours["2 streams"] > 0 and ours["rss"] > 0
    # The long prompt: as many whole copies of the bench's sentence as fit in 40 tokens, after its own number.
    assert 20 <= ours["prefill"]["prompt_tokens"] <= 48 and ours["prefill"]["seconds"] > 0
    assert "llama-server" not in payload["files"]["tiny.gguf"]
    assert "| tiny.gguf | kvserve |" in (tmp_path / "quants.md").read_text()


def test_quants_turns_decode_one_stream_on_the_engine_alone(tmp_path, tiny_dir, monkeypatch):
    """The turns' run without a server: the file's engine in the bench's process decodes the bench's prompt to
    --new-tokens greedy tokens, one step each, its rate the tokens after the first over the steps after the first
    (as a server's stream is counted)."""
    import argparse
    import types

    from bench import quants
    from tests.test_gguf import write_gguf

    write_gguf(tiny_dir, tmp_path / "tiny.gguf")
    from bench import spec

    # The bench's clock only (the engine keeps its own), read before and after each of the 8 steps: the first (the
    # prompt's pass and the first token) takes 5 s, each after it 0.5 s.
    clock = iter([t for k in range(8) for t in (10.0 * k, 10.0 * k + (5.0 if k == 0 else 0.5))])
    monkeypatch.setattr(spec, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    engine = quants.local_engine(tmp_path / "tiny.gguf", argparse.Namespace(max_seq_len=256, compile="off"))
    steps = []
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: steps.append(1) or step())
    assert quants.engine_rate(engine, quants.PROMPT, 8) == 7 / (7 * 0.5)
    assert len(steps) == 8 and not engine.has_work


def test_quants_pairs_its_ratios_within_each_round():
    """A drifting machine: round 2 runs both servers at half speed. Paired within rounds, the ratios stay what they
    are in every round; rates are medians over the rounds, the prefill the best."""
    from bench.quants import combined, paired

    def round_of(rate: float, prefill_s: float, streams: float) -> dict:
        return {"one": {"tokens_per_s": rate, "inter_token_s": 1 / rate, "ttft_s": 0.1},
                "prefill": {"seconds": prefill_s, "prompt_tokens": 512}, "16 streams": streams}

    ours = [round_of(40, 2.0, 160), round_of(20, 4.0, 80), round_of(40, 2.0, 160)]
    theirs = [round_of(20, 4.0, 80), round_of(10, 8.0, 40), round_of(20, 4.0, 80)]
    assert paired(ours, theirs) == {"one stream": 2.0, "prefill time": 0.5, "16 streams": 2.0}
    assert combined(ours) == {"one": {"tokens_per_s": 40, "inter_token_s": 1 / 40, "ttft_s": 0.1},
                              "prefill": {"seconds": 2.0, "prompt_tokens": 512}, "16 streams": 160}


def test_quants_alternates_its_one_stream_runs_and_pairs_them_within_each_turn():
    """The machine halves its speed from the second turn on: within a turn, kvserve and its peers meet the same
    speed, so the ratios stay exact; the order rotates, so no run is always the first of its turn."""
    from bench.quants import alternated, ratios_within_turns

    calls: list[str] = []

    def run(name: str, rate: float):
        def timed() -> float:
            calls.append(name)
            return rate / (1 if len(calls) <= 3 else 2)
        return timed

    turns = alternated({"kvserve": run("kvserve", 60), "llama-server": run("llama-server", 40),
                        "llama-bench tg": run("llama-bench tg", 50)}, 3)
    assert calls == ["kvserve", "llama-server", "llama-bench tg", "llama-server", "llama-bench tg", "kvserve",
                     "llama-bench tg", "kvserve", "llama-server"]
    assert turns[1] == {"llama-server": 20, "llama-bench tg": 25, "kvserve": 30}
    assert ratios_within_turns(turns) == {"llama-server": 1.5, "llama-bench tg": 1.2}


def test_quants_takes_each_runs_share_of_the_read_floor_at_the_read_rate_either_side_of_it():
    """The machine halves its speed, reading included, in the second turn, where the reads either side of each run
    differ (12, 16, 12 GB/s): each run's floor is at the mean of its two reads, 14, so each share is the same in both
    turns; one read for all the turns would put the slow turn's runs at half their share."""
    from bench.quants import READ_RATE, alternated, floors_within_turns, ratios_within_turns

    events: list[str] = []
    reads = iter([28e9, 28e9, 28e9, 12e9, 16e9, 12e9])

    def run(name: str, rate: float):
        def timed() -> float:
            events.append(name)
            return rate / (1 if len(events) < 5 else 2)
        return timed

    def read() -> float:
        events.append("read")
        return next(reads)

    size = 700e6  # bytes read per token
    turns = alternated({"kvserve": run("kvserve", 30.0), "llama-bench tg": run("llama-bench tg", 20.0)}, 2, read)
    assert events == ["read", "kvserve", "read", "llama-bench tg", "read",
                      "read", "llama-bench tg", "read", "kvserve", "read"]
    assert turns[1] == {"llama-bench tg": 10.0, "kvserve": 15.0, READ_RATE: {"llama-bench tg": 14e9, "kvserve": 14e9}}
    assert floors_within_turns(turns, size) == pytest.approx({"kvserve": 0.75, "llama-bench tg": 0.5})
    assert ratios_within_turns(turns) == {"llama-bench tg": 1.5}  # the read rate is not a run to compare with


def test_spec_keeps_every_output_of_the_default_model(tmp_path):
    bench(tmp_path, "spec", "--compile", "off")
    payload = json.loads((tmp_path / "spec.json").read_text())
    assert list(payload["results"]) == ["rename", "quote", "json", "chat", "4 streams, mixed"]
    for result in payload["results"].values():
        assert result["identical"]
        assert 0 <= result["accepted_tokens"] <= result["draft_tokens"]
    assert payload["results"]["quote"]["accepted_tokens"] > 0
    assert payload["speculative"]["method"] == "auto"
