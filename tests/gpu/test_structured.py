"""Structured outputs: through the real engine, every constrained output parses, follows its schema
or regex and ends with EOS; unconstrained neighbours are untouched; a bad grammar is a ValueError
before submitting and ends only its own request inside the runner; no grammar state outlives its
request."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Literal

import jsonschema
import pytest
import torch

from benchmarks.fake_executors import RecordingExecutor
from contract.plan import SamplingParams, ScheduledSequence, StructuredOutput
from gpu.models import SMOLLM2_SPEC, LoadedModel, load_model
from gpu.runner import ModelRunner
from gpu.structured import GrammarCache, GrammarMatchers, TokenMasks, check, mask_offsets
from gpu.tokenizer import ByteTokenizer
from scheduling.engine import Engine
from scheduling.request import Request, TokenEvent
from scheduling.scheduler import SchedulerConfig
from tests.factories import (
    assert_kv_all_free,
    collect,
    make_engine,
    make_request,
    make_runner,
    running,
    tokens_of,
    wait_until,
)
from tests.gpu.reference import byte_prompt

EOS = ByteTokenizer.EOS
MAX_TOKENS = 400  # room for the longest schema below; each finishes well before with EOS


def obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, "additionalProperties": False}


# Lengths, item counts and ranges are bounded so that a random-weight model, which rambles, still
# closes every string, array and number well within MAX_TOKENS.
STRING = {"type": "string", "maxLength": 12}
INTEGER = {"type": "integer", "minimum": -50, "maximum": 1000}
NUMBER = {"type": "number", "minimum": 0, "maximum": 100, "multipleOf": 0.25}  # bounds the fraction too
BOOLEAN = {"type": "boolean"}
SCHEMAS: dict[str, dict[str, Any]] = {
    "string": obj({"name": STRING}),
    "integer": obj({"count": INTEGER}),
    "number": obj({"price": NUMBER}),
    "boolean": obj({"ok": BOOLEAN}),
    "enum": obj({"color": {"enum": ["red", "green", "blue"]}}),
    "mixed_enum": obj({"level": {"enum": [1, 2, "high", None, True]}}),
    "const": obj({"version": {"const": "v1"}, "n": INTEGER}),
    "array_of_strings": obj({"tags": {"type": "array", "items": STRING, "maxItems": 3}}),
    "array_min_items": obj({"ids": {"type": "array", "items": INTEGER, "minItems": 1, "maxItems": 4}}),
    "nested": obj({"user": obj({"id": INTEGER, "name": STRING})}),
    "deep": obj({"a": obj({"b": obj({"c": obj({"d": BOOLEAN})})})}),
    "array_of_objects": obj({"items": {"type": "array", "maxItems": 3,
                                       "items": obj({"sku": STRING, "qty": {"type": "integer", "minimum": 1,
                                                                            "maximum": 9}})}}),
    "person": obj({"name": STRING, "age": {"type": "integer", "minimum": 0, "maximum": 150}, "email": STRING,
                   "active": BOOLEAN}),
    "optional": obj({"id": INTEGER, "note": STRING, "flag": BOOLEAN}, required=["id"]),
    "nullable": obj({"middle": {"type": ["string", "null"], "maxLength": 8}, "n": INTEGER}),
    "any_of": obj({"value": {"anyOf": [INTEGER, STRING, BOOLEAN]}}),
    "pattern": obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}),
    "date_pattern": obj({"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}),
    "ref": {"$defs": {"point": obj({"x": INTEGER, "y": INTEGER})},
            **obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}})},
    "matrix": obj({"rows": {"type": "array", "maxItems": 3,
                            "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                      "maxItems": 3}}}),
    "min_length": obj({"word": {"type": "string", "minLength": 2, "maxLength": 6}}),
    "order": obj({"order_id": INTEGER, "status": {"enum": ["new", "paid", "shipped"]},
                  "lines": {"type": "array", "maxItems": 2,
                            "items": obj({"sku": STRING, "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                                          "price": NUMBER})},
                  "paid": BOOLEAN}),
    "unicode_enum": obj({"city": {"enum": ["Zürich", "São Paulo", "東京"]}}),
    "empty_object": {"type": "object", "properties": {}, "additionalProperties": False},
}
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=1.0, seed=11)


Kind = Literal["json_object", "json_schema", "regex"]


def structured(kind: Kind, spec: str = "") -> StructuredOutput:
    return StructuredOutput(kind, spec)


def schema_output(schema: dict[str, Any]) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(schema))


def constrained_request(prompt_offset: int, sampling: SamplingParams, output: StructuredOutput,
                        max_tokens: int = MAX_TOKENS, **changes: Any) -> Request:
    params = dataclasses.replace(sampling, structured=output, **changes)
    return make_request(byte_prompt(24, offset=prompt_offset), max_tokens, sampling=params,
                        stop_token_ids=ByteTokenizer().eos_token_ids)


def unconstrained_requests() -> list[Request]:
    """Greedy neighbours without a grammar (and without a stop token, so each runs its length)."""
    return [make_request(byte_prompt(20 + 7 * i, offset=200 + i), 30) for i in range(3)]


def runner_of(engine: Engine) -> ModelRunner:
    executor = engine.executor
    assert isinstance(executor, RecordingExecutor) and isinstance(executor.inner, ModelRunner)
    return executor.inner


async def run_batch(engine: Engine, requests: list[Request]) -> list[list[TokenEvent]]:
    results = await asyncio.gather(*(collect(engine.submit(request), timeout=120) for request in requests))
    assert await engine.wait_idle(timeout=10)
    assert_kv_all_free(engine)
    return list(results)


async def run_alone(loaded: LoadedModel, requests: list[Request]) -> list[list[TokenEvent]]:
    """The requests in an engine of their own, with room to spare."""
    engine = make_engine(loaded, num_blocks=512, block_size=8)
    async with running(engine):
        return await run_batch(engine, requests)


async def assert_matchers_dropped(engine: Engine) -> None:
    """The scheduler tells the runner which requests finished with its next plan; an engine with
    nothing else to run still sends one, with no sequences, for the last step's finished ids."""
    await wait_until(lambda: runner_of(engine).matchers.request_ids == frozenset(), what="the matchers to go")


