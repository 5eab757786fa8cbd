"""Tokenizer files and streaming detokenization."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = ["Café naïve résumé", "東京 and Москва", "emoji 🙂🚀!", "    indented\n\n\ttabs", "def add(a, b):\n    return a + b"]


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    return Tokenizer.from_dir(tiny_dir)


def test_special_tokens_come_from_the_config_files(tokenizer):
    assert tokenizer.eos_token_ids == (2,)
    assert tokenizer.special_ids == {0, 1, 2}
    assert tokenizer.render_chat([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_pieces_concatenate_to_the_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(t) for t in ids] + [detok.flush()]
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)  # never half a character


def test_byte_tokens_of_one_character_are_held_back(tokenizer):
    # A 4-byte emoji split into single-byte tokens: nothing is emitted until the last byte.
    byte_ids = [tokenizer.backend.token_to_id(ch) for ch in "ðŁĻĤ"]  # byte-level spelling of 🙂
    assert None not in byte_ids
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.push(t) for t in byte_ids] == ["", "", "", "🙂"]


def test_generated_text_equals_the_stream(make_engine):
    engine = make_engine()
    pieces = []
    request = engine.add_request("emoji 🙂", SamplingParams(max_new_tokens=24, temperature=1.0, seed=3, ignore_eos=True))
    while not request.finished:
        pieces += [e.text for e in engine.step()]
    assert "".join(pieces) == request.text == engine.tokenizer.decode(request.output_ids)
