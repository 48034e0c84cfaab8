"""Speculative decoding on the real runner (builtin:tiny, float32): greedy output token for token what Hugging
Face generate (or peft) gives with speculation on, for each proposer, through chunked prefill, preemption by
swap and recompute, prefix-cache hits, penalties, grammars and LoRA adapters; log probabilities as without
it; every block back; and rejection sampling keeps the target distribution (a chi-square bound over many
draws)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from app.process.engine_factory import load_draft_for
from config.settings import SettingsError, load_settings
from contract.plan import LoraRef, SamplingParams, ScheduledSequence, StructuredOutput
from gpu.lora import LoraServing
from gpu.models import LoadedModel, load_model
from gpu.runner import ModelRunner, RunnerBudget, kv_shape_of
from gpu.sampler import Sampler
from gpu.structured import GrammarCache, GrammarMatchers, mask_offsets
from gpu.tokenizer import ByteTokenizer
from gpu.verification import verify_step
from scheduling.engine import Engine
from scheduling.request import Request, TokenEvent
from scheduling.scheduler import Scheduler, SchedulerConfig
from scheduling.speculation import SpeculationConfig, Speculator
from tests.factories import (
    assert_kv_all_free,
    collect,
    has_split_prefill,
    make_engine,
    make_request,
    plans_of,
    running,
    tokens_of,
    wait_until,
)
from tests.gpu.reference import GreedyCase, byte_prompt, hf_greedy
from tests.gpu.test_lora import save_adapter
from tests.scheduling.test_lora_preemption import reference

NGRAM = SpeculationConfig("ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=4)
SUFFIX = SpeculationConfig("suffix", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=4)


async def run_all(engine: Engine, requests: Sequence[Request]) -> list[list[TokenEvent]]:
    async with running(engine):
        results = list(await asyncio.gather(*(collect(engine.submit(request)) for request in requests)))
        assert await engine.wait_idle(timeout=10)
        assert_kv_all_free(engine)
    return results


def accepted_tokens(engine: Engine) -> int:
    speculation = engine.stats()["speculation"]
    assert speculation is not None
    return int(speculation["num_accepted_tokens"])


def verified_tokens(engine: Engine) -> int:
    return int(engine.stats()["speculation"]["num_draft_tokens"])


class Oracle(Speculator):
    """Proposes what Hugging Face's greedy output says comes next, with the last proposal wrong every third
    time: random weights copy nothing, so prompt lookup alone rarely has a proposal accepted, and the path
    of accepted proposals (their K/V used by later steps, their blocks cached) must be run all the same."""

    def __init__(self, config: SpeculationConfig, requests: Sequence[Request], cases: Sequence[GreedyCase]) -> None:
        super().__init__(config)
        self.expected: dict[str, list[int]] = {r.request_id: case.expected for r, case in zip(requests, cases,
                                                                                             strict=True)}
        self.prompt_lengths: dict[str, int] = {r.request_id: r.num_prompt_tokens for r in requests}
        self.calls = 0

    def acceptance_rate(self, request_id: str) -> float:
        return 0.95  # what an oracle earns: the step cost model then finds its proposals worth verifying

    def propose(self, request_id: str, tenant_id: str, tokens: Sequence[int], k: int) -> list[int]:
        drafts = list(self.expected[request_id][len(tokens) - self.prompt_lengths[request_id]:][:k])
        self.calls += 1
        if drafts and self.calls % 3 == 0:
            drafts[-1] = (drafts[-1] + 1) % 256
        return drafts


def with_oracle(engine: Engine, config: SpeculationConfig, cases: Sequence[GreedyCase]) -> list[Request]:
    requests = [make_request(case.prompt, case.max_tokens) for case in cases]
    engine.scheduler.speculator = Oracle(config, requests, cases)
    return requests


def assert_greedy(cases: Sequence[GreedyCase], results: Sequence[Sequence[TokenEvent]]) -> None:
    for case, events in zip(cases, results, strict=True):
        assert tokens_of(events) == case.expected, f"prompt of {len(case.prompt)} tokens"
        assert events[-1].num_output_tokens == case.max_tokens
        assert events[-1].finish_reason == "length"


@pytest.mark.parametrize("speculation", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
async def test_greedy_output_is_hfs_with_each_proposer(tiny_model: LoadedModel, tiny_greedy_cases: list[GreedyCase],
                                                       speculation: SpeculationConfig) -> None:
    engine = make_engine(tiny_model, num_blocks=256, block_size=8, config=SchedulerConfig(speculation=speculation))
    results = await run_all(engine, [make_request(case.prompt, case.max_tokens) for case in tiny_greedy_cases])
    assert_greedy(tiny_greedy_cases, results)
    assert verified_tokens(engine) > 20


@pytest.mark.parametrize("budget", [4096, 32], ids=["one-step-prefill", "chunked"])
async def test_greedy_output_is_hfs_with_accepted_proposals(tiny_model: LoadedModel,
                                                            tiny_greedy_cases: list[GreedyCase], budget: int) -> None:
    config = SchedulerConfig(max_num_batched_tokens=budget, speculation=NGRAM)
    engine = make_engine(tiny_model, num_blocks=256, block_size=8, config=config)
    results = await run_all(engine, with_oracle(engine, NGRAM, tiny_greedy_cases))
    assert_greedy(tiny_greedy_cases, results)
    assert accepted_tokens(engine) > 10
    assert accepted_tokens(engine) < verified_tokens(engine)  # and some rejected
    assert any(len(event.new_token_ids) > 1 for events in results for event in events)
    assert has_split_prefill(plans_of(engine)) == (budget < 200)
    assert all(plan.num_tokens <= budget for plan in plans_of(engine))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
async def test_preemption_among_verifications_matches_hf(tiny_model: LoadedModel, tiny_greedy_cases: list[GreedyCase],
                                                         mode: str) -> None:
    config = SchedulerConfig(preemption_mode=mode, speculation=NGRAM)
    # 34 blocks of 8 tokens: every request fits alone, but not all of them together.
    engine = make_engine(tiny_model, num_blocks=34, block_size=8, num_cpu_blocks=64, config=config)
    requests = with_oracle(engine, NGRAM, tiny_greedy_cases)
    results = await run_all(engine, requests)
    assert_greedy(tiny_greedy_cases, results)
    assert engine.stats()["preemptions"][mode] > 0
    assert any(request.num_preemptions > 0 and request.num_output_tokens > 1 for request in requests)
    assert accepted_tokens(engine) > 0


async def test_prefix_cache_hits_with_speculation_match_hf(tiny_model: LoadedModel, tiny_reference: Any) -> None:
    """Blocks completed by accepted proposals are cached and served to the next request with that prefix."""
    prompt = byte_prompt(40, offset=3)
    first = GreedyCase(prompt, 48, hf_greedy(tiny_reference, prompt, 48))
    follow_up = first.prompt + first.expected[:40]  # the conversation goes on: the answer's blocks are a prefix
    second = GreedyCase(follow_up, 8, hf_greedy(tiny_reference, follow_up, 8))
    engine = make_engine(tiny_model, num_blocks=128, block_size=8, config=SchedulerConfig(speculation=NGRAM))
    request_first, request_second = with_oracle(engine, NGRAM, [first, second])
    async with running(engine):
        events_first = await collect(engine.submit(request_first))
        events_second = await collect(engine.submit(request_second))
        assert await engine.wait_idle(timeout=10)
        assert_kv_all_free(engine)
    assert_greedy([first, second], [events_first, events_second])
    assert accepted_tokens(engine) > 0
    assert events_second[-1].num_cached_tokens >= 72  # nine full blocks: the prompt's and the answer's


async def test_penalties_and_logprobs_are_as_without_speculation(tiny_model: LoadedModel) -> None:
    """Penalties read the accepted proposals as output; each token's log probabilities are its own row's."""
    sampling = SamplingParams(repetition_penalty=1.2, frequency_penalty=0.3, logprobs=3)
    prompt = byte_prompt(24, offset=1) * 3

    async def generate(speculation: SpeculationConfig | None) -> tuple[list[TokenEvent], Engine]:
        engine = make_engine(tiny_model, num_blocks=64, block_size=8, config=SchedulerConfig(speculation=speculation))
        request = make_request(prompt, 40, sampling=sampling)
        if speculation is not None:
            engine.scheduler.speculator = Oracle(speculation, [request], [GreedyCase(prompt, 40, tokens_of(plain))])
        return (await run_all(engine, [request]))[0], engine

    plain: list[TokenEvent] = []
    plain, _ = await generate(None)
    speculating, engine = await generate(NGRAM)
    assert tokens_of(speculating) == tokens_of(plain)
    assert accepted_tokens(engine) > 0
    plain_logprobs = [entry for event in plain for entry in event.logprobs]
    spec_logprobs = [entry for event in speculating for entry in event.logprobs]
    assert len(spec_logprobs) == len(plain_logprobs) == 40
    for ours, theirs in zip(spec_logprobs, plain_logprobs, strict=True):
        assert ours.token_id == theirs.token_id
        assert ours.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert [t for t, _ in ours.top] == [t for t, _ in theirs.top]


def draft_sequences(count: int, drafts: list[int], sampling: SamplingParams) -> list[ScheduledSequence]:
    return [ScheduledSequence(f"r{i}", [0, *drafts], 10, (0,), True, sampling, num_draft_tokens=len(drafts))
            for i in range(count)]


def chi_square(counts: Counter[int], probs: torch.Tensor) -> float:
    total = sum(counts.values())
    expected = probs * total
    return float(sum((counts.get(token, 0) - float(e)) ** 2 / float(e) for token, e in enumerate(expected)))


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    """Six tokens, two point-mass proposals per sequence, 6,000 sequences: the first token emitted is drawn from
    the first row's distribution (top-p and temperature applied), and after an accepted proposal the next from
    the second row's, each within a chi-square bound (5 degrees of freedom, p = 0.001: 20.5)."""
    torch.manual_seed(0)
    rows = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 0.3], [0.1, 1.5, 0.2, 1.0, 0.0, -0.5], [1.0] * 6])
    sampling = SamplingParams(temperature=0.9)
    count = 6000
    drafts = [1, 3]  # proposed: token 1 (p = 0.2 or so), then token 3
    logits = rows.repeat(count, 1)
    emitted, _ = verify_step(Sampler(torch.device("cpu"), seed=7), logits, draft_sequences(count, drafts, sampling))
    target = torch.softmax(rows / 0.9, dim=-1)
    first = Counter(tokens[0] for tokens in emitted)
    second = Counter(tokens[1] for tokens in emitted if tokens[0] == drafts[0])
    assert chi_square(first, target[0]) < 20.5, first
    assert chi_square(second, target[1]) < 20.5, second
    # and the proposals were accepted as often as the target gives them
    assert first[drafts[0]] / count == pytest.approx(float(target[0, drafts[0]]), abs=0.02)
    assert all(1 <= len(tokens) <= 3 for tokens in emitted)