def text_of(events: list[TokenEvent]) -> str:
    """The output before its final EOS, decoded; asserts that the output ended with EOS."""
    tokens = tokens_of(events)
    assert events[-1].finish_reason == "stop", (events[-1].finish_reason, ByteTokenizer().decode(tokens))
    assert tokens[-1] == EOS and EOS not in tokens[:-1]
    return ByteTokenizer().decode(tokens[:-1])


def assert_valid(events: list[TokenEvent], schema: dict[str, Any]) -> None:
    text = text_of(events)
    jsonschema.validate(json.loads(text), schema)


# ---- through the engine --------------------------------------------------------------------------

@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
async def test_json_schemas_hold_in_a_mixed_batch(tiny_model: LoadedModel, sampling: SamplingParams) -> None:
    names = sorted(SCHEMAS)
    constrained = [constrained_request(i, sampling, schema_output(SCHEMAS[name])) for i, name in enumerate(names)]
    plain = unconstrained_requests()
    alone = [tokens_of(events) for events in await run_alone(tiny_model, unconstrained_requests())]
    engine = make_engine(tiny_model, num_blocks=512, block_size=8)
    async with running(engine):
        results = await run_batch(engine, [*constrained[:12], *plain, *constrained[12:]])
        await assert_matchers_dropped(engine)
    for name, events in zip(names, [*results[:12], *results[15:]], strict=True):
        assert_valid(events, SCHEMAS[name])
    # Greedy rows without a grammar draw exactly what they draw alone.
    assert [tokens_of(events) for events in results[12:15]] == alone


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
async def test_json_object_gives_an_object(tiny_model: LoadedModel, sampling: SamplingParams) -> None:
    # Any JSON object bounds no string: a bias toward closing quotes and braces (applied before the
    # grammar's mask) lets the random model end its strings and objects within max_tokens.
    closing = ((ord('"'), 4.0), (ord("}"), 4.0), (ord("]"), 4.0))
    requests = [constrained_request(40 + i, sampling, structured("json_object"), logit_bias=closing,
                                    seed=i if sampling.seed else None) for i in range(4)]
    for events in await run_alone(tiny_model, requests):
        assert isinstance(json.loads(text_of(events)), dict)


