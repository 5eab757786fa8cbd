"""GGUF import, on small GGUF files written here with gguf.GGUFWriter in llama.cpp's layout."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file, save_file

from engine import EngineConfig
from engine.linear.planner import Machine, codes_layer_class, summary
from engine.linear.quantized import WeightOnlyLinear
from engine.linear.timing import NEVER
from tests.tiny import add_bpe_vocabulary, add_shape, gguf_name, quantize_q4_k, quantize_q6_k
from weights.checkpoint import transformers_files
from weights.gguf_file import GGUFError, import_gguf, unpermute_rope_rows
from weights.loading import load_engine

def permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows from (2, d/2) halves to interleaved (d/2, 2) pairs."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def quant_type(name: str, array: np.ndarray) -> GGMLQuantizationType:
    if array.ndim == 1:
        return GGMLQuantizationType.F32
    return GGMLQuantizationType.Q8_0 if "mlp" in name or "embed" in name else GGMLQuantizationType.F16


K_QUANT_WRITERS = {GGMLQuantizationType.Q4_K: quantize_q4_k, GGMLQuantizationType.Q6_K: quantize_q6_k}


def write_gguf(src, out_path, override_type=None):
    """The tiny checkpoint at `src` as a GGUF; returns the tensors as the GGUF holds them (dequantized, HF layout).

    override_type: every matrix's type, or a function of a tensor's name giving it."""
    config = json.loads((src / "config.json").read_text())
    tensors = {k: v.numpy() for k, v in load_file(src / "model.safetensors").items()}
    writer = GGUFWriter(str(out_path), "llama")
    add_shape(writer, config)
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])
    add_bpe_vocabulary(writer, src)
    writer.add_chat_template(json.loads((src / "tokenizer_config.json").read_text())["chat_template"])
    held = {}
    for name, array in tensors.items():
        chosen = override_type(name) if callable(override_type) else override_type
        qtype = chosen if chosen and array.ndim == 2 else quant_type(name, array)
        stored = array
        if "q_proj" in name:
            stored = permute(array, config["num_attention_heads"])
        elif "k_proj" in name:
            stored = permute(array, config["num_key_value_heads"])
        if qtype == GGMLQuantizationType.F16:
            data = stored.astype(np.float16)
        elif qtype == GGMLQuantizationType.F32:
            data = stored.astype(np.float32)
        elif qtype in K_QUANT_WRITERS:  # the gguf library reads K-quants but does not write them
            data = K_QUANT_WRITERS[qtype](stored)
        else:
            data = quantize(stored, qtype)
        writer.add_tensor(gguf_name(name), data, raw_dtype=qtype)
        held[name] = dequantize(data, qtype).reshape(array.shape).copy() if qtype not in (
            GGMLQuantizationType.F16, GGMLQuantizationType.F32) else data.astype(np.float32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held, config


def reference_folder(src, held: dict, config: dict, out):
    """`src` with the weights a GGUF holds (`write_gguf`'s), dequantized, in the half-split layout: a plain Hugging
    Face folder of the same weights."""
    shutil.copytree(src, out)
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    save_file({name: (unpermute_rope_rows(torch.from_numpy(a), heads[name.split(".")[-2]])
                      if name.split(".")[-2] in heads else torch.from_numpy(a)).contiguous()
               for name, a in held.items()}, out / "model.safetensors")
    return out


@pytest.fixture(scope="module")
def gguf_model(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    held, config = write_gguf(tiny_dir, root / "tiny.gguf")
    # The same (quantized) weights as a plain Hugging Face folder, in the half-split layout.
    reference = root / "reference"
    shutil.copytree(tiny_dir, reference)
    held_torch = {}
    for name, array in held.items():
        tensor = torch.from_numpy(array)
        if "q_proj" in name:
            tensor = unpermute_rope_rows(tensor, config["num_attention_heads"])
        elif "k_proj" in name:
            tensor = unpermute_rope_rows(tensor, config["num_key_value_heads"])
        held_torch[name] = tensor.contiguous()
    save_file(held_torch, reference / "model.safetensors")
    imported = import_gguf(root / "tiny.gguf", root / "imported", progress=False)
    return imported, reference, root


def engine_for(path):
    return load_engine(path, EngineConfig(device="cpu", dtype="float32", max_batch_size=2, max_seq_len=64))


def test_unpermute_inverts_llama_cpp_permutation():
    weight = np.arange(4 * 8 * 3, dtype=np.float32).reshape(32, 3)
    assert torch.equal(unpermute_rope_rows(torch.from_numpy(permute(weight, 4)), 4), torch.from_numpy(weight))


def test_imported_logits_equal_the_same_weights_from_safetensors(gguf_model):
    imported, reference, _ = gguf_model
    ids = [5, 17, 33, 120, 7, 250, 64]
    torch.testing.assert_close(engine_for(imported).prompt_logits(ids), engine_for(reference).prompt_logits(ids),
                               atol=1e-5, rtol=1e-5)


def test_the_file_says_whether_its_head_is_tied_whatever_a_config_beside_it_says(gguf_model, tmp_path):
    """The fixture's file has an output.weight (untied); a config.json copied beside it from a Hugging Face folder
    that says tied must not make its embedding the head (llama.cpp reads the file's head, so does kvserve)."""
    imported, reference, _ = gguf_model
    folder = tmp_path / "copied-config"
    shutil.copytree(imported, folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    (folder / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": True}))
    for mode in ("auto", "none"):  # the head as codes of its own (the quantized path) and dense
        served = load_engine(folder, EngineConfig(device="cpu", max_batch_size=1, max_seq_len=64, quantize=mode))
        assert not served.model.config.tie_word_embeddings
        assert served.model.lm_head is not served.model.embed_tokens
    ids = [5, 17, 33, 120, 7, 250, 64]
    torch.testing.assert_close(engine_for(folder).prompt_logits(ids), engine_for(reference).prompt_logits(ids),
                               atol=1e-5, rtol=1e-5)


def test_imported_folder_loads_in_transformers(gguf_model):
    from transformers import AutoModelForCausalLM

    imported, _, _ = gguf_model
    ids = [5, 17, 33, 120, 7]
    theirs = AutoModelForCausalLM.from_pretrained(imported, dtype=torch.float32, **transformers_files(imported))
    theirs = theirs(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(engine_for(imported).prompt_logits(ids), theirs.detach(), atol=1e-4, rtol=1e-4)


def test_imported_tokenizer_and_template_match_the_source(gguf_model, tiny_dir):
    imported, _, _ = gguf_model
    ours, source = engine_for(imported).tokenizer, engine_for(tiny_dir).tokenizer
    for text in ["The quick brown fox", "Café 🙂 東京", "    indented\n\n\ttabs"]:
        assert ours.encode(text) == source.encode(text)
    messages = [{"role": "user", "content": "Hi"}]
    assert ours.render_chat(messages) == source.render_chat(messages)
    assert ours.eos_token_ids == (2,)


@pytest.mark.parametrize("qtype", [None, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q5_0])
def test_our_reader_reads_what_ggufs_reader_reads(gguf_model, tiny_dir, tmp_path, qtype):
    """weights/gguf_reader.py against gguf's GGUFReader: every metadata value (strings, numbers, arrays of both)
    and every tensor's name, type, shape and bytes."""
    from gguf import GGUFReader

    from weights.gguf_reader import Reader

    if qtype is None:
        path = gguf_model[2] / "tiny.gguf"
    else:
        path = tmp_path / "quantized.gguf"
        write_gguf(tiny_dir, path, override_type=qtype)
    theirs, ours = GGUFReader(str(path)), Reader(path)
    assert {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")} == ours.fields
    assert [(t.name, t.tensor_type, t.shape.tolist(), t.data.shape, t.data.dtype) for t in theirs.tensors] == [
        (t.name, t.tensor_type, t.shape.tolist(), t.data.shape, t.data.dtype) for t in ours.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(theirs.tensors, ours.tensors))


def write_minimal_gguf(path, arch: str, tensors: dict | None = None):
    writer = GGUFWriter(str(path), arch)
    for name, (data, qtype) in (tensors or {}).items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_quantization_is_named(tmp_path):
    path = write_minimal_gguf(tmp_path / "iq.gguf", "llama", {
        "token_embd.weight": (np.zeros((16, 36), dtype=np.uint8), GGMLQuantizationType.IQ4_NL)})
    with pytest.raises(GGUFError, match="tensor token_embd.weight has quantization type IQ4_NL, which kvserve does not read"):
        import_gguf(path, tmp_path / "out", progress=False)


def test_unknown_architecture_is_named(tmp_path):
    path = write_minimal_gguf(tmp_path / "gpt2.gguf", "gpt2")
    with pytest.raises(GGUFError, match="architecture 'gpt2' is not supported"):
        import_gguf(path, tmp_path / "out", progress=False)


@pytest.mark.parametrize("qtype", [None, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1])
def test_a_quantized_gguf_is_served_as_stored(gguf_model, tiny_dir, tmp_path, qtype):
    _, reference, _ = gguf_model
    if qtype is None:  # the fixture's file: Q8_0 MLP and embedding, F16 attention
        imported = gguf_model[0]
    else:  # every matrix in qtype: compare with the same dequantized weights
        held, config = write_gguf(tiny_dir, tmp_path / "q.gguf", override_type=qtype)
        imported = import_gguf(tmp_path / "q.gguf", tmp_path / "imported", progress=False)
        reference = reference_folder(tiny_dir, held, config, tmp_path / "reference")
    assert not list(imported.glob("*.safetensors"))
    served = load_engine(imported, EngineConfig(device="cpu", max_batch_size=1, max_seq_len=64))
    mlp, attn = served.model.layers[0].mlp.gate_up_proj, served.model.layers[0].self_attn.qkv_proj
    # Q8_0 MLP in the fixture, else qtype: kvserve's kernels where they build (tests/test_quantization checks that)
    assert isinstance(mlp, codes_layer_class(8 if qtype is None else 4, Machine.found(torch.device("cpu"))))
    assert isinstance(attn, WeightOnlyLinear) == (qtype is not None)  # F16 matrices stay dense
    # Untied: the embedding's lookups read its own codes (Q8_0 in the fixture), not a dense table beside them
    lookup = served.model.plan[0]
    assert lookup.name == "embed_tokens" and lookup.served == (f"{(qtype or GGMLQuantizationType.Q8_0).name} as stored",)
    kernels = Machine.found(torch.device("cpu")).kernels_off is None
    assert (lookup.kind == "CodesEmbedding") == kernels and served.model.embed_tokens is lookup.layer
    ids = [5, 17, 33, 120, 7, 250, 64]
    exact = engine_for(reference).prompt_logits(ids)  # float32, the same weights dequantized
    got = served.prompt_logits(ids)
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), exact.log_softmax(-1), log_target=True, reduction="batchmean")
    assert kl.item() < 0.01  # bfloat16 activations only: the weights are the same


# As llama-quantize's Q4_K_M: the embedding (here the tied head), v and down in Q6_K, the rest Q4_K.
Q4_K_M = {"embed_tokens": GGMLQuantizationType.Q6_K, "v_proj": GGMLQuantizationType.Q6_K,
          "down_proj": GGMLQuantizationType.Q6_K}


@pytest.mark.parametrize("mix", ["Q4_K", "Q4_K_M"])
def test_a_k_quant_gguf_is_served_as_stored_and_matches_transformers(model_dir, tmp_path, mix):
    """A model 256 wide (whole super-blocks), tied: every matrix in Q4_K, or in Q4_K_M's mix of Q4_K and Q6_K (q and k
    in Q4_K above v in Q6_K then stack, each on its own kernel). The oracle is transformers on the same weights."""
    from transformers import AutoModelForCausalLM

    src = model_dir("wide")
    kind = (lambda name: Q4_K_M.get(name.split(".")[-2], GGMLQuantizationType.Q4_K)) if mix != "Q4_K" else (
        GGMLQuantizationType.Q4_K)
    held, config = write_gguf(src, tmp_path / "q.gguf", override_type=kind)
    imported = import_gguf(tmp_path / "q.gguf", tmp_path / "imported", progress=False)
    reference = reference_folder(src, held, config, tmp_path / "reference")
    served = load_engine(imported, EngineConfig(device="cpu", max_batch_size=1, max_seq_len=64))
    types = {entry["matrices"]: entry for entry in summary(list(served.model.plan))}
    kernels = Machine.found(torch.device("cpu")).kernels_off is None
    q4_k = "SuperBlockLinear" if kernels else "GroupLinear"
    assert types["layers.*.mlp.gate_up_proj"]["layer"] == q4_k
    assert types["layers.*.mlp.gate_up_proj"]["reason"].startswith("Q4_K as stored" if kernels else "Q4_K as 4-bit groups")
    if mix == "Q4_K":
        assert types["layers.*.self_attn.qkv_proj"]["layer"] == q4_k
    # The tied head: its codes, from which the embedding's lookups read their rows (the file's one table, held
    # once); torch's kernel reads no rows back, so there the dense embedding may also be the head's form for many rows.
    head = "SubBlock6Linear" if mix == "Q4_K_M" else q4_k
    if kernels:
        assert types["lm_head"]["layer"] == head and types["embed_tokens"]["layer"] == "CodesEmbedding"
    else:
        assert types["lm_head"]["layer"] in (head, f"TwoForms({head}, CpuLinear)")
    if mix == "Q4_K":  # one type, one layer class throughout (checked above for gate_up)
        assert types["layers.*.mlp.down_proj"]["layer"] == q4_k
    elif kernels:  # Q4_K q and k above Q6_K v: a stack of the two, each as stored on its own kernel
        assert types["layers.*.self_attn.qkv_proj"]["layer"] == "StackedLinear"
        # K-quants take AMX's integer tiles for whole 16 rows where this CPU has them (from 16 rows or later)
        forms = next(d.layer for d in served.model.plan if d.name.endswith("qkv_proj")).parts[0].forms
        assert forms.bfloat16_tiles_from == NEVER and forms.integer_tiles_from >= 16
        assert types["layers.*.self_attn.qkv_proj"]["reason"] == (
            f"stacked by type: Q4_K as stored on kvserve's Q4_K kernel ({forms.described()}); "
            f"Q6_K as stored on kvserve's Q6_K kernel ({forms.described()})")
        assert types["layers.*.mlp.down_proj"]["layer"] == "SubBlock6Linear"
        assert served.model.plan[-1].served == ("Q6_K as stored",)
    else:  # torch's int4 kernel: one layer of 8-bit groups, each Q4_K group exact in it, v fitted
        assert types["layers.*.self_attn.qkv_proj"]["reason"].startswith("Q4_K as 4-bit groups")
        assert types["layers.*.mlp.down_proj"]["layer"] == "GroupLinear"
        assert served.model.plan[-1].served == ("Q6_K fitted to 8-bit groups at load",)
    ids = [5, 17, 33, 120, 7, 250, 64]
    model = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    with torch.inference_mode():
        exact = model(torch.tensor([ids])).logits[0]
    got = served.prompt_logits(ids)
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), exact.log_softmax(-1), log_target=True, reduction="batchmean")
    assert kl.item() < 0.01  # bfloat16 activations and 8-bit inputs only: the weights are the file's


def test_dequantized_import_writes_safetensors(gguf_model, tmp_path):
    _, reference, root = gguf_model
    out = import_gguf(root / "tiny.gguf", tmp_path / "float", progress=False, dequantize=True)
    assert not (out / "model.gguf").exists()
    ids = [5, 17, 33]
    torch.testing.assert_close(engine_for(out).prompt_logits(ids), engine_for(reference).prompt_logits(ids),
                               atol=1e-5, rtol=1e-5)