def test_proposals_a_grammar_rejects_are_cut_and_each_row_is_masked_after_those_before() -> None:
    tokenizer = ByteTokenizer()
    matchers = GrammarMatchers(GrammarCache(tokenizer, ByteTokenizer.VOCAB_SIZE))
    pattern = SamplingParams(structured=StructuredOutput("regex", "(ab|cd)+!"))
    first = ScheduledSequence("r", [0], 0, (), True, pattern)
    matchers.masks([first])  # the request's first sample makes its matcher
    matchers.advance([first], [ord("a")])
    proposed = ScheduledSequence("r", [ord("a"), ord("b"), ord("c"), ord("x"), ord("d")], 1, (), True, pattern,
                                 num_draft_tokens=4)
    [cut] = matchers.cut_drafts([proposed])
    assert cut.token_ids == [ord("a"), ord("b"), ord("c")] and cut.num_draft_tokens == 2  # "x" and after: cut
    masks = matchers.masks([cut])
    assert masks is not None and masks.rows == [0, 1, 2]
    offsets = mask_offsets(masks.bitmask, ByteTokenizer.VOCAB_SIZE, torch.device("cpu"))
    allowed = [set(torch.isfinite(offsets[row]).nonzero()[:, 0].tolist()) for row in range(3)]
    assert allowed == [{ord("b")}, {ord("a"), ord("c"), ord("!")}, {ord("d")}]
    matchers.advance([cut, cut], [ord("b"), ord("!")])  # the matcher was rolled back: it takes what was emitted
    assert matchers.masks([first]) is not None


