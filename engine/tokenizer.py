"""Text <-> token ids with the `tokenizers` library, and streaming detokenization."""

from __future__ import annotations

import json
import logging
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from engine.chat_template import ChatTemplate

log = logging.getLogger("kvserve.tokenizer")


class Tokenizer:
    def __init__(self, backend: HFTokenizer, eos_token_ids: tuple[int, ...], bos_token: str | None = None,
                 chat_template: ChatTemplate | None = None, eos_token: str | None = None):
        self.backend = backend
        self.eos_token_ids = eos_token_ids
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.special_ids = frozenset(i for i, token in backend.get_added_tokens_decoder().items() if token.special)
        # The same tokenizer reading special-token strings as plain text ("<|im_end|>" typed by a user): a
        # copy of its own, as the flag is the backend's state and encoding runs on several threads.
        self.text_backend = HFTokenizer.from_str(backend.to_str())
        self.text_backend.encode_special_tokens = True

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

    def reads_special(self, text: str) -> bool:
        """Whether the text holds a special token's text (as the tokenizer itself finds them)."""
        return any(i in self.special_ids for i in self.encoding(text, add_special_tokens=False).ids)

    @cached_property
    def max_token_chars(self) -> int:
        """The longest token's text, in characters (byte-level tokens: in bytes, which is no fewer)."""
        return max(map(len, self.backend.get_vocab(with_added_tokens=True)))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        """As `tokenizer(text)` in transformers: the post-processor adds BOS where the checkpoint says so.
        Without `parse_special`, special-token strings in the text are tokenized as the text they are."""
        return self.encoding(text, add_special_tokens, parse_special).ids

    def encoding(self, text: str, add_special_tokens: bool = True, parse_special: bool = True):
        """The backend's Encoding (ids, offsets). Through `encode_batch`, which releases the GIL while it works
        (`encode` holds it: a megabyte of text would stop every other thread for most of a second)."""
        backend = self.backend if parse_special else self.text_backend
        return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    def encode_chat(self, messages: list[dict], parse_special: bool = False, tools: list[dict] | None = None,
                    variables: dict | None = None) -> list[int]:
        """The chat template's rendering of `messages`, tokenized: the template's own markers as special tokens,
        and, without `parse_special`, the messages' text as text, so a user cannot type a turn of their own.
        `variables`: more of the template's variables (a request's chat_template_kwargs, e.g. enable_thinking).

        Each message's content is rendered as a placeholder, the rendering split there, and the pieces tokenized
        each by its own rule. A template that changes content beyond recognition gets the plain rendering.
        """
        contents = [m["content"] for m in messages if isinstance(m.get("content"), str)]
        if parse_special or not any(self.reads_special(text) for text in contents):
            # Nothing typed that could read as a marker: the whole rendering at once, as transformers tokenizes it
            # (tokenized piece by piece, SentencePiece would begin each piece as a new text, with its space mark).
            return self.encode(self.render_chat(messages, tools=tools, variables=variables), add_special_tokens=False)
        marks = [f"\x00{i}\x00" for i in range(len(messages))]
        marked = [m | {"content": mark} if isinstance(m.get("content"), str) else m for m, mark in zip(messages, marks)]
        rendered = self.render_chat(marked, tools=tools, variables=variables)
        pieces, ids = [], []
        for mark, message in zip(marks, marked):
            if message["content"] != mark:
                continue
            before, found, rendered = rendered.partition(mark)
            if not found or mark in rendered:  # dropped or repeated by the template
                log.warning("the chat template changes message content; special tokens typed in it stay special")
                return self.encode(self.render_chat(messages, tools=tools, variables=variables), add_special_tokens=False)
            pieces += [(before, True), (messages[marks.index(mark)]["content"], False)]
        for text, special in [*pieces, (rendered, True)]:
            if text:
                ids += self.encode(text, add_special_tokens=False, parse_special=special)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text on its own, special tokens included; part of a UTF-8 character decodes to U+FFFD."""
        return self.backend.decode([token_id], skip_special_tokens=False)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
                    variables: dict | None = None) -> str:
        """The chat template's text for `messages`; `tools` (OpenAI's tool objects) go to its `tools` variable,
        `variables` to variables of their own names (never over messages, tools or the template's own)."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template; use the completions routes")
        extra = dict(variables or {}) | ({} if tools is None else {"tools": tools})
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, **extra)

    @property
    def template_takes_tools(self) -> bool:
        """Whether the chat template renders a `tools` variable (else tools are offered in a system message)."""
        return self.chat_template is not None and self.chat_template.takes_tools


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
