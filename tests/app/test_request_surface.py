"""The OpenAI request fields beyond the plain chat path, through the official client against a real
builtin:tiny server: defaults always accepted, sampling fields, logprobs against transformers, n,
best_of, prompt lists, echo, continuous usage, /tokenize and /detokenize."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch
from openai.types.chat import ChatCompletionMessageParam

from gpu.tokenizer import ByteTokenizer
from tests.app.conftest import ServerThread
from tests.gpu.reference import hf_greedy, hf_logits

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Name three rivers of Europe, please."}]
GREEDY: dict[str, Any] = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture
def client(tiny_server: ServerThread) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture
def http(tiny_server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=tiny_server.base_url, timeout=60) as client:
        yield client


def prompt_ids(http: httpx.Client, messages: list[ChatCompletionMessageParam]) -> list[int]:
    response = http.post("/tokenize", json={"messages": messages})
    assert response.status_code == 200, response.text
    tokens: list[int] = response.json()["tokens"]
    return tokens


def test_fields_at_their_defaults_are_accepted(http: httpx.Client, tiny_server: ServerThread) -> None:
    """What clients that always send every field send (nulls and OpenAI's defaults)."""
    defaults = {"presence_penalty": 0, "frequency_penalty": 0, "logprobs": None, "response_format": None,
                "logit_bias": {}, "n": 1, "top_logprobs": None, "store": False, "parallel_tool_calls": True,
                "modalities": ["text"], "tools": None, "tool_choice": None, "metadata": {"k": "v"},
                "prediction": None, "audio": None, "reasoning_effort": None, "user": "u", "top_k": -1,
                "min_p": 0, "repetition_penalty": 1, "min_tokens": 0, "stop_token_ids": [],
                "stream_options": None, "skip_special_tokens": True, "prompt_cache_key": "k"}
    chat = http.post("/v1/chat/completions", json={"model": tiny_server.model_name, "messages": MESSAGES,
                                                   "max_tokens": 3, "response_format": {"type": "text"},
                                                   **{k: v for k, v in defaults.items() if k != "response_format"}})
    completion = http.post("/v1/completions", json={
        "model": tiny_server.model_name, "prompt": "hi", "max_tokens": 3, "presence_penalty": 0,
        "frequency_penalty": 0, "logprobs": None, "echo": False, "best_of": 1, "suffix": None, "n": 1})

    assert chat.status_code == 200, chat.text
    assert completion.status_code == 200, completion.text


def test_chat_logprobs_are_transformers_log_softmax(client: openai.OpenAI, http: httpx.Client,
                                                    tiny_server: ServerThread, tiny_reference: Any) -> None:
    prompt = prompt_ids(http, MESSAGES)
    tokens = hf_greedy(tiny_reference, prompt, 6)
    expected = torch.log_softmax(hf_logits(tiny_reference, prompt + tokens)[len(prompt) - 1:-1], dim=-1)

    whole = client.chat.completions.create(model=tiny_server.model_name, messages=MESSAGES, max_tokens=6,
                                           logprobs=True, top_logprobs=3, **GREEDY)
    streamed = client.chat.completions.create(model=tiny_server.model_name, messages=MESSAGES, max_tokens=6,
                                              logprobs=True, top_logprobs=3, stream=True, **GREEDY)
    streamed_entries = [entry for chunk in streamed if chunk.choices and chunk.choices[0].logprobs
                        for entry in chunk.choices[0].logprobs.content or []]

    assert whole.choices[0].logprobs is not None and whole.choices[0].logprobs.content is not None
    entries = whole.choices[0].logprobs.content
    assert len(entries) == 6
    for step, (entry, token) in enumerate(zip(entries, tokens, strict=True)):
        assert entry.logprob == pytest.approx(float(expected[step, token]), abs=1e-4)
        top = torch.topk(expected[step], 3).values.tolist()
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top, abs=1e-4)
    assert [e.logprob for e in streamed_entries] == pytest.approx([e.logprob for e in entries], abs=1e-6)
    assert [e.token for e in streamed_entries] == [e.token for e in entries]


