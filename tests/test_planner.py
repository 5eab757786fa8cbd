"""The planner: one decision per matrix, with its reason, on given machines and timings (pure), and on this
machine through the engine and the server; the two-forms layers it builds (a quantized LM head tied to the
embedding, dense copies of the blocks' quantized layers) and the per-machine record of what it measured."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict

import httpx
import pytest
import torch
from torch._dynamo.utils import counters

from engine import Engine, EngineConfig
from engine import cache_file
from engine.executor import batch_buckets
from engine.linear.codes import GroupCodes
from engine.linear.embedding import CodesEmbedding
from engine.linear.dense import CpuLinear, PackedLinear, packs_bfloat16
from engine.linear import planner as planner_module
from engine.linear.native import load_kernels
from engine.linear.planner import Machine, Planner, Role, codes_layer_class, served_by_type, summary
from engine.linear.quantized import Codes4Linear, GroupLinear, Int8Linear
from engine.linear.timing import ProductForms, Timings, dense_from
from engine.linear.two_forms import TwoForms, dense_weight
from engine.models.model import build_model, weights_bytes
from engine.sampling import SamplingParams
from engine.tokenizer import Tokenizer
from server.settings import Settings
from tests.server_harness import serve
from weights.checkpoint import load_checkpoint
from weights.loading import load_engine

CPU = torch.device("cpu")
KERNELS = Machine(CPU, kernels_off=None)  # kvserve's kernels run; no bfloat16 arithmetic, no oneDNN packing
NO_KERNELS = Machine(CPU, kernels_off="no C++ compiler")
PACKING = Machine(CPU, kernels_off=None, native_bfloat16=True, packs_bfloat16=True)


class Given(Timings):
    """Timings as given, by the first word of a switch's key ("head" or "block"); measuring is an error."""

    def __init__(self, head: int | None = None, block: int | None = None):
        super().__init__(None, {"forms": asdict(ProductForms()), "switches": {}})
        self.given = {"head": head, "block": block}
        self.asked: list[str] = []

    def switch(self, key, measure):
        self.asked.append(key)
        return self.given[key.split()[0]]


def q4_0(out_features: int = 48, in_features: int = 64) -> GroupCodes:
    codes = GroupCodes.fit(torch.randn(out_features, in_features), 4)
    return GroupCodes(codes.codes, codes.scale.half().float(), codes.minimum.half().float(), 4, ("Q4_0 as stored",))


def test_float_weights_stay_dense_in_the_form_this_cpu_runs_fastest():
    big, small = torch.randn(512, 256), torch.randn(16, 64)
    layer = Planner(KERNELS).plan(big, None, Role("layers.0.mlp.down_proj"))
    assert isinstance(layer.layer, CpuLinear) and layer.reason == "dense float32: W·xᵀ through MKL's GEMM up to 128 rows"
    assert "too small for W·xᵀ" in Planner(KERNELS).plan(small, None, Role("layers.0.mlp.down_proj")).reason
    bf16 = big.bfloat16()
    widened = Planner(KERNELS).plan(bf16, None, Role("layers.0.mlp.down_proj"))
    assert isinstance(widened.layer, CpuLinear) and widened.layer.widen_bfloat16 and "widened to float32" in widened.reason
    if packs_bfloat16():  # oneDNN refuses to pack where it has no bfloat16 products
        packed = Planner(PACKING).plan(bf16, None, Role("layers.0.mlp.down_proj"))
        assert isinstance(packed.layer, PackedLinear) and "prepacked by oneDNN" in packed.reason
    # A tied head computes on the embedding itself: packing would copy it.
    head = Planner(PACKING).plan(bf16, None, Role("lm_head", tied_embedding=bf16))
    assert isinstance(head.layer, CpuLinear) and head.layer.weight.data_ptr() == bf16.data_ptr()
    assert "the embedding itself" in head.reason
    on_gpu = Planner(Machine(torch.device("cuda"))).plan(big, None, Role("lm_head"))
    assert type(on_gpu.layer) is torch.nn.Linear and on_gpu.reason == "dense on cuda: torch's product"