REGEXES = (r"[A-Z][a-z]{2,8}-[0-9]{3}", r"(yes|no|maybe)", r"\d{4}-\d{2}-\d{2}", r"[a-f0-9]{8}",
           r"(\+|-)?[0-9]{1,3}(\.[0-9]{1,2})?", r"(ab|cd)+!")


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
async def test_regex_is_matched(tiny_model: LoadedModel, sampling: SamplingParams) -> None:
    requests = [constrained_request(60 + i, sampling, structured("regex", pattern), max_tokens=60)
                for i, pattern in enumerate(REGEXES)]
    for pattern, events in zip(REGEXES, await run_alone(tiny_model, requests), strict=True):
        assert re.fullmatch(pattern, text_of(events)), (pattern, text_of(events))


async def test_recompute_preemption_keeps_the_grammar_state(tiny_model: LoadedModel) -> None:
    """A request preempted by recompute keeps its id and output: its matcher goes on where it was,
    so the greedy output is the one it has without preemption."""
    def requests() -> list[Request]:
        return [constrained_request(80 + i, GREEDY, schema_output(SCHEMAS[name]), max_tokens=200)
                for i, name in enumerate(("order", "person", "array_of_objects", "matrix", "ref", "nested"))]

    roomy = await run_alone(tiny_model, requests())
    # 30 blocks of 8 tokens: each request fits alone (24 prompt tokens, at most 200 more), not all six
    # together.
    engine = make_engine(tiny_model, num_blocks=30, block_size=8, config=SchedulerConfig(preemption_mode="recompute"))
    tight_requests = requests()
    async with running(engine):
        tight = await run_batch(engine, tight_requests)
        assert engine.stats()["preemptions"]["recompute"] > 0
    assert any(request.num_preemptions > 0 and request.num_output_tokens > 1 for request in tight_requests)
    assert [tokens_of(events) for events in tight] == [tokens_of(events) for events in roomy]


async def test_min_tokens_gives_way_to_a_complete_grammar(tiny_model: LoadedModel) -> None:
    """min_tokens bans EOS, but once the grammar is complete EOS is all it allows: the grammar wins."""
    schema = SCHEMAS["boolean"]
    request = constrained_request(90, GREEDY, schema_output(schema), min_tokens=100, min_tokens_banned=(EOS,))
    [events] = await run_alone(tiny_model, [request])
    assert_valid(events, schema)
    assert len(tokens_of(events)) < 100


async def test_logprobs_are_the_models_raw_ones(tiny_model: LoadedModel) -> None:
    """The first token's logprobs do not depend on the grammar: the same prompt with and without one
    (the unconstrained request asks for the whole vocabulary)."""
    prompt = byte_prompt(24, offset=95)
    plain = make_request(prompt, 1, sampling=SamplingParams(logprobs=ByteTokenizer.VOCAB_SIZE))
    constrained = make_request(prompt, 1, sampling=SamplingParams(logprobs=5, structured=structured("regex", "Q+")))
    [plain_events, constrained_events] = await run_alone(tiny_model, [plain, constrained])
    [raw] = plain_events[0].logprobs
    [masked] = constrained_events[0].logprobs
    raw_of = dict(raw.top)
    assert masked.token_id == ord("Q") != raw.token_id
    assert masked.logprob == pytest.approx(raw_of[ord("Q")], abs=1e-5)
    assert [token for token, _ in masked.top] == [token for token, _ in raw.top[:5]]  # the model's, not the grammar's
    assert [value for _, value in masked.top] == pytest.approx([value for _, value in raw.top[:5]], abs=1e-5)


