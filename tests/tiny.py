"""Tiny random checkpoints written by `transformers` itself, with a real trained BPE tokenizer.

Every test model is a real Hugging Face folder: config.json, model.safetensors, tokenizer.json,
tokenizer_config.json (with a ChatML template) and generation_config.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Once upon a time there was a small model that served tokens over HTTP.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "Café, naïve, résumé, Ångström, 東京, Москва, emoji 🙂🚀 and more text.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "    indented    whitespace\truns\n\n\nand newlines",
]


def train_tokenizer(vocab_size: int = 400) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
    return tokenizer


def write_tokenizer(path: Path, tokenizer: Tokenizer) -> None:
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>",
        "chat_template": CHATML, "add_bos_token": False,
    }))


def write_model(path: Path, kind: str = "llama", seed: int = 0, vocab_size: int | None = None, **overrides) -> Path:
    """A random model of `kind` ("llama", "qwen2", "qwen3" or "gemma3") saved as safetensors; returns `path`.

    Qwen3's and Gemma 3's norms are random too (transformers starts them at the identity), so that a norm applied
    as w where the model means 1 + w, or left out, shows in the logits.
    """
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    write_tokenizer(path, tokenizer)
    settings = dict(
        vocab_size=vocab_size or tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.1,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    settings.update(overrides)
    prefix = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma3": "Gemma3"}[kind]
    config_cls = getattr(transformers, f"{prefix}TextConfig" if kind == "gemma3" else f"{prefix}Config")
    model_cls = getattr(transformers, f"{prefix}ForCausalLM")
    torch.manual_seed(seed)
    model = model_cls(config_cls(**settings)).eval()
    if kind in ("qwen3", "gemma3"):
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith("norm.weight"):
                    parameter.normal_(0.0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    return path


GGUF_NAMES = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
GEMMA3_NAMES = GGUF_NAMES | {"post_attention_layernorm": "post_attention_norm",
                             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def write_gguf_model(src: Path, out_path: Path, family: str, vocabulary=None, matrix_type=None) -> None:
    """The folder's Qwen3 or Gemma 3 model as an F32 GGUF, as llama.cpp's converter writes them (Gemma's norms + 1),
    with the folder's BPE vocabulary, or what vocabulary(writer) writes; matrix_type: the matrices' type instead
    (Q8_0, Q4_0: the gguf library's own quantizers)."""
    from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType
    from gguf.quants import quantize
    from safetensors.torch import load_file

    config = json.loads((src / "config.json").read_text())
    writer = GGUFWriter(str(out_path), family)
    add_shape(writer, config)
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    if family == "gemma3":
        rope = config["rope_parameters"]
        writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["full_attention"]["factor"])
        writer.add_sliding_window(config["sliding_window"])
        writer.add_array(f"{family}.attention.sliding_window_pattern",
                         [t == "sliding_attention" for t in config["layer_types"]])
        writer.add_float32(f"{family}.rope.freq_base_swa", rope["sliding_attention"]["rope_theta"])
    else:
        writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    (vocabulary or (lambda w: add_bpe_vocabulary(w, src)))(writer)
    names = GEMMA3_NAMES if family == "gemma3" else GGUF_NAMES
    for name, tensor in load_file(src / "model.safetensors").items():
        array = tensor.float().numpy()
        if family == "gemma3" and name.endswith("norm.weight"):
            array = array + 1.0
        if matrix_type is not None and array.ndim == 2:
            writer.add_tensor(gguf_name(name, names), quantize(array, matrix_type), raw_dtype=matrix_type)
        else:
            writer.add_tensor(gguf_name(name, names), array, raw_dtype=GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_shape(writer, config: dict) -> None:
    """The model's sizes as llama.cpp's converter writes them."""
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])


def gguf_name(hf_name: str, names: dict[str, str] = GGUF_NAMES) -> str:
    """A Hugging Face tensor name as llama.cpp names it ("model.layers.3.mlp.up_proj.weight" -> "blk.3.ffn_up.weight")."""
    stem, kind = hf_name.rsplit(".", 1)
    if stem in names:
        return f"{names[stem]}.{kind}"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{names[rest]}.{kind}"


def add_bpe_vocabulary(writer, src: Path) -> None:
    """The folder's byte-level BPE tokenizer as GGUF metadata (`gpt2`), as llama.cpp's converter writes it."""
    tokenizer = json.loads((src / "tokenizer.json").read_text())
    vocab = sorted(tokenizer["model"]["vocab"].items(), key=lambda kv: kv[1])
    specials = {t["id"]: t["content"] for t in tokenizer["added_tokens"]}
    tokens = [specials.get(i, tok) for tok, i in vocab]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in specials else 1 for i in range(len(tokens))])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)