def test_stored_codes_run_on_our_kernels_or_on_torchs_where_ours_are_off():
    weight = q4_0()
    ours = Planner(KERNELS, "auto", timings=Given()).plan(weight, None, Role("layers.0.self_attn.o_proj"))
    assert isinstance(ours.layer, Codes4Linear) and ours.served == ("Q4_0 as stored",)
    assert ours.reason == "Q4_0 as stored: kvserve's 4-bit kernel (dot products at every row count)"
    theirs = Planner(NO_KERNELS, "auto").plan(weight, None, Role("layers.0.self_attn.o_proj"))
    assert isinstance(theirs.layer, GroupLinear)
    assert theirs.reason == "Q4_0 as stored: torch's int4 kernel (kvserve's kernels are off here: no C++ compiler)"
    assert codes_layer_class(4, NO_KERNELS) is GroupLinear and codes_layer_class(4, KERNELS) is Codes4Linear


def test_int4_quantizes_the_blocks_in_groups_and_the_head_in_int8_rows():
    planner = Planner(NO_KERNELS, "int4")
    block = planner.plan(torch.randn(48, 64).bfloat16(), None, Role("layers.1.mlp.gate_up_proj"))
    head = planner.plan(torch.randn(48, 64).bfloat16(), None, Role("lm_head"))
    assert isinstance(block.layer, GroupLinear) and block.reason.startswith("int4 groups quantized at load")
    assert isinstance(head.layer, Int8Linear) and "keeps the head in 8 bits" in head.reason
    assert block.served == head.served == ()  # nothing came from a GGUF type


@pytest.mark.parametrize("switch", [3, None])
def test_a_quantized_tied_head_switches_to_the_embedding_where_measured(switch):
    embedding = torch.randn(48, 64).bfloat16()
    timings = Given(head=switch)
    decision = Planner(NO_KERNELS, "auto", timings=timings).plan(q4_0(), None, Role("lm_head", embedding))
    head = decision.layer
    assert timings.asked == ["head GroupLinear 48x64 vs embedding CpuLinear"]
    expected = "codes below 3 rows, the embedding from there" if switch else "codes at every row count"
    assert decision.reason == f"Q4_0 as stored: torch's int4 kernel (kvserve's kernels are off here: no C++ compiler); {expected} (measured)"
    if switch is None:  # the embedding is then no form of the head
        assert isinstance(head, GroupLinear) and decision.kind == "GroupLinear"
        return
    assert isinstance(head, TwoForms) and head.dense_from == switch and head.dense.weight.data_ptr() == embedding.data_ptr()
    assert decision.kind == "TwoForms(GroupLinear, CpuLinear)"


