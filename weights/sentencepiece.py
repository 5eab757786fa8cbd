"""A SentencePiece vocabulary as a GGUF stores it (`tokenizer.ggml.model = "llama"`), rebuilt for `tokenizers`.

SentencePiece's BPE models (Llama 2, Mistral, TinyLlama, Gemma) merge by the merged piece's rank; written
as a `tokenizers` BPE, the merges are every split of each piece into two pieces of the vocabulary, ranked
by the merged piece's id and then by the halves' ids: the tokenizer transformers builds from the same
`tokenizer.model`. Characters outside the vocabulary fall back to their UTF-8 bytes (`<0x41>` pieces).
Spaces are `▁`; a Llama-style vocabulary also puts one before the text (`add_space_prefix`), Gemma's not.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

# SentencePiece's piece types, as GGUF's tokenizer.ggml.token_type lists them
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "▁"


def merges(pieces: list[str]) -> list[tuple[str, str]]:
    """Every (left, right) whose concatenation is a piece, both halves pieces: by the merged piece's id, then the
    halves' ids."""
    ids = {piece: i for i, piece in enumerate(pieces)}
    found = []
    for merged, rank in ids.items():
        splits = [(merged[:k], merged[k:]) for k in range(1, len(merged))]
        found += sorted(((rank, ids[left], ids[right]), left, right) for left, right in splits
                        if left in ids and right in ids)
    found.sort(key=lambda item: (item[0][0], len(item[1]), len(item[2])))
    return [(left, right) for _, left, right in found]


def sentencepiece_tokenizer(pieces: list[str], types: list[int], unknown: str | None,
                            add_space_prefix: bool) -> Tokenizer:
    """The vocabulary as a `tokenizers` BPE with byte fallback; control pieces are special added tokens and
    user-defined ones plain added tokens (matched whole in text, as SentencePiece matches them)."""
    if len(types) != len(pieces):
        types = [NORMAL] * len(pieces)
    tokenizer = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=merges(pieces),
                                     unk_token=unknown, fuse_unk=True, byte_fallback=True))
    decoding = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:  # "▁" before the text's first piece, taken off again when decoding
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first", split=False)
        decoding.append(decoders.Strip(content=" ", left=1))
    else:
        tokenizer.normalizer = normalizers.Replace(" ", SPACE)
    tokenizer.decoder = decoders.Sequence(decoding)
    tokenizer.add_special_tokens([AddedToken(p, special=True, normalized=False)
                                  for p, kind in zip(pieces, types) if kind == CONTROL])
    tokenizer.add_tokens([AddedToken(p, special=False, normalized=False)
                          for p, kind in zip(pieces, types) if kind == USER_DEFINED])
    return tokenizer