async def test_a_grammar_holds_with_speculation_and_the_output_is_unchanged(tiny_model: LoadedModel) -> None:
    """JSON schemas under greedy decoding, with proposals from the unconstrained answer (so many the grammar
    rejects): the same valid JSON as without speculation."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "n"], "additionalProperties": False}
    sampling = SamplingParams(structured=StructuredOutput("json_schema", json.dumps(schema)))
    prompts = [byte_prompt(24, offset=9 * i) for i in range(3)]

    async def generate(oracle: list[list[int]] | None) -> tuple[list[list[TokenEvent]], Engine]:
        engine = make_engine(tiny_model, num_blocks=128, block_size=8,
                             config=SchedulerConfig(speculation=None if oracle is None else NGRAM))
        requests = [make_request(p, 120, sampling=sampling, stop_token_ids=ByteTokenizer().eos_token_ids)
                    for p in prompts]
        if oracle is not None:
            engine.scheduler.speculator = Oracle(NGRAM, requests, [GreedyCase(p, 120, o)
                                                                   for p, o in zip(prompts, oracle, strict=True)])
        return await run_all(engine, requests), engine

    plain, _ = await generate(None)
    answers = [tokens_of(events) for events in plain]
    speculating, engine = await generate(answers)
    assert [tokens_of(events) for events in speculating] == answers
    for events in speculating:
        json.loads(ByteTokenizer().decode(tokens_of(events)[:-1]))
    assert accepted_tokens(engine) > 10


async def test_proposals_verified_on_lora_adapters_give_what_peft_gives(tmp_path: Path) -> None:
    """Two requests on two adapters in one batch, their proposals verified on their own adapter's rows."""
    peft_a, peft_b = save_adapter(tmp_path / "a", seed=1, rank=4), save_adapter(tmp_path / "b", seed=2, rank=8)
    loaded = load_model("builtin:tiny", device="cpu", dtype="float32")  # its own: the runner wraps its layers
    bytes_per_block = kv_shape_of(loaded, 16).bytes_per_block
    budget = RunnerBudget(block_size=16, kv_cache_bytes=64 * bytes_per_block, swap_space_bytes=0)
    runner = ModelRunner(loaded, budget, lora=LoraServing(max_loras=2, max_rank=8, max_cpu_loras=2))
    engine = Engine(Scheduler(SchedulerConfig(max_loras=2, speculation=NGRAM), runner.geometry), runner)
    cases = []
    requests = []
    for name, peft_model, offset in (("a", peft_a, 0), ("b", peft_b, 40)):
        prompt = byte_prompt(20, offset=offset)
        cases.append(GreedyCase(prompt, 40, reference(peft_model, prompt, 40)))
        request = make_request(prompt, 40)
        request.adapter = LoraRef(name, str(tmp_path / name), 1)
        requests.append(request)
    engine.scheduler.speculator = Oracle(NGRAM, requests, cases)
    results = await run_all(engine, requests)
    assert_greedy(cases, results)
    assert accepted_tokens(engine) > 10