def test_a_tied_embedding_reads_its_rows_from_the_heads_codes_where_they_can():
    """The table is held once: rows dequantized from the head's tiles (the values the dense table holds), unless
    the dense table is itself the head or a form of it, or the codes cannot read their rows back."""
    codes, embedding = q4_0(), torch.randn(48, 64).bfloat16()
    head = Planner(KERNELS, "auto", timings=Given()).plan(codes, None, Role("lm_head", embedding))
    lookup = Planner(KERNELS).embedding(embedding, head, torch.bfloat16)
    assert isinstance(lookup.layer, CodesEmbedding) and lookup.layer.codes is head.layer
    assert lookup.reason == "rows of the LM head's codes, dequantized at lookup to bfloat16: no dense table beside them"
    tokens = torch.tensor([[0, 17, 47], [16, 15, 3]])
    with torch.inference_mode():
        assert torch.equal(lookup.layer(tokens), codes.dequantize().bfloat16()[tokens])
    # Measured faster from 3 rows, the dense table is still not kept for the head's sake: only prefill's prompt
    # scoring would run it (a decode step takes the codes at any row count).
    measured = Planner(KERNELS, "auto", timings=Given(head=3)).plan(codes, None, Role("lm_head", embedding))
    assert measured.layer is not None and measured.kind == "Codes4Linear"
    assert measured.reason.endswith("codes at every row count (the embedding reads its rows from them: no dense "
                                    "table held for prompt scoring alone)")
    assert isinstance(Planner(KERNELS).embedding(embedding, measured, torch.bfloat16).layer, CodesEmbedding)
    # With dense copies (memory traded for prefill speed) the table is kept as the head's dense form from 3 rows.
    switching = Planner(KERNELS, "auto", dense_copies=True, timings=Given(head=3)).plan(codes, None,
                                                                                       Role("lm_head", embedding))
    dense = Planner(KERNELS).embedding(embedding, switching, torch.bfloat16)
    assert isinstance(dense.layer, torch.nn.Embedding) and dense.layer.weight.data_ptr() == embedding.data_ptr()
    assert dense.reason == "dense bfloat16: also the LM head's dense form, from 3 rows"
    torchs = Planner(NO_KERNELS, "auto", timings=Given()).plan(codes, None, Role("lm_head", embedding))
    assert Planner(NO_KERNELS).embedding(embedding, torchs, torch.bfloat16).reason == "dense bfloat16: the head's GroupLinear codes do not read their rows back"
    plain = Planner(KERNELS).plan(embedding, None, Role("lm_head", embedding))
    assert Planner(KERNELS).embedding(embedding, plain, torch.bfloat16).reason == "dense bfloat16: also the LM head"
    assert Planner(KERNELS).embedding(embedding, None, torch.bfloat16).reason == "dense bfloat16: the checkpoint's own table (not tied to the head)"


def test_an_untied_quantized_embedding_reads_its_rows_from_its_own_codes():
    """An untied GGUF's table (Mistral's, Llama 3 8B's) as stored: a codes layer of its own, whose product never
    runs, serves the lookups; where kvserve's kernels are off, the codes dequantized once into a dense table."""
    codes = q4_0()
    tokens = torch.tensor([[0, 17, 47], [16, 15, 3]])
    lookup = Planner(KERNELS, "auto", timings=Given()).embedding(codes, None, torch.bfloat16)
    assert isinstance(lookup.layer, CodesEmbedding) and isinstance(lookup.layer.codes, Codes4Linear)
    assert lookup.reason == "Q4_0 as stored: its own codes, rows dequantized at lookup to bfloat16"
    assert lookup.served == ("Q4_0 as stored",)
    dense = Planner(NO_KERNELS).embedding(codes, None, torch.bfloat16)
    assert isinstance(dense.layer, torch.nn.Embedding) and dense.layer.weight.dtype == torch.bfloat16
    assert dense.reason == "dense bfloat16: the stored codes dequantized at load (kvserve's kernels are off here)"
    with torch.inference_mode():
        for layer in (lookup.layer, dense.layer):
            assert torch.equal(layer(tokens), codes.dequantize().bfloat16()[tokens])


@pytest.mark.parametrize("switch", [2, None])
def test_dense_copies_are_kept_only_where_measured_faster(switch, monkeypatch):
    copies = []
    monkeypatch.setattr(planner_module, "dense_weight", lambda layer: copies.append(layer) or dense_weight(layer))
    timings = Given(block=switch)
    decision = Planner(NO_KERNELS, "auto", dense_copies=True, timings=timings).plan(
        q4_0(), None, Role("layers.0.mlp.down_proj"))
    assert timings.asked == ["block GroupLinear 48x64 vs copy CpuLinear"]  # the dense class known before any copy
    assert len(copies) == (0 if switch is None else 1)  # recorded: no copy made to be thrown away, nor measured again
    if switch is None:  # a copy that never runs would only take memory
        assert isinstance(decision.layer, GroupLinear) and decision.reason.endswith("no dense copy: the codes were faster at every row count (measured)")
    else:
        assert isinstance(decision.layer, TwoForms) and decision.layer.dense_from == 2
        assert decision.reason.endswith("codes below 2 rows, a dense copy from there (measured)")