def test_completions_logprobs_shape(client: openai.OpenAI, tiny_server: ServerThread) -> None:
    result = client.completions.create(model=tiny_server.model_name, prompt="The river", max_tokens=5,
                                       logprobs=2, **GREEDY)
    logprobs = result.choices[0].logprobs

    assert logprobs is not None and logprobs.tokens is not None and logprobs.top_logprobs is not None
    assert len(logprobs.tokens) == 5 and logprobs.token_logprobs is not None and len(logprobs.token_logprobs) == 5
    # The sampled token is always there too; tokens of the same text (random weights pick bytes that decode
    # to nothing) share one key in the legacy format, so an entry may hold fewer.
    assert all(1 <= len(top) <= 3 and token in top
               for token, top in zip(logprobs.tokens, logprobs.top_logprobs, strict=True))
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(5)]


def test_n_choices_share_the_prompt_and_usage_counts_it_once(client: openai.OpenAI,
                                                             tiny_server: ServerThread) -> None:
    one = client.chat.completions.create(model=tiny_server.model_name, messages=MESSAGES, max_tokens=5,
                                         extra_body={"ignore_eos": True})
    before = len(tiny_server.engine.submitted)
    three = client.chat.completions.create(model=tiny_server.model_name, messages=MESSAGES, max_tokens=5, n=3,
                                           temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    siblings = tiny_server.engine.submitted[before + 1:]

    assert [c.index for c in three.choices] == [0, 1, 2]
    assert len({c.message.content for c in three.choices}) > 1  # seed, seed + 1, seed + 2
    assert three.usage is not None and one.usage is not None
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 15
    block_size = tiny_server.context.settings.block_size
    assert len(siblings) == 2
    assert all(s.num_cached_tokens >= (s.num_prompt_tokens - 1) // block_size * block_size > 0 for s in siblings)


def test_n_choices_stream_interleaved_by_index(client: openai.OpenAI, tiny_server: ServerThread) -> None:
    chunks = list(client.completions.create(model=tiny_server.model_name, prompt="Rivers:", max_tokens=4, n=3,
                                            stream=True, stream_options={"include_usage": True}, **GREEDY))
    texts: dict[int, str] = defaultdict(str)
    finishes: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason

    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert texts[0] == texts[1] == texts[2]  # greedy: the same answer three times
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


def test_best_of_returns_n_and_bills_every_generation(client: openai.OpenAI, tiny_server: ServerThread) -> None:
    result = client.completions.create(model=tiny_server.model_name, prompt="Rivers:", max_tokens=4, best_of=3,
                                       temperature=1.0, seed=5, extra_body={"ignore_eos": True})

    assert [c.index for c in result.choices] == [0]
    assert result.choices[0].logprobs is None  # used to rank, not asked for
    assert result.usage is not None and result.usage.completion_tokens == 12


def test_a_prompt_list_and_token_ids_get_a_choice_each(client: openai.OpenAI, tiny_server: ServerThread) -> None:
    texts = client.completions.create(model=tiny_server.model_name, prompt=["Rhine", "Danube"], max_tokens=4,
                                      **GREEDY)
    ids = client.completions.create(model=tiny_server.model_name, prompt=[list(b"Rhine"), list(b"Danube")],
                                    max_tokens=4, **GREEDY)
    single = client.completions.create(model=tiny_server.model_name, prompt=list(b"Danube"), max_tokens=4, **GREEDY)

    assert [c.index for c in texts.choices] == [0, 1]
    assert [c.text for c in ids.choices] == [c.text for c in texts.choices]
    assert single.choices[0].text == texts.choices[1].text
    assert texts.usage is not None and texts.usage.prompt_tokens == len("Rhine") + len("Danube")


def test_echo_prepends_the_prompt(client: openai.OpenAI, tiny_server: ServerThread) -> None:
    plain = client.completions.create(model=tiny_server.model_name, prompt="Seine", max_tokens=4, **GREEDY)
    echoed = client.completions.create(model=tiny_server.model_name, prompt="Seine", max_tokens=4, echo=True,
                                       **GREEDY)
    streamed = client.completions.create(model=tiny_server.model_name, prompt="Seine", max_tokens=4, echo=True,
                                         stream=True, **GREEDY)

    assert echoed.choices[0].text == "Seine" + plain.choices[0].text
    assert "".join(c.choices[0].text for c in streamed if c.choices) == echoed.choices[0].text


def test_min_tokens_holds_off_eos_and_logit_bias_forces_it(client: openai.OpenAI, tiny_server: ServerThread) -> None:
    eos = str(ByteTokenizer.EOS)
    forced = client.completions.create(model=tiny_server.model_name, prompt="Po", max_tokens=20, temperature=0,
                                       logit_bias={eos: 100})
    held = client.completions.create(model=tiny_server.model_name, prompt="Po", max_tokens=20, temperature=0,
                                     logit_bias={eos: 100}, extra_body={"min_tokens": 5})

    assert forced.choices[0].finish_reason == "stop" and forced.usage is not None
    assert forced.usage.completion_tokens == 1
    assert held.choices[0].finish_reason == "stop" and held.usage is not None
    assert held.usage.completion_tokens == 6  # five tokens, then the EOS the bias forces


def test_stop_token_ids_end_the_output_without_showing_the_token(client: openai.OpenAI,
                                                                 tiny_server: ServerThread) -> None:
    plain = client.completions.create(model=tiny_server.model_name, prompt="Loire", max_tokens=8, **GREEDY)
    text = plain.choices[0].text
    cut = next(i for i, char in enumerate(text) if i > 0 and char.isascii() and char not in text[:i])
    stopped = client.completions.create(model=tiny_server.model_name, prompt="Loire", max_tokens=8, temperature=0,
                                        extra_body={"stop_token_ids": [ord(text[cut])], "ignore_eos": True})

    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[:cut]


def test_continuous_usage_stats_on_every_chunk(client: openai.OpenAI, tiny_server: ServerThread) -> None:
    options: Any = {"include_usage": True, "continuous_usage_stats": True}  # vLLM's field, unknown to the client
    chunks = list(client.chat.completions.create(model=tiny_server.model_name, messages=MESSAGES, max_tokens=5,
                                                 stream=True, stream_options=options, **GREEDY))
    counts = [chunk.usage.completion_tokens for chunk in chunks if chunk.usage is not None]

    assert len(counts) == len(chunks)
    assert counts == sorted(counts) and counts[-1] == 5


def test_a_tool_call_history_is_accepted(client: openai.OpenAI, tiny_server: ServerThread) -> None:
    history: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    result = client.chat.completions.create(model=tiny_server.model_name, messages=history, max_tokens=3)

    assert result.choices[0].message.role == "assistant"


def test_tokenize_detokenize_and_the_model_card(http: httpx.Client, tiny_server: ServerThread) -> None:
    tokenized = http.post("/tokenize", json={"prompt": "Tagus", "return_token_strs": True}).json()
    detokenized = http.post("/detokenize", json={"tokens": tokenized["tokens"]}).json()
    card = http.get(f"/v1/models/{tiny_server.model_name}").json()
    bad = http.post("/detokenize", json={"tokens": [10**9]})

    assert tokenized["tokens"] == list(b"Tagus") and tokenized["count"] == 5
    assert tokenized["token_strs"] == list("Tagus")
    assert detokenized == {"prompt": "Tagus"}
    assert card["max_model_len"] == tokenized["max_model_len"] == tiny_server.context.geometry.max_model_len
    assert card["root"] == "builtin:tiny" and card["parent"] is None
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_echo_with_logprobs_gives_the_prompts_log_probabilities(client: openai.OpenAI, tiny_server: ServerThread,
                                                                 tiny_reference: Any) -> None:
    prompt = "The Rhine flows north"  # byte tokens: one per character
    ids = list(prompt.encode())
    expected = torch.log_softmax(hf_logits(tiny_reference, ids), dim=-1)
    fields: Any = {"model": tiny_server.model_name, "prompt": prompt, "max_tokens": 3, "echo": True, "logprobs": 2,
                   **GREEDY}
    whole = [client.completions.create(**fields) for _ in range(2)]  # the second would find the prompt cached
    chunks = list(client.completions.create(stream=True, **fields))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]

    for result in whole:
        logprobs = result.choices[0].logprobs
        assert logprobs is not None and logprobs.tokens is not None and logprobs.token_logprobs is not None
        assert result.choices[0].text.startswith(prompt)
        assert "".join(logprobs.tokens[:len(ids)]) == prompt and len(logprobs.tokens) == len(ids) + 3
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs is not None
        assert logprobs.top_logprobs[0] is None
        for position in range(1, len(ids)):
            assert logprobs.token_logprobs[position] == pytest.approx(float(expected[position - 1, ids[position]]),
                                                                      abs=1e-4)
        assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(ids) + 3)]
    assert whole[0].choices[0].logprobs == whole[1].choices[0].logprobs
    tokens = [t for lp in streamed for t in lp.tokens or []]
    assert tokens == whole[0].choices[0].logprobs.tokens  # type: ignore[union-attr]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole[0].choices[0].text