async def test_a_grammar_that_does_not_compile_ends_only_its_request(tiny_model: LoadedModel,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    bad = make_request(byte_prompt(10), 20, stop_token_ids=ByteTokenizer().eos_token_ids,
                       sampling=SamplingParams(structured=structured("json_schema", '{"type": "strin"}')))
    good = constrained_request(3, GREEDY, schema_output(SCHEMAS["enum"]))
    plain = unconstrained_requests()[0]
    engine = make_engine(tiny_model, num_blocks=256, block_size=8)
    async with running(engine):
        bad_events, good_events, plain_events = await run_batch(engine, [bad, good, plain])
        await assert_matchers_dropped(engine)
    assert tokens_of(bad_events) == [EOS] and bad_events[-1].finish_reason == "stop"
    assert "does not compile" in caplog.text
    assert_valid(good_events, SCHEMAS["enum"])
    assert len(tokens_of(plain_events)) == plain.max_tokens


# ---- the check the API layer calls ---------------------------------------------------------------

BAD_SPECS: list[tuple[Kind, str]] = [
    ("json_schema", '{"type": "strin"}'),
    ("json_schema", "not json"),
    ("json_schema", "[1, 2]"),
    ("json_schema", '{"type": "object", "properties": {"a": {"$ref": "#/nope"}}}'),
    ("json_schema", '{"type": "string", "format": "bogus"}'),
    ("json_schema", '{"type": "string", "pattern": "(("}'),
    ("json_schema", '{"type": "integer", "minimum": "x"}'),
    ("regex", "(("),
    ("regex", "[a-"),
    ("regex", "a{3,1}"),
    ("regex", "(?=a)b"),
]


@pytest.mark.parametrize(("kind", "spec"), BAD_SPECS)
def test_a_bad_spec_is_a_value_error(tiny_model: LoadedModel, kind: Kind, spec: str) -> None:
    grammars = GrammarCache(tiny_model.tokenizer, ByteTokenizer.VOCAB_SIZE)
    with pytest.raises(ValueError, match=f"invalid {kind.replace('_', ' ')}"):
        check(structured(kind, spec), grammars)
    assert len(grammars) == 0


def test_check_fills_a_bounded_cache(tiny_model: LoadedModel) -> None:
    grammars = GrammarCache(tiny_model.tokenizer, ByteTokenizer.VOCAB_SIZE, capacity=3)
    for name in ("string", "integer", "number", "boolean"):
        check(schema_output(SCHEMAS[name]), grammars)
    check(structured("json_object"), grammars)
    check(structured("regex", "a+"), grammars)
    assert len(grammars) == 3


def test_each_tenant_compiles_into_entries_of_its_own(tiny_model: LoadedModel) -> None:
    """A grammar another tenant compiled is no faster for this one: no timing tells it was sent."""
    grammars = GrammarCache(tiny_model.tokenizer, ByteTokenizer.VOCAB_SIZE)
    alice, bob = (dataclasses.replace(schema_output({"type": "integer"}), scope=scope) for scope in ("alice", "bob"))
    check(alice, grammars)
    check(alice, grammars)
    assert len(grammars) == 1
    check(bob, grammars)
    assert len(grammars) == 2


def test_the_runner_checks_into_its_own_cache(tiny_model: LoadedModel) -> None:
    runner = make_runner(tiny_model, num_blocks=8)
    runner.check_structured(schema_output(SCHEMAS["person"]))
    with pytest.raises(ValueError, match="invalid regex"):
        runner.check_structured(structured("regex", "(("))
    assert len(runner.grammars) == 1


# ---- the mask ------------------------------------------------------------------------------------

def test_mask_offsets_follow_the_bit_order() -> None:
    vocab = 70  # not a multiple of 32: the last word is partly padding
    allowed = [{0, 31, 32, 69}, set(range(0, 70, 3)), set()]
    words = torch.zeros(len(allowed), 3, dtype=torch.int64)
    for row, tokens in enumerate(allowed):
        for token in tokens:
            words[row, token // 32] |= 1 << (token % 32)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    offsets = mask_offsets(bitmask, vocab, torch.device("cpu"))
    assert offsets.shape == (3, vocab)
    for row, tokens in enumerate(allowed):
        assert {t for t in range(vocab) if offsets[row, t] == 0} == tokens
        assert all(offsets[row, t] == float("-inf") for t in range(vocab) if t not in tokens)


def test_constrain_leaves_the_raw_logits_and_other_rows_alone() -> None:
    raw = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    before = raw.clone()
    bitmask = torch.tensor([[0b1010, 0]], dtype=torch.int32)  # tokens 1 and 3
    masked = TokenMasks(bitmask, [1]).constrain(raw, raw)
    assert torch.equal(raw, before)
    assert torch.equal(masked[[0, 2]], raw[[0, 2]])
    assert torch.isfinite(masked[1]).nonzero()[:, 0].tolist() == [1, 3]
    assert torch.equal(masked[1, [1, 3]], raw[1, [1, 3]])


def sample_row(request_id: str, output: StructuredOutput | None) -> ScheduledSequence:
    return ScheduledSequence(request_id=request_id, token_ids=[0], start_position=0, block_table=(),
                             needs_sample=True, sampling=SamplingParams(structured=output))


def allowed_tokens(masks: TokenMasks | None, position: int) -> set[int]:
    assert masks is not None
    offsets = mask_offsets(masks.bitmask, ByteTokenizer.VOCAB_SIZE, torch.device("cpu"))
    return set(torch.isfinite(offsets[position]).nonzero()[:, 0].tolist())


def test_matchers_follow_their_rows_and_a_stray_token_leaves_only_eos(tiny_model: LoadedModel) -> None:
    matchers = GrammarMatchers(GrammarCache(tiny_model.tokenizer, ByteTokenizer.VOCAB_SIZE))
    plain, yes_no = sample_row("plain", None), sample_row("yes-no", structured("regex", "(yes|no)"))
    assert matchers.masks([plain]) is None  # nothing constrained, nothing computed
    assert allowed_tokens(matchers.masks([plain, yes_no]), 0) == {ord("y"), ord("n")}
    matchers.advance([plain, yes_no], [5, ord("y")])
    assert allowed_tokens(matchers.masks([yes_no]), 0) == {ord("e")}
    matchers.advance([yes_no], [ord("x")])  # outside the grammar: the sampler never draws it
    assert allowed_tokens(matchers.masks([yes_no]), 0) == {EOS}
    assert matchers.request_ids == {"yes-no"}
    matchers.forget(["yes-no"])
    assert matchers.request_ids == frozenset()


# ---- the default model ---------------------------------------------------------------------------

SMOLLM2_SCHEMAS = [
    obj({"city": {"type": "string", "maxLength": 40}, "country": {"type": "string", "maxLength": 40},
         # Without a step, a small model repeats a fraction digit forever.
         "population_millions": {"type": "number", "minimum": 0, "maximum": 100, "multipleOf": 0.5}}),
    obj({"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
         "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3}}),
    obj({"answer": {"enum": ["yes", "no"]}, "confidence": {"type": "integer", "minimum": 0, "maximum": 100}}),
]
SMOLLM2_QUESTIONS = ["Describe Paris as JSON.", "Describe a fictional person as JSON.",
                     "Is the Earth round? Answer as JSON."]


@pytest.mark.slow
async def test_smollm2_follows_schemas(model_cache_dir: Path) -> None:
    loaded = load_model(SMOLLM2_SPEC, device="cpu", dtype="float32", cache_dir=str(model_cache_dir))
    tokenizer = loaded.tokenizer
    requests = [make_request(tokenizer.encode_chat([{"role": "user", "content": question}]), 120,
                             stop_token_ids=tokenizer.eos_token_ids,
                             sampling=SamplingParams(temperature=temperature, seed=3, structured=schema_output(schema)))
                for schema, question in zip(SMOLLM2_SCHEMAS, SMOLLM2_QUESTIONS, strict=True)
                for temperature in (0.0, 0.7)]
    engine = make_engine(loaded, num_blocks=64, block_size=16)
    async with running(engine):
        results = await run_batch(engine, requests)
    for index, events in enumerate(results):
        tokens = tokens_of(events)
        assert events[-1].finish_reason == "stop" and tokens[-1] in tokenizer.eos_token_ids
        jsonschema.validate(json.loads(tokenizer.decode(tokens[:-1])), SMOLLM2_SCHEMAS[index // 2])
