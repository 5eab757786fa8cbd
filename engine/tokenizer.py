"""Text <-> token ids with the `tokenizers` library, and streaming detokenization."""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from engine.chat_template import ChatTemplate


class Tokenizer:
    def __init__(self, backend: HFTokenizer, eos_token_ids: tuple[int, ...], bos_token: str | None = None,
                 chat_template: ChatTemplate | None = None, eos_token: str | None = None):
        self.backend = backend
        self.eos_token_ids = eos_token_ids
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.special_ids = frozenset(i for i, token in backend.get_added_tokens_decoder().items() if token.special)

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """Read `tokenizer.json`; special tokens, EOS ids and the chat template from the config files."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path}: no tokenizer.json (kvserve reads the fast-tokenizer file only)")
        backend = HFTokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        generation = _read_json(path / "generation_config.json")
        model_config = _read_json(path / "config.json")
        eos_token = _token_text(config.get("eos_token"))
        bos_token = _token_text(config.get("bos_token"))
        eos_ids: list[int] = []
        for source in (generation.get("eos_token_id"), model_config.get("eos_token_id")):
            eos_ids += source if isinstance(source, list) else [source] if isinstance(source, int) else []
        if eos_token is not None and backend.token_to_id(eos_token) is not None:
            eos_ids.append(backend.token_to_id(eos_token))
        template_text = _read_template(path, config)
        template = ChatTemplate(template_text, bos_token=bos_token or "", eos_token=eos_token or "") if template_text else None
        return cls(backend, tuple(dict.fromkeys(eos_ids)), bos_token, template, eos_token)

    @cached_property
    def max_token_chars(self) -> int:
        """The longest token's text, in characters (byte-level tokens: in bytes, which is no fewer)."""
        return max(map(len, self.backend.get_vocab(with_added_tokens=True)))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """As `tokenizer(text)` in transformers: the post-processor adds BOS where the checkpoint says so."""
        return self.encoding(text, add_special_tokens).ids

    def encoding(self, text: str, add_special_tokens: bool = True):
        """The backend's Encoding (ids, offsets). Through `encode_batch`, which releases the GIL while it works
        (`encode` holds it: a megabyte of text would stop every other thread for most of a second)."""
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text on its own, special tokens included; part of a UTF-8 character decodes to U+FFFD."""
        return self.backend.decode([token_id], skip_special_tokens=False)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise ValueError("this model has no chat template; use the completions routes")
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt)


class IncrementalDetokenizer:
    """Text for each new token such that the pieces concatenate to `decode(all ids)`.

    A token can end inside a UTF-8 character, and some tokenizers change a token's text by
    its neighbours (leading spaces), so each piece is the difference between decoding a short
    window with and without the newest tokens, held back while it ends in a broken character.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: tokens before it are never decoded again
        self.read_offset = 0  # tokens before it have been emitted as text
        self.text = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        piece = new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += piece
        return piece

    def flush(self) -> str:
        """Whatever was held back (an unfinished character at the very end)."""
        full = self.tokenizer.decode(self.ids)
        piece = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += piece
        self.read_offset = self.prefix_offset = len(self.ids)
        return piece


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # older configs store AddedToken dicts
        return value.get("content")
    return value


def _read_template(path: Path, config: dict) -> str | None:
    # transformers 5.x writes chat_template.jinja; older folders keep it in tokenizer_config.json,
    # either as a string or as a list of named templates.
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template}
        return named.get("default") or next(iter(named.values()), None)
    return template
