"""Reads a GGUF file (llama.cpp's format) into a Hugging Face style folder, with the `gguf` library.

What a GGUF holds and how it maps:
- tensors, possibly quantized: dequantized to float32 (exact for every block format), renamed to
  Hugging Face names, and, for the `llama` architecture, q/k rows un-permuted: llama.cpp's converter
  interleaves each head's two RoPE halves, while kvserve (and transformers) use the half-split layout;
- `{arch}.*` metadata: the model config;
- `tokenizer.ggml.*`: a byte-level BPE vocabulary, merges and pre-tokenizer name, rebuilt for the
  `tokenizers` library; special tokens and the chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from tqdm import tqdm

SUPPORTED_TYPES = {
    GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K,
}
ARCHITECTURES = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM")}
TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 3, 4

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.").
LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# Pre-tokenizer splits by `tokenizer.ggml.pre`, as the models' own tokenizer.json files define them.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
REGEX_SPLITS = {"llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT, "llama-v3": LLAMA3_SPLIT, "smaug-bpe": LLAMA3_SPLIT,
                "qwen2": QWEN2_SPLIT, "deepseek-r1-qwen": QWEN2_SPLIT}


class GGUFError(ValueError):
    """A GGUF file kvserve cannot import; the message names the key, tensor or type."""


class GGUFFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.reader = GGUFReader(str(self.path))
        self.arch = self.value("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise GGUFError(f"{self.path.name}: architecture {self.arch!r} is not supported "
                            f"(supported: {', '.join(ARCHITECTURES)})")

    def value(self, key: str, default=None):
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def need(self, key: str):
        value = self.value(key)
        if value is None:
            raise GGUFError(f"{self.path.name}: missing metadata key {key!r}")
        return value

    # ---- config -----------------------------------------------------------------------------

    def hf_config(self) -> dict:
        a = self.arch
        tensor_names = {t.name for t in self.reader.tensors}
        if "rope_freqs.weight" in tensor_names:
            raise GGUFError(f"{self.path.name}: per-frequency RoPE factors (rope_freqs) are not supported; "
                            "load the Hugging Face folder of this model instead")
        heads = int(self.need(f"{a}.attention.head_count"))
        hidden = int(self.need(f"{a}.embedding_length"))
        model_type, architecture = ARCHITECTURES[a]
        config = {
            "architectures": [architecture],
            "model_type": model_type,
            "vocab_size": int(self.value(f"{a}.vocab_size") or len(self.need("tokenizer.ggml.tokens"))),
            "hidden_size": hidden,
            "intermediate_size": int(self.need(f"{a}.feed_forward_length")),
            "num_hidden_layers": int(self.need(f"{a}.block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.value(f"{a}.attention.head_count_kv") or heads),
            "head_dim": int(self.value(f"{a}.attention.key_length") or hidden // heads),
            # Stored as float32 (9.9999997e-06 for 1e-5): keep the decimal the model was made with.
            "rms_norm_eps": float(f"{float(self.need(f'{a}.attention.layer_norm_rms_epsilon')):.7g}"),
            "max_position_embeddings": int(self.need(f"{a}.context_length")),
            "tie_word_embeddings": "output.weight" not in tensor_names,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        theta = float(self.value(f"{a}.rope.freq_base", 10000.0))
        rope = {"rope_type": "default", "rope_theta": theta}
        if self.value(f"{a}.rope.scaling.type") == "linear":
            rope = {"rope_type": "linear", "factor": float(self.need(f"{a}.rope.scaling.factor")), "rope_theta": theta}
        elif self.value(f"{a}.rope.scaling.type") not in (None, "none"):
            raise GGUFError(f"{self.path.name}: rope scaling {self.value(f'{a}.rope.scaling.type')!r} is not supported")
        config["rope_parameters"] = rope
        config["rope_theta"] = theta  # transformers 4.x reads this one
        if model_type == "llama":
            config["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
        for name, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"), ("pad_token_id", "padding_token_id")):
            if self.value(f"tokenizer.ggml.{key}") is not None:
                config[name] = int(self.value(f"tokenizer.ggml.{key}"))
        return config

    # ---- tensors ----------------------------------------------------------------------------

    def check_types(self) -> None:
        for t in self.reader.tensors:
            if t.tensor_type not in SUPPORTED_TYPES:
                raise GGUFError(f"{self.path.name}: tensor {t.name} has quantization type {t.tensor_type.name}, "
                                f"which kvserve does not read (supported: {', '.join(sorted(q.name for q in SUPPORTED_TYPES))})")

    def tensors(self, progress: bool = True) -> dict[str, torch.Tensor]:
        self.check_types()
        config = self.hf_config()
        out: dict[str, torch.Tensor] = {}
        for t in tqdm(self.reader.tensors, desc="dequantizing", unit="tensor", disable=not progress):
            name = self.hf_name(t.name)
            shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF lists the fastest axis first
            if t.tensor_type == GGMLQuantizationType.BF16:
                array = (np.asarray(t.data).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
            else:
                array = dequantize(np.asarray(t.data), t.tensor_type)
            tensor = torch.from_numpy(np.array(array, dtype=np.float32).reshape(shape))  # a writable copy
            if self.arch == "llama" and t.name.endswith(("attn_q.weight", "attn_q.bias")):
                tensor = unpermute_rope_rows(tensor, config["num_attention_heads"])
            elif self.arch == "llama" and t.name.endswith(("attn_k.weight", "attn_k.bias")):
                tensor = unpermute_rope_rows(tensor, config["num_key_value_heads"])
            out[name] = tensor
        return out

    def hf_name(self, name: str) -> str:
        stem, _, kind = name.rpartition(".")
        if stem in GLOBAL_TENSORS:
            return f"{GLOBAL_TENSORS[stem]}.{kind}"
        parts = stem.split(".")
        if len(parts) == 3 and parts[0] == "blk" and parts[2] in LAYER_TENSORS:
            return f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}.{kind}"
        raise GGUFError(f"{self.path.name}: unexpected tensor {name}")

    # ---- tokenizer --------------------------------------------------------------------------

    def tokenizer(self) -> Tokenizer:
        kind = self.value("tokenizer.ggml.model")
        if kind != "gpt2":
            raise GGUFError(f"{self.path.name}: tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' is)")
        tokens = list(self.need("tokenizer.ggml.tokens"))
        merges = [tuple(m.split(" ", 1)) for m in self.need("tokenizer.ggml.merges")]
        token_types = list(self.value("tokenizer.ggml.token_type") or [])
        tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                         ignore_merges=False))
        tokenizer.pre_tokenizer = self._pre_tokenizer()
        tokenizer.decoder = decoders.ByteLevel()
        special = [AddedToken(t, special=True, normalized=False)
                   for t, kind in zip(tokens, token_types) if kind == TOKEN_TYPE_CONTROL]
        user = [AddedToken(t, special=False, normalized=False)
                for t, kind in zip(tokens, token_types) if kind == TOKEN_TYPE_USER_DEFINED]
        tokenizer.add_special_tokens(special)
        tokenizer.add_tokens(user)
        bos_id = self.value("tokenizer.ggml.bos_token_id")
        if self.value("tokenizer.ggml.add_bos_token", False) and bos_id is not None:
            bos = tokens[int(bos_id)]
            tokenizer.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, int(bos_id))])
        else:
            tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
        return tokenizer

    def _pre_tokenizer(self):
        pre = self.value("tokenizer.ggml.pre", "default")
        if pre in REGEX_SPLITS:
            return pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(REGEX_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre == "smollm":  # SmolLM's own tokenizer.json: every digit on its own, then GPT-2's split
            return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        return byte_level

    def tokenizer_config(self) -> dict:
        tokens = self.need("tokenizer.ggml.tokens")

        def token(key: str):
            index = self.value(f"tokenizer.ggml.{key}")
            return tokens[int(index)] if index is not None else None

        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
            "unk_token": token("unknown_token_id"), "pad_token": token("padding_token_id"),
            "add_bos_token": bool(self.value("tokenizer.ggml.add_bos_token", False)),
            "model_max_length": int(self.need(f"{self.arch}.context_length")),
            "clean_up_tokenization_spaces": False,
        }
        template = self.value("tokenizer.chat_template")
        if template:
            config["chat_template"] = template
        return {k: v for k, v in config.items() if v is not None}

    def generation_config(self) -> dict:
        config = {k: v for k, v in self.hf_config().items() if k.endswith("_token_id")}
        return config | {"do_sample": False}


def unpermute_rope_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: per head, rows (pair, 2) back to (2, pair) = half-split."""
    rows = weight.shape[0]
    return (weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])  # (heads, d/2, 2, ...)
            .transpose(1, 2)  # (heads, 2, d/2, ...): first halves, then second halves
            .reshape(weight.shape))


def import_gguf(gguf_path: str | Path, out_dir: str | Path, progress: bool = True) -> Path:
    """Write a Hugging Face style folder for a GGUF file; both kvserve and transformers load it."""
    source = GGUFFile(gguf_path)
    source.check_types()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = source.hf_config()
    tensors = source.tensors(progress=progress)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "source": Path(gguf_path).name})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    source.tokenizer().save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(source.tokenizer_config(), indent=2, ensure_ascii=False))
    (out / "generation_config.json").write_text(json.dumps(source.generation_config(), indent=2))
    return out