def test_a_plan_is_summarised_by_matrix_name_and_by_gguf_type():
    planner = Planner(NO_KERNELS, "auto", timings=Given())
    fitted = GroupCodes.fit(torch.randn(48, 64), 8, source="Q6_K")
    decisions = [planner.plan(q4_0(), None, Role(f"layers.{i}.mlp.down_proj")) for i in range(3)]
    decisions.append(planner.plan(fitted, None, Role("lm_head")))
    entries = summary(decisions)
    assert [(e["matrices"], e["count"], e["layer"]) for e in entries] == [("layers.*.mlp.down_proj", 3, "GroupLinear"),
                                                                          ("lm_head", 1, "GroupLinear")]
    assert served_by_type(decisions) == {"Q4_0": {"as stored": 3}, "Q6_K": {"fitted to 8-bit groups at load": 1}}


def test_dense_from_is_the_first_count_from_which_dense_wins():
    assert dense_from({1: (1, 3), 2: (2, 3), 4: (4, 3), 8: (8, 4)}) == 4  # codes cost grows with the rows
    assert dense_from({1: (1, 3), 2: (3, 2), 4: (2, 3), 8: (8, 4)}) == 8  # dense must win at every larger count
    assert dense_from({1: (1, 3), 4: (2, 3)}) is None  # the codes win everywhere
    assert dense_from({1: (3, 1), 4: (8, 2)}) == 1  # the dense form wins everywhere


def test_timings_are_measured_once_per_machine_and_kept(tmp_path, caplog):
    path = tmp_path / "timings.json"
    calls = []

    def measure():
        calls.append(1)
        return {1: (1.0, 2.0), 2: (2.0, 1.0)}

    assert Timings(path).switch("head A 8x8 vs embedding B", measure) == 2 and len(calls) == 1
    assert Timings(path).switch("head A 8x8 vs embedding B", measure) == 2 and len(calls) == 1  # read, not measured
    # A second key joins the record; what stands on disk wins over what a racing process measured.
    other = Timings(path)
    cache_file.write(path, json.dumps({"forms": None, "switches": {"head A 8x8 vs embedding B": 2, "block C": 8}}).encode())
    assert other.switch("block C", measure) == 8
    path.write_bytes(b"{garbled")  # damaged: measured again, with a warning, never parsed as it is
    with caplog.at_level(logging.WARNING, logger="kvserve.timing"):
        assert Timings(path).switch("head A 8x8 vs embedding B", measure) == 2 and len(calls) == 3
    assert "measuring them again" in caplog.text


@torch.inference_mode()
def test_a_quantized_tied_head_reads_the_embedding_for_its_dense_form(model_dir):
    model = planned(model_dir, "tied", "int8", Given(head=2))
    head, embedding = model.lm_head, model.embed_tokens.weight
    assert isinstance(head, TwoForms) and isinstance(head.codes, Int8Linear)
    assert head.dense.weight is embedding  # the dense form costs no memory: it is the embedding itself
    x = torch.randn(3, embedding.shape[1], dtype=embedding.dtype)
    assert torch.equal(head(x[:1]), head.codes(x[:1])) and torch.equal(head(x), head.dense(x))
    # Both forms are the same weight: int8 codes per row vs the bfloat16 embedding.
    torch.testing.assert_close(head.codes(x).float(), head.dense(x).float(), atol=0.05, rtol=0.05)
    names = [d.name for d in model.plan]
    assert names[0] == "embed_tokens" and names[-1] == "lm_head" and len(names) == 1 + 4 * 2 + 1


@pytest.mark.skipif(not packs_bfloat16(), reason="oneDNN computes no bfloat16 products on this CPU")
@torch.inference_mode()
def test_with_dense_copies_a_tied_head_packs_a_copy_of_the_embedding(model_dir):
    engine = load_engine(model_dir("tied"), EngineConfig(device="cpu", quantize="int8", max_batch_size=4,
                                                         max_seq_len=64, dense_copies=True))
    head, embedding = engine.model.lm_head, engine.model.embed_tokens.weight
    assert isinstance(head, TwoForms)
    if head.dense_from is None:  # never faster here: no copy kept
        assert head.dense.weight is embedding
        return
    assert isinstance(head.dense, PackedLinear)
    x = torch.randn(3, embedding.shape[1], dtype=embedding.dtype)
    torch.testing.assert_close(head.dense(x), torch.nn.functional.linear(x, embedding))


