"""Reads a GGUF file (llama.cpp's format), with the `gguf` library.

What a GGUF holds and how it maps:
- tensors, possibly quantized, renamed to Hugging Face names: either dequantized to float32 (exact for
  every block format), or, for the matrices of a quantized file, kept as codes, as stored: Q4_0, Q4_1, Q5_0,
  Q5_1 and Q8_0 blocks as group codes, Q4_K and Q5_K as super-block codes, Q6_K as sub-block codes. Two converter edits are undone, so that
  a tensor means what it does in the Hugging Face checkpoint: for `llama`, q/k rows are un-permuted
  (llama.cpp interleaves each head's two RoPE halves; kvserve and transformers use the half-split
  layout); for `gemma3`, the 1 that llama.cpp adds to every norm weight is taken off again;
- `{arch}.*` metadata: the model config (architectures llama, qwen2, qwen3, gemma3);
- `tokenizer.ggml.*`: a byte-level BPE vocabulary (`gpt2`) or a SentencePiece one (`llama`: scores,
  byte-fallback tokens), rebuilt for the `tokenizers` library (weights/sentencepiece.py for the
  second); special tokens and the chat template.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as dequantize_blocks
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from tqdm import tqdm

from engine.linear.codes import QUANTIZED, GroupCodes, QuantizedWeight, SubBlockCodes, SuperBlockCodes
from weights.gguf_reader import GGUFFormatError, Reader
from weights.sentencepiece import sentencepiece_tokenizer

SUPPORTED_TYPES = {
    GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K,
}
FLOAT_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
WEIGHTS_NAME = "model.gguf"  # an imported folder's weights: the GGUF itself
ARCHITECTURES = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM"),
                 "qwen3": ("qwen3", "Qwen3ForCausalLM"), "gemma3": ("gemma3_text", "Gemma3ForCausalLM")}
TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 3, 4
# Control tokens that end a turn (Llama 3, ChatML, Phi-3, Gemma), as llama.cpp's vocabulary marks them end-of-generation
END_OF_TURN = frozenset({"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|end_of_text|>"})

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.").
LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
# Gemma 3's four norms: ffn_norm is the one before the MLP, two more follow the branches.
GEMMA3_LAYER_TENSORS = LAYER_TENSORS | {
    "ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
GEMMA3_SLIDING_PATTERN = 6  # llama.cpp's default: five sliding layers, then a global one
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# Pre-tokenizer splits by `tokenizer.ggml.pre`, as the models' own tokenizer.json files define them.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
REGEX_SPLITS = {"llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT, "llama-v3": LLAMA3_SPLIT, "smaug-bpe": LLAMA3_SPLIT,
                "qwen2": QWEN2_SPLIT, "deepseek-r1-qwen": QWEN2_SPLIT}


@dataclass(frozen=True)
class BlockLayout:
    """One GGUF block of 32 weights: a float16 scale (and minimum), then the codes."""

    block_bytes: int
    codes_from: int  # byte offset of the codes in the block (5-bit: of their fifth bits, a uint32, then the rest)
    bits: int
    offset: int  # a symmetric type's code for zero: w = scale·(q - offset)


STORED_BLOCKS = {
    GGMLQuantizationType.Q4_0: BlockLayout(block_bytes=18, codes_from=2, bits=4, offset=8),
    GGMLQuantizationType.Q4_1: BlockLayout(block_bytes=20, codes_from=4, bits=4, offset=0),
    GGMLQuantizationType.Q5_0: BlockLayout(block_bytes=22, codes_from=2, bits=5, offset=16),
    GGMLQuantizationType.Q5_1: BlockLayout(block_bytes=24, codes_from=4, bits=5, offset=0),
    GGMLQuantizationType.Q8_0: BlockLayout(block_bytes=34, codes_from=2, bits=8, offset=128),
}
MINIMUM_TYPES = {GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_1}  # w = d·q + m; the others d·(q − offset)


# float16 d and dmin, 12 bytes of 6-bit scales and minimums, (Q5_K: 32 bytes of fifth bits), 128 of 4-bit codes
K_QUANT_BLOCK_BYTES = {GGMLQuantizationType.Q4_K: 144, GGMLQuantizationType.Q5_K: 176}


def q5_k_codes(blocks: np.ndarray) -> SuperBlockCodes:
    """Q5_K blocks (rows, super-blocks, 176 bytes) as stored: Q4_K's (`q4_k_codes`) with 32 bytes of fifth bits
    before the codes, bit g of byte l the fifth bit of group g's input l."""
    rows, count, _ = blocks.shape
    four = q4_k_codes(np.concatenate([blocks[..., :16], blocks[..., 48:]], axis=-1))
    fifth = (blocks[..., 16:48][:, :, None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # (rows, blocks, group, 32)
    codes = four.codes | torch.from_numpy(np.ascontiguousarray(fifth).reshape(rows, -1)) << 4
    return dataclasses.replace(four, codes=codes, bits=5, served=("Q5_K as stored",))


def q4_k_codes(blocks: np.ndarray) -> SuperBlockCodes:
    """Q4_K blocks (rows, super-blocks, 144 bytes) as stored, unpacked: per super-block d and dmin, per group of 32
    its 6-bit sc and mn (llama.cpp's get_scale_min_k4: groups 0-3 in the low 6 bits of bytes 0-3 and 4-7, groups 4-7
    in bytes 8-11's nibbles with their top 2 bits in the top bits of bytes 0-7), per 64 inputs 32 bytes whose low
    nibbles are the first 32 codes and high nibbles the next 32."""
    rows, count, _ = blocks.shape
    half = lambda at: blocks[..., at:at + 2].copy().view(np.float16)[..., 0]  # (rows, blocks)
    packed = blocks[..., 4:16]
    sc = np.concatenate([packed[..., 0:4] & 63, (packed[..., 8:12] & 15) | ((packed[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([packed[..., 4:8] & 63, (packed[..., 8:12] >> 4) | ((packed[..., 4:8] >> 6) << 4)], axis=-1)
    qs = blocks[..., 16:].reshape(rows, count, 4, 1, 32)  # (rows, blocks, 64 inputs, nibble, 32)
    codes = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(rows, -1)
    torn = lambda a: torch.from_numpy(np.ascontiguousarray(a).reshape(rows, -1))
    return SuperBlockCodes(torn(codes), torn(sc), torn(mn), torn(half(0)), torn(half(2)), ("Q4_K as stored",))


Q6_K_BLOCK_BYTES = 210  # 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales, float16 d


def q6_k_codes(blocks: np.ndarray) -> SubBlockCodes:
    """Q6_K blocks (rows, super-blocks, 210 bytes) as stored, unpacked: in each half of 128 inputs, ql's first 32
    bytes hold inputs 0-31 (low nibbles) and 64-95 (high), the next 32 inputs 32-63 and 96-127; qh's byte l holds
    the high 2 bits of inputs l, l + 32, l + 64 and l + 96 (bits 0-1, 2-3, 4-5, 6-7); q = low | high << 4."""
    rows, count, _ = blocks.shape
    ql = blocks[..., :128].reshape(rows, count, 2, 2, 32)  # (rows, blocks, half, first or next 32 bytes, 32)
    qh = blocks[..., 128:192].reshape(rows, count, 2, 1, 32)
    low = np.concatenate([ql & 15, ql >> 4], axis=3)  # (rows, blocks, half, quarter, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3
    torn = lambda a: torch.from_numpy(np.ascontiguousarray(a).reshape(rows, -1))
    return SubBlockCodes(torn(low | high << 4), torn(blocks[..., 192:208].copy().view(np.int8)),
                         torn(blocks[..., 208:210].copy().view(np.float16)), ("Q6_K as stored",))


class GGUFError(ValueError):
    """A GGUF file kvserve cannot import; the message names the key, tensor or type."""


class GGUFFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self.reader = Reader(self.path)
        except (GGUFFormatError, struct.error, ValueError) as e:  # cut short, or not a GGUF at all
            raise GGUFError(f"{self.path.name}: cannot be read as a GGUF file ({e})") from None
        self.arch = self.value("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise GGUFError(f"{self.path.name}: architecture {self.arch!r} is not supported "
                            f"(supported: {', '.join(ARCHITECTURES)})")

    def value(self, key: str, default=None):
        return self.reader.fields.get(key, default)

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
        embedding = next((t for t in self.reader.tensors if t.name == "token_embd.weight"), None)
        config = {
            "architectures": [architecture],
            "model_type": model_type,
            # The embedding's rows (a converter may cut rows past the tokenizer's vocabulary, as Gemma's does)
            "vocab_size": int(embedding.shape[1]) if embedding is not None else int(
                self.value(f"{a}.vocab_size") or len(self.need("tokenizer.ggml.tokens"))),
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
        if a == "gemma3":
            config |= self._gemma3_config(config, rope)
        for name, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"), ("pad_token_id", "padding_token_id")):
            if self.value(f"tokenizer.ggml.{key}") is not None:
                config[name] = int(self.value(f"tokenizer.ggml.{key}"))
        return config

    def _gemma3_config(self, config: dict, rope: dict) -> dict:
        """Gemma 3's keys, as llama.cpp reads them: its sliding layers, their RoPE base, the attention scale."""
        layers = config["num_hidden_layers"]
        window = int(self.value("gemma3.attention.sliding_window") or 0)
        pattern = self.value("gemma3.attention.sliding_window_pattern", GEMMA3_SLIDING_PATTERN)
        if isinstance(pattern, list):  # one flag per layer
            sliding = [bool(p) for p in pattern][:layers]
        else:
            pattern = int(pattern)
            sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
        types = ["sliding_attention" if s and window > 0 else "full_attention" for s in sliding]
        # The 27B model (62 layers) scales scores by hidden/heads, the others by head_dim (llama.cpp, gemma_pytorch).
        scalar = config["hidden_size"] // config["num_attention_heads"] if layers == 62 else config["head_dim"]
        return {
            "layer_types": types, "sliding_window": window or None, "query_pre_attn_scalar": scalar,
            "hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh",
            "rope_parameters": {
                "full_attention": rope,
                "sliding_attention": {"rope_type": "default",
                                      "rope_theta": float(self.value("gemma3.rope.freq_base_swa", 10000.0))},
            },
            "rope_local_base_freq": float(self.value("gemma3.rope.freq_base_swa", 10000.0)),  # transformers 4.x
            "final_logit_softcapping": None, "attn_logit_softcapping": None,
        }

    # ---- tensors ----------------------------------------------------------------------------

    @property
    def quantized(self) -> bool:
        """Whether any matrix is stored in a block format rather than as floats."""
        return any(t.tensor_type not in FLOAT_TYPES and len(t.shape) == 2 for t in self.reader.tensors)

    def check_types(self) -> None:
        for t in self.reader.tensors:
            if t.tensor_type not in SUPPORTED_TYPES:
                raise GGUFError(f"{self.path.name}: tensor {t.name} has quantization type {t.tensor_type.name}, "
                                f"which kvserve does not read (supported: {', '.join(sorted(q.name for q in SUPPORTED_TYPES))})")

    def tensors(self, progress: bool = True, codes: bool = False) -> dict[str, torch.Tensor | QuantizedWeight]:
        """Hugging Face name -> float32 tensor; with `codes`, quantized matrices as their codes (`group_codes`).

        A tied model's quantized embedding is also the LM head: then "lm_head.weight" holds its codes and the
        embedding comes dense, as the form of the head the planner may pick for many rows (`Planner.embedding`
        then decides what the lookups read). An untied model's quantized embedding comes as its own codes.
        """
        self.check_types()
        config = self.hf_config()
        heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
        out: dict[str, torch.Tensor | QuantizedWeight] = {}
        for t in tqdm(self.reader.tensors, desc="reading weights", unit="tensor", disable=not progress):
            name = self.hf_name(t.name)
            quantized = codes and t.tensor_type not in FLOAT_TYPES and len(t.shape) == 2
            head_too = t.name == "token_embd.weight" and config["tie_word_embeddings"]
            value = self.group_codes(t) if quantized and not head_too else self.dense(t)
            if quantized and head_too:
                out["lm_head.weight"] = self.group_codes(t)
            stem = t.name.split(".")[-2]
            if self.arch == "llama" and stem in heads:
                reorder = functools.partial(unpermute_rope_rows, heads=heads[stem])
                value = value.map_rows(reorder) if isinstance(value, QUANTIZED) else reorder(value)
            if self.arch == "gemma3" and name.endswith("norm.weight"):  # stored as 1 + w, meant as w
                value = value - 1.0
            out[name] = value
        return out

    @staticmethod
    def dense(t) -> torch.Tensor:
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF lists the fastest axis first
        if t.tensor_type == GGMLQuantizationType.BF16:
            array = (np.asarray(t.data).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            array = dequantize_blocks(np.asarray(t.data), t.tensor_type)
        return torch.from_numpy(np.array(array, dtype=np.float32).reshape(shape))  # a writable copy

    @classmethod
    def group_codes(cls, t) -> QuantizedWeight:
        """A quantized matrix as kvserve holds it, as stored: Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 as group codes, Q4_K
        and Q5_K as super-block codes, Q6_K as sub-block codes."""
        if t.tensor_type in K_QUANT_BLOCK_BYTES:
            blocks = np.asarray(t.data).reshape(int(t.shape[1]), -1, K_QUANT_BLOCK_BYTES[t.tensor_type])
            return q4_k_codes(blocks) if t.tensor_type == GGMLQuantizationType.Q4_K else q5_k_codes(blocks)
        if t.tensor_type == GGMLQuantizationType.Q6_K:
            return q6_k_codes(np.asarray(t.data).reshape(int(t.shape[1]), -1, Q6_K_BLOCK_BYTES))
        if t.tensor_type not in STORED_BLOCKS:
            return GroupCodes.fit(cls.dense(t), 8, source=t.tensor_type.name)  # a block type with no layout here
        layout = STORED_BLOCKS[t.tensor_type]
        rows = int(t.shape[1])
        blocks = np.asarray(t.data).reshape(rows, -1, layout.block_bytes)  # (out, groups, bytes per block)
        scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # (out, groups)
        stored = blocks[..., layout.codes_from:]
        if layout.bits == 8:  # int8 codes, shifted to unsigned
            q = (stored.view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        else:  # byte j holds code j in its low nibble and code j + 16 in its high one; 5-bit: bit j of qh is code j's fifth
            nibbles = stored[..., 4:] if layout.bits == 5 else stored
            q = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1)  # (out, groups, 32)
            if layout.bits == 5:
                fifth = (stored[..., 0:4].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
                q |= fifth.astype(np.uint8) << 4
        if t.tensor_type in MINIMUM_TYPES:
            minimum = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        else:  # symmetric: w = d·(q - offset)
            minimum = -layout.offset * scale
        return GroupCodes(torch.from_numpy(np.ascontiguousarray(q).reshape(rows, -1)), torch.from_numpy(scale),
                          torch.from_numpy(np.ascontiguousarray(minimum)), layout.bits, (f"{t.tensor_type.name} as stored",))

    def hf_name(self, name: str) -> str:
        stem, _, kind = name.rpartition(".")
        if stem in GLOBAL_TENSORS:
            return f"{GLOBAL_TENSORS[stem]}.{kind}"
        parts = stem.split(".")
        layer_tensors = GEMMA3_LAYER_TENSORS if self.arch == "gemma3" else LAYER_TENSORS
        if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_tensors:
            return f"model.layers.{parts[1]}.{layer_tensors[parts[2]]}.{kind}"
        raise GGUFError(f"{self.path.name}: unexpected tensor {name}")

    # ---- tokenizer --------------------------------------------------------------------------

    def tokenizer(self) -> Tokenizer:
        kind = self.value("tokenizer.ggml.model")
        tokens = list(self.need("tokenizer.ggml.tokens"))
        token_types = list(self.value("tokenizer.ggml.token_type") or [])
        if kind == "llama":  # SentencePiece; llama.cpp prefixes a space unless the file says not to
            unknown = self.value("tokenizer.ggml.unknown_token_id")
            tokenizer = sentencepiece_tokenizer(tokens, token_types, tokens[int(unknown)] if unknown is not None else None,
                                                add_space_prefix=bool(self.value("tokenizer.ggml.add_space_prefix", True)))
        elif kind == "gpt2":
            tokenizer = self._byte_level_tokenizer(tokens, token_types)
        else:
            raise GGUFError(f"{self.path.name}: tokenizer model {kind!r} is not supported "
                            "(byte-level BPE 'gpt2' and SentencePiece 'llama' are)")
        self._add_bos(tokenizer, tokens, byte_level=kind == "gpt2")
        return tokenizer

    def _byte_level_tokenizer(self, tokens: list[str], token_types: list[int]) -> Tokenizer:
        merges = [tuple(m.split(" ", 1)) for m in self.need("tokenizer.ggml.merges")]
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
        return tokenizer

    def _add_bos(self, tokenizer: Tokenizer, tokens: list[str], byte_level: bool) -> None:
        """BOS before every encoded text where the file says so (llama.cpp's default for SentencePiece: yes)."""
        bos_id = self.value("tokenizer.ggml.bos_token_id")
        if self.adds_bos and bos_id is not None:
            bos = tokens[int(bos_id)]
            tokenizer.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, int(bos_id))])
        elif byte_level:
            tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)

    @property
    def adds_bos(self) -> bool:
        return bool(self.value("tokenizer.ggml.add_bos_token", self.value("tokenizer.ggml.model") == "llama"))

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
            "add_bos_token": self.adds_bos,
            "model_max_length": int(self.need(f"{self.arch}.context_length")),
            "clean_up_tokenization_spaces": False,
        }
        template = self.value("tokenizer.chat_template")
        if template:
            config["chat_template"] = template
        return {k: v for k, v in config.items() if v is not None}

    def generation_config(self) -> dict:
        config = {k: v for k, v in self.hf_config().items() if k.endswith("_token_id")}
        ends = self.end_of_turn_ids()
        if ends:
            config["eos_token_id"] = list(dict.fromkeys([config["eos_token_id"], *ends] if "eos_token_id" in config
                                                        else ends))
        return config | {"do_sample": False}

    def end_of_turn_ids(self) -> list[int]:
        """Control tokens that end a turn, which generation stops at as at EOS (an instruct model's `<end_of_turn>`
        or `<|eot_id|>` is not its file's eos_token_id): the file's eot/eom ids and, as llama.cpp finds them, the
        control tokens named so."""
        ids = [int(self.value(f"tokenizer.ggml.{key}_token_id")) for key in ("eot", "eom")
               if self.value(f"tokenizer.ggml.{key}_token_id") is not None]
        tokens, types = self.need("tokenizer.ggml.tokens"), self.value("tokenizer.ggml.token_type") or []
        return ids + [i for i, (text, kind) in enumerate(zip(tokens, types))
                      if kind == TOKEN_TYPE_CONTROL and text in END_OF_TURN]


def unpermute_rope_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: per head, rows (pair, 2) back to (2, pair) = half-split."""
    rows = weight.shape[0]
    return (weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])  # (heads, d/2, 2, ...)
            .transpose(1, 2)  # (heads, 2, d/2, ...): first halves, then second halves
            .reshape(weight.shape))


def import_gguf(gguf_path: str | Path, out_dir: str | Path, progress: bool = True, dequantize: bool = False) -> Path:
    """Write a Hugging Face style folder for a GGUF file: config, tokenizer files and the weights.

    The weights stay the GGUF itself (`model.gguf`, a hard link where the file system allows), which
    kvserve serves as stored and transformers reads with `gguf_file=`. With `dequantize`, they are
    written as float32 safetensors instead, for tools that read only those.
    """
    source = GGUFFile(gguf_path)
    source.check_types()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = source.hf_config()
    if dequantize:
        save_file(source.tensors(progress=progress), str(out / "model.safetensors"),
                  metadata={"format": "pt", "source": Path(gguf_path).name})
    else:
        link_or_copy(Path(gguf_path), out / WEIGHTS_NAME)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    source.tokenizer().save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(source.tokenizer_config(), indent=2, ensure_ascii=False))
    (out / "generation_config.json").write_text(json.dumps(source.generation_config(), indent=2))
    return out


def link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # another file system, or links not allowed
        shutil.copyfile(source, target)
