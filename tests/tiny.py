"""Tiny random checkpoints written by `transformers` itself, with a real trained BPE tokenizer.

Every test model is a real Hugging Face folder: config.json, model.safetensors, tokenizer.json,
tokenizer_config.json (with a ChatML template) and generation_config.json.
"""

from __future__ import annotations

import json
from pathlib import Path

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
    """A random model of `kind` ("llama" or "qwen2") saved as safetensors; returns `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

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
    config_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if kind == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**settings)).eval()
    model.save_pretrained(path, safe_serialization=True)
    return path