def quantize_q4_k(weight: np.ndarray) -> np.ndarray:
    """float32 (rows, in) -> GGUF's Q4_K blocks (rows, in // 256 · 144) uint8 (`super_blocks`)."""
    return super_blocks(weight, 4)


def quantize_q5_k(weight: np.ndarray) -> np.ndarray:
    """float32 (rows, in) -> GGUF's Q5_K blocks (rows, in // 256 · 176) uint8 (`super_blocks`)."""
    return super_blocks(weight, 5)


def super_blocks(weight: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K or Q5_K blocks as llama.cpp lays them out (the gguf library reads them but does not write them): per
    group of 32 the min/max codes, their scales and minimums in 6 bits of the super-block's d and dmin."""
    rows, in_features = weight.shape
    top = 2**bits - 1
    groups = weight.reshape(rows, in_features // 256, 8, 32).astype(np.float32)
    low = np.minimum(groups.min(-1), 0)  # (rows, blocks, 8): the minimum is −dmin·mn <= 0
    step = np.maximum((groups.max(-1) - low) / top, 1e-8)
    d = np.maximum(step.max(-1) / 63, 1e-6).astype(np.float16)  # (rows, blocks); not 0 in float16
    dmin = np.maximum(-low.min(-1) / 63, 1e-6).astype(np.float16)
    sc = np.clip(np.rint(step / d[..., None].astype(np.float32)), 1, 63).astype(np.uint8)
    mn = np.clip(np.rint(-low / dmin[..., None].astype(np.float32)), 0, 63).astype(np.uint8)
    scale = d[..., None].astype(np.float32) * sc
    minimum = dmin[..., None].astype(np.float32) * mn
    q = np.clip(np.rint((groups + minimum[..., None]) / scale[..., None]), 0, top).astype(np.uint8)  # (rows, blocks, 8, 32)
    packed = np.empty((rows, in_features // 256, 12), dtype=np.uint8)  # llama.cpp's get_scale_min_k4, inverted
    packed[..., 0:4] = sc[..., 0:4] | ((sc[..., 4:8] >> 4) << 6)
    packed[..., 4:8] = mn[..., 0:4] | ((mn[..., 4:8] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:8] & 15) | ((mn[..., 4:8] & 15) << 4)
    pairs = (q & 15).reshape(rows, in_features // 256, 4, 2, 32)  # (.., 64 inputs, group in it, 32): low, high nibble
    qs = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(rows, -1, 128)
    parts = [d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), packed]
    if bits == 5:  # byte l of qh: bit g the fifth bit of group g's input l
        parts.append(((q >> 4) << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=2, dtype=np.uint8))
    return np.concatenate(parts + [qs], axis=-1).reshape(rows, -1)


def quantize_q6_k(weight: np.ndarray) -> np.ndarray:
    """float32 (rows, in) -> GGUF's Q6_K blocks (rows, in // 256 · 210) uint8, as llama.cpp lays them out: per 16
    inputs a symmetric 6-bit scale in int8 steps of the super-block's d."""
    rows, in_features = weight.shape
    subs = weight.reshape(rows, in_features // 256, 16, 16).astype(np.float32)
    step = np.maximum(np.abs(subs).max(-1) / 31, 1e-8)  # (rows, blocks, 16): q − 32 in [−32, 31]
    d = np.maximum(step.max(-1) / 127, 1e-6).astype(np.float16)
    sc = np.clip(np.rint(step / d[..., None].astype(np.float32)), 1, 127).astype(np.int8)
    scale = d[..., None].astype(np.float32) * sc
    q = (np.clip(np.rint(subs / scale[..., None]), -32, 31) + 32).astype(np.uint8).reshape(rows, -1, 2, 4, 32)
    low, high = q & 15, q >> 4  # (rows, blocks, half, quarter, 32)
    ql = np.concatenate([low[:, :, :, 0] | (low[:, :, :, 2] << 4), low[:, :, :, 1] | (low[:, :, :, 3] << 4)], axis=-1)
    qh = high[:, :, :, 0] | (high[:, :, :, 1] << 2) | (high[:, :, :, 2] << 4) | (high[:, :, :, 3] << 6)
    blocks = np.concatenate([ql.reshape(rows, -1, 128), qh.reshape(rows, -1, 64), sc.view(np.uint8),
                             d[..., None].view(np.uint8)], axis=-1)
    return blocks.reshape(rows, -1)