def draft_engine(target: LoadedModel, draft_spec: str, num_blocks: int = 256, num_cpu_blocks: int = 0,
                 **config: Any) -> Engine:
    """An engine whose runner proposes with a draft model (gpu/draft.py), loaded apart from the target."""
    draft = load_model(draft_spec, device="cpu", dtype="float32")
    bytes_per_block = kv_shape_of(target, 8).bytes_per_block
    budget = RunnerBudget(block_size=8, kv_cache_bytes=num_blocks * bytes_per_block,
                          swap_space_bytes=num_cpu_blocks * bytes_per_block)
    runner = ModelRunner(target, budget, draft=draft)
    speculation = SpeculationConfig("draft_model", num_speculative_tokens=4)
    return Engine(Scheduler(SchedulerConfig(speculation=speculation, **config), runner.geometry), runner)


@pytest.mark.parametrize(("draft", "mode", "num_blocks"), [("builtin:tiny", "swap", 256), ("builtin:tiny", "swap", 34),
                                                            ("builtin:tiny", "recompute", 34),
                                                            ("builtin:small", "swap", 256)],
                         ids=["itself", "itself-swap", "itself-recompute", "another"])
async def test_a_draft_model_proposes_and_greedy_output_is_hfs(tiny_greedy_cases: list[GreedyCase], draft: str,
                                                               mode: str, num_blocks: int) -> None:
    """builtin:tiny drafting for itself proposes what the target picks (nearly all accepted); through preemption
    by swap and recompute (34 blocks) it reads again what it lacks; builtin:small, another model with the same
    tokenizer, proposes other tokens: the output is Hugging Face's in every case."""
    target = load_model("builtin:tiny", device="cpu", dtype="float32")
    engine = draft_engine(target, draft, num_blocks=num_blocks, num_cpu_blocks=64, preemption_mode=mode)
    requests = [make_request(case.prompt, case.max_tokens) for case in tiny_greedy_cases]
    runner = engine.executor
    assert isinstance(runner, ModelRunner) and runner.draft is not None
    proposer = runner.draft
    async with running(engine):
        results = list(await asyncio.gather(*(collect(engine.submit(request)) for request in requests)))
        # the runner hears of the last finished requests with the plan after them
        await wait_until(lambda: not proposer.request_ids, what="every request's draft blocks to come back")
        assert_kv_all_free(engine)
    assert_greedy(tiny_greedy_cases, results)
    stats = engine.stats()["speculation"]
    if draft == "builtin:tiny":
        assert stats["num_accepted_tokens"] >= 0.9 * stats["num_draft_tokens"] > 40
    else:
        assert stats["num_draft_tokens"] > 0
    if num_blocks == 34:
        assert engine.stats()["preemptions"][mode] > 0
    assert proposer.num_free_blocks == proposer.cache.num_device_blocks


def test_a_draft_model_with_another_tokenizer_is_refused() -> None:
    settings = load_settings(environ={}, overrides={
        "model": "builtin:tiny", "compile_mode": "eager",
        "speculative_config": '{"method": "draft_model", "model": "smollm2-135m"}'})
    target = load_model("builtin:tiny", device="cpu", dtype="float32")
    with pytest.raises(SettingsError, match="does not share"):
        load_draft_for(settings, target)