def planned(model_dir, name: str, quantize: str, timings: Given, dense_copies: bool = False):
    """The tiny model `name` in bfloat16, planned on this machine with the given timings."""
    config, state = load_checkpoint(model_dir(name), torch.bfloat16)
    return build_model(config, state, CPU, Planner(Machine.found(CPU), quantize, dense_copies, timings))


def test_compiled_decode_keeps_the_codes_past_the_switch_and_eagers_bits(model_dir):
    model = planned(model_dir, "tied", "int4", Given(head=3))  # an int8 head, the embedding from 3 rows
    tokenizer = Tokenizer.from_dir(model_dir("tied"))
    settings = dict(device="cpu", max_batch_size=4, max_seq_len=64, seed=0)
    compiled = Engine(model, tokenizer, EngineConfig(compile="on", **settings))
    eager = Engine(model, tokenizer, EngineConfig(**settings))
    assert compiled.compile() and compiled.compiled_graphs == ("1", "2+")
    assert [compiled.executor.bucket(b) for b in (1, 2, 3, 4)] == ["1", "2+", "2+", "2+"]
    frames = counters["frames"]["total"]
    ids = tokenizer.encode("The quick brown fox")
    with torch.inference_mode():
        for engine in (compiled, eager):
            engine.prompt_logits(ids)  # writes the prompt into slot 0
        for rows in (1, 2, 3, 4):
            args = ([5] * rows, list(range(rows)), [len(ids)] + [slot + 2 for slot in range(1, rows)])
            got, want = compiled.executor.forward(*args), eager.executor.forward(*args)
            if load_kernels() is None:  # the norms and attention on kvserve's kernels: every row as eager computes it,
                assert torch.equal(got, want)  # and as the one-row graph does
                assert torch.equal(got[:1], compiled.executor.forward([5], [0], [len(ids)]))
            else:  # torch's norms: inductor's fused kernels round at other points than eager ops do
                torch.testing.assert_close(got, want, atol=0.1, rtol=0.05)
    assert counters["frames"]["total"] == frames  # every batch size ran on a graph compiled up front


@torch.inference_mode()
def test_dense_copies_hold_the_weights_the_codes_compute_with(model_dir):
    model = planned(model_dir, "gqa", "int4", Given(block=3), dense_copies=True)
    generator = torch.Generator().manual_seed(0)
    layers = [m for m in model.layers.modules() if isinstance(m, TwoForms)]
    assert len(layers) == 4 * model.config.num_layers  # qkv, o, gate_up and down
    for layer in layers:
        assert isinstance(layer.codes, codes_layer_class(4, Machine.found(CPU)))
        assert isinstance(layer.dense, PackedLinear if packs_bfloat16() else CpuLinear)
        x = torch.randn(5, layer.in_features, dtype=torch.bfloat16, generator=generator)
        # The copy is the codes' own weight: the same product, rounded at other points (and, for kvserve's
        # kernels, with the inputs quantized to 8 bits per group: about 0.5% of the product).
        dense, coded = layer.dense(x).float(), layer.codes(x).float()
        assert ((coded - dense).norm() / dense.norm()).item() < 0.02
        assert torch.equal(layer(x[:2]), layer.codes(x[:2])) and torch.equal(layer(x), layer.dense(x))


def test_a_dense_copy_is_the_dequantized_codes():
    codes = GroupCodes.fit(torch.randn(64, 96), bits=4)
    layer = GroupLinear(codes, None, torch.float32)
    torch.testing.assert_close(dense_weight(layer), codes.dequantize(), atol=1e-5, rtol=1e-5)


