"""GGUF files whose tokenizer is SentencePiece (`tokenizer.ggml.model = "llama"`: Llama 2, Mistral, TinyLlama, Gemma).

A SentencePiece BPE model with byte fallback is trained here on a few sentences, written into a GGUF as llama.cpp's
converter writes one (pieces, scores, piece types), and read back by kvserve; the oracle is transformers'
tokenizer of the same `tokenizer.model` (LlamaTokenizer with its space prefix, GemmaTokenizer without).
"""

from __future__ import annotations

import shutil

import httpx
import pytest

from tests.server_harness import serve
from tests.tiny import CORPUS, write_gguf_model, write_model
from weights.gguf_file import GGUFFile, import_gguf
from weights.sentencepiece import BYTE, CONTROL, NORMAL, UNKNOWN, UNUSED

TEXTS = [
    "Hello world", "The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.",
    "Café, naïve, résumé, Ångström, 東京, Москва", "emoji 🙂🚀 and 日本語のテキスト (bytes: not in the vocabulary)",
    "  two leading spaces", "a  b   c    d\t\te", "tabs\tand\nnewlines\n\n\nend", "trailing  ", " ", "",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
]
STYLES = {"llama": True, "gemma": False}
TURNS = ("{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
         "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")  # style -> the space prefix SentencePiece adds (add_dummy_prefix)


@pytest.fixture(scope="module")
def sentencepiece_models(tmp_path_factory):
    """style -> (the trained tokenizer.model's folder, its GGUF vocabulary writer)."""
    import sentencepiece

    root = tmp_path_factory.mktemp("spm")
    made = {}
    for style, prefix in STYLES.items():
        folder = root / style
        folder.mkdir()
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(CORPUS * 4), model_prefix=str(folder / "tokenizer"), vocab_size=400,
            model_type="bpe", byte_fallback=True, add_dummy_prefix=prefix, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
            control_symbols=["<start_of_turn>", "<end_of_turn>"], character_coverage=0.995,
            remove_extra_whitespaces=False, normalization_rule_name="identity", minloglevel=2)
        processor = sentencepiece.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
        made[style] = folder, vocabulary_writer(processor, prefix)
    return made


def vocabulary_writer(processor, space_prefix: bool):
    """What llama.cpp's converter writes of a SentencePiece model."""
    size = processor.get_piece_size()

    def kind(i: int) -> int:
        for test, value in ((processor.is_unknown, UNKNOWN), (processor.is_control, CONTROL),
                            (processor.is_unused, UNUSED), (processor.is_byte, BYTE)):
            if test(i):
                return value
        return NORMAL

    def write(writer) -> None:
        writer.add_tokenizer_model("llama")
        writer.add_token_list([processor.id_to_piece(i) for i in range(size)])
        writer.add_token_scores([processor.get_score(i) for i in range(size)])
        writer.add_token_types([kind(i) for i in range(size)])
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_add_bos_token(True)
        writer.add_add_space_prefix(space_prefix)
        writer.add_chat_template(TURNS)

    return write


def reference_tokenizer(style: str, folder):
    from transformers import GemmaTokenizer, LlamaTokenizer

    if style == "llama":
        return LlamaTokenizer.from_pretrained(folder, add_bos_token=True, legacy=False)
    return GemmaTokenizer.from_pretrained(folder, add_bos_token=True, bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("style", sorted(STYLES))
def test_a_sentencepiece_gguf_tokenizes_as_transformers(style, sentencepiece_models, tmp_path):
    from gguf import GGUFWriter

    folder, write_vocabulary = sentencepiece_models[style]
    writer = GGUFWriter(str(tmp_path / "vocabulary.gguf"), "llama")
    write_vocabulary(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours, theirs = GGUFFile(tmp_path / "vocabulary.gguf").tokenizer(), reference_tokenizer(style, folder)
    assert ours.get_vocab_size() == theirs.vocab_size == 400
    for text in TEXTS:
        ids = theirs(text)["input_ids"]
        assert ours.encode(text).ids == ids, text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    fallback = ours.encode("🙂").tokens
    assert fallback[-4:] == ["<0xF0>", "<0x9F>", "<0x99>", "<0x82>"]  # not in the vocabulary: its UTF-8 bytes


@pytest.mark.parametrize("style", sorted(STYLES))
def test_the_server_tokenizes_and_detokenizes_a_sentencepiece_model(style, sentencepiece_models, tmp_path):
    folder, write_vocabulary = sentencepiece_models[style]
    model = write_model(tmp_path / "model", kind="qwen3", vocab_size=400)
    write_gguf_model(model, tmp_path / "model.gguf", "qwen3", vocabulary=write_vocabulary)
    imported = import_gguf(tmp_path / "model.gguf", tmp_path / "imported", progress=False)
    shutil.rmtree(model)
    theirs = reference_tokenizer(style, folder)
    text = TEXTS[3] + "\n" + TEXTS[4]
    with serve(imported, max_seq_len=256) as server:
        tokens = httpx.post(f"{server.url}/tokenize", json={"inputs": text}).json()
        assert [t["id"] for t in tokens] == theirs(text)["input_ids"]
        ids = [t["id"] for t in tokens]
        back = httpx.post(f"{server.url}/detokenize", json={"tokens": ids, "skip_special_tokens": True}).json()
        assert back == {"prompt": text}
        wrong = httpx.post(f"{server.url}/detokenize", json={"tokens": [400]})
        assert wrong.status_code == 422 and "[0, 400)" in wrong.json()["error"]
        reply = httpx.post(f"{server.url}/generate", json={"inputs": text, "parameters": {"max_new_tokens": 4}})
        assert reply.status_code == 200 and isinstance(reply.json()["generated_text"], str)
    # A chat is tokenized as its whole rendering (as transformers tokenizes it), not piece by piece: SentencePiece
    # would begin every piece with a space mark.
    from engine.tokenizer import Tokenizer

    messages = [{"role": "user", "content": "Hello  world, how are you?"}, {"role": "model", "content": TEXTS[3]}]
    tokenizer = Tokenizer.from_dir(imported)
    assert tokenizer.eos_token_ids == (2, 4)  # </s>, and <end_of_turn> (a control token that ends a turn)
    rendered = tokenizer.render_chat(messages)
    assert rendered.startswith("<start_of_turn>user\nHello  world")
    assert tokenizer.encode_chat(messages) == theirs(rendered, add_special_tokens=False)["input_ids"]