def test_dense_copies_serve_the_same_answers(model_dir):
    settings = dict(device="cpu", max_batch_size=4, max_seq_len=64, seed=0)
    codes = Engine(planned(model_dir, "gqa", "int4", Given()), None, EngineConfig(**settings))
    copies = Engine(planned(model_dir, "gqa", "int4", Given(block=1), dense_copies=True), None, EngineConfig(**settings))
    prompts = [[5, 9, 14, 2, 7], [3, 3, 8]]  # every product on the copies, prefill and decode
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    # Along each greedy answer of the copies, the codes see the same next-token distributions. (Not token for
    # token: kvserve's 4-bit kernel quantizes its inputs to 8 bits, so near-ties of a random model may flip.)
    for prompt, answer in zip(prompts, copies.generate(prompts, params)):
        sequence = prompt + answer.output_ids[:-1]
        with torch.inference_mode():
            dense, coded = copies.prompt_logits(sequence).log_softmax(-1), codes.prompt_logits(sequence).log_softmax(-1)
        kl = torch.nn.functional.kl_div(coded, dense, log_target=True, reduction="none").sum(-1)  # per position
        assert kl.max().item() < 1e-3


def test_a_decode_step_keeps_one_form_at_every_batch_size():
    """A decode step's rows (b, 1, in) take the codes past the switch, so a row gets the bits it gets alone; other
    inputs switch there. The decode buckets therefore never split at a switch."""
    generator = torch.Generator().manual_seed(0)
    codes, dense = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    layer = TwoForms(codes, dense, dense_from=2)
    x = torch.randn(8, 1, 4, generator=generator)
    with torch.inference_mode():
        assert torch.equal(layer(x), codes(x))  # 8 rows of one position each: a decode step
        assert torch.equal(layer(x[:, 0]), dense(x[:, 0]))  # 8 rows of a matrix (a prefill's): dense from 2
        assert torch.equal(layer(x[:1, 0]), codes(x[:1, 0]))
    assert batch_buckets(rows=8) == {"1": 1, "2+": 2}
    assert batch_buckets(rows=2) == {"1": 1, "2": 2}
    assert batch_buckets(rows=1) == {"1": 1}  # one row at most never batches


def test_the_server_takes_dense_copies_counts_their_bytes_and_reports_its_plan(model_dir):
    with pytest.raises(ValueError, match="dense_copies must be on or off"):
        Settings(dense_copies="yes")
    sizes, copied = {}, {}
    for copies in ("off", "on"):
        with serve(model_dir("gqa"), dtype="bfloat16", quantize="int4", dense_copies=copies, max_seq_len=64) as server:
            info = httpx.get(f"{server.url}/info").json()
            reply = httpx.post(f"{server.url}/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 3}})
            assert reply.status_code == 200 and info["quantized"] is True
            sizes[copies] = info["weights_bytes"]
            # Kept only where measured faster at some row count: this machine decides whether there are any.
            copied[copies] = sum(weights_bytes(m.dense) for m in server.runner.engine.model.layers.modules()
                                 if isinstance(m, TwoForms))
            plan = {entry["matrices"]: entry for entry in info["linear_layers"]}
            assert set(plan) == {"layers.*.self_attn.qkv_proj", "layers.*.self_attn.o_proj", "layers.*.mlp.gate_up_proj",
                                 "layers.*.mlp.down_proj", "lm_head", "embed_tokens"}
            assert plan["lm_head"]["layer"] == "Int8Linear" and "keeps the head in 8 bits" in plan["lm_head"]["reason"]
            assert plan["embed_tokens"]["layer"] == "Embedding"  # int8 rows of a float table: the table stays dense
            assert all(entry["count"] == 2 for name, entry in plan.items() if name not in ("lm_head", "embed_tokens"))
            assert info["weights_served"] == {}  # float weights quantized on request: no GGUF types
    assert copied["off"] == 0 and sizes["on"] - sizes["off"] == copied["on"]


def test_loading_hands_the_heap_it_freed_back_to_the_system():
    """glibc keeps what loading's temporaries freed (about the model's size again) unless asked to give it back."""
    import platform

    from engine.heap import release_freed_memory

    assert release_freed_memory() is (platform.system() == "Linux" and platform.libc_ver()[0] == "glibc")
