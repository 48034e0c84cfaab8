"""Sampling: a seeded request draws the same tokens whatever shares its batch, and the logits
processors and log probabilities match transformers' processors and OpenAI's formulas."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TopKLogitsWarper,
)

from contract.plan import SamplingParams, ScheduledSequence
from gpu.models import LoadedModel
from gpu.sampler import TOP_P_CANDIDATES, Sampler, draw_from, filtered_probs, processed_logits
from scheduling.request import Request, TokenEvent
from scheduling.scheduler import SchedulerConfig
from tests.factories import assert_kv_all_free, collect, make_engine, make_request, running, tokens_of
from tests.gpu.reference import byte_prompt, hf_greedy, hf_logits

SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=123)
PROMPT = byte_prompt(40, offset=5)
MAX_TOKENS = 24


async def run_together_events(loaded: LoadedModel, requests: list[Request]) -> list[list[TokenEvent]]:
    engine = make_engine(loaded, num_blocks=256, block_size=8, config=SchedulerConfig(max_num_batched_tokens=48))
    async with running(engine):
        results = await asyncio.gather(*(collect(engine.submit(request)) for request in requests))
        assert await engine.wait_idle(timeout=10)
        assert_kv_all_free(engine)
    return results


async def run_together(loaded: LoadedModel, requests: list[Request]) -> list[list[int]]:
    return [tokens_of(events) for events in await run_together_events(loaded, requests)]


def crowd() -> list[Request]:
    """Ten neighbours: unseeded sampled, seeded with other seeds, and greedy, of assorted lengths."""
    unseeded = [make_request(byte_prompt(9 + 17 * i, offset=i), 20, sampling=SamplingParams(temperature=1.0))
                for i in range(4)]
    seeded = [make_request(byte_prompt(30 + 5 * i, offset=50 + i), 16,
                           sampling=SamplingParams(temperature=1.0, top_k=50, seed=7 + i)) for i in range(3)]
    greedy = [make_request(byte_prompt(60 + 20 * i, offset=90 + i), 12) for i in range(3)]
    return [*unseeded, *seeded, *greedy]


async def test_seeded_sampling_is_independent_of_the_batch(tiny_model: LoadedModel, tiny_reference: Any) -> None:
    [alone] = await run_together(tiny_model, [make_request(PROMPT, MAX_TOKENS, sampling=SEEDED)])
    neighbours = crowd()
    target = make_request(PROMPT, MAX_TOKENS, sampling=SEEDED)
    twin = make_request(PROMPT, MAX_TOKENS, sampling=SEEDED)  # same seed, different request
    crowded = await run_together(tiny_model, [*neighbours[:5], target, *neighbours[5:], twin])
    assert len(alone) == MAX_TOKENS
    assert crowded[5] == alone
    assert crowded[-1] == alone
    # The draw really is random: it leaves the greedy path somewhere.
    assert alone != hf_greedy(tiny_reference, PROMPT, MAX_TOKENS)


def sample(sampler: Sampler, logits: torch.Tensor, params: list[SamplingParams], request_ids: list[str]) -> list[int]:
    """One token per row, as the step samples them: rows with no prompt or output to penalize."""
    sequences = [make_sequence(row_params, request_id=request_id)
                 for row_params, request_id in zip(params, request_ids, strict=True)]
    return sampler.sample_step(logits, sequences)[0]


def test_greedy_rows_take_the_argmax() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(torch.device("cpu"))
    chosen = sample(sampler, logits, [SamplingParams()] * 3, ["a", "b", "c"])
    assert chosen == [int(t) for t in torch.argmax(logits, dim=-1)]


def test_top_k_one_is_greedy_even_when_hot() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    sampler = Sampler(torch.device("cpu"))
    params = [SamplingParams(temperature=5.0, top_k=1)] * 4
    chosen = sample(sampler, logits, params, ["a", "b", "c", "d"])
    assert chosen == [int(t) for t in torch.argmax(logits, dim=-1)]


def test_top_p_keeps_only_the_nucleus() -> None:
    # Token 3 holds ~88% of the mass: top_p 0.5 keeps it alone.
    logits = torch.full((1, 10), 0.0)
    logits[0, 3] = 4.0
    sampler = Sampler(torch.device("cpu"))
    draws = [sample(sampler, logits, [SamplingParams(temperature=1.0, top_p=0.5)], ["r"])[0] for _ in range(50)]
    assert set(draws) == {3}


def test_draws_follow_each_rows_probabilities() -> None:
    """200,000 draws from two rows (one not normalized): each token's share within 0.005 of its
    probability, and a token of probability 0 never drawn."""
    probs = torch.softmax(torch.randn(2, 40, generator=torch.Generator().manual_seed(3)) * 2, dim=-1)
    probs[:, 7] = 0.0
    probs[1] *= 3.0  # a row's mass need not be 1
    generator = torch.Generator().manual_seed(11)
    counts = torch.zeros(2, 40)
    rows = probs.repeat_interleave(1000, dim=0)
    for _ in range(100):
        drawn = draw_from(rows, torch.rand(2000, generator=generator, dtype=torch.float64))
        counts += torch.stack([torch.bincount(drawn[:1000], minlength=40), torch.bincount(drawn[1000:], minlength=40)])
    shares = counts / counts.sum(dim=-1, keepdim=True)
    expected = probs / probs.sum(dim=-1, keepdim=True)
    assert (shares - expected).abs().max() < 0.005
    assert counts[:, 7].sum() == 0


def test_a_draw_at_the_top_of_the_range_takes_the_last_token_with_any_probability() -> None:
    probs = torch.tensor([[0.25, 0.75, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    highest = torch.tensor([1.0 - 2.0 ** -53] * 2, dtype=torch.float64)
    lowest = torch.zeros(2, dtype=torch.float64)
    assert draw_from(probs, highest).tolist() == [1, 3]
    assert draw_from(probs, lowest).tolist() == [0, 3]


def test_top_p_finds_the_same_nucleus_among_the_candidates_as_over_the_sorted_row() -> None:
    """Peaked rows find their nucleus among the likeliest TOP_P_CANDIDATES tokens; flat ones (a nucleus
    wider than that) sort the row, alone when peaked rows share the step. Rows of top_p 1 keep every
    token. All as the whole sorted row gives."""
    vocab = 4 * TOP_P_CANDIDATES
    mixed = torch.tensor([8.0, 0.5, 8.0, 0.5, 8.0, 8.0])[:, None]
    for scale in (8.0, 0.5, mixed):  # peaked, flat, then both
        logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(5)) * scale
        params = [SamplingParams(temperature=1.0, top_p=top_p) for top_p in (0.9, 0.5, 1.0, 0.95, 0.7, 0.99)]
        probs = torch.softmax(logits, dim=-1)
        ordered, order = torch.sort(probs, dim=-1, descending=True)
        top_p = torch.tensor([p.top_p for p in params])[:, None]
        kept = torch.zeros_like(probs).scatter_(1, order, ordered.masked_fill(ordered.cumsum(-1) - ordered >= top_p, 0))
        kept[2] = probs[2]
        assert torch.allclose(filtered_probs(logits, params, CPU), kept, atol=1e-7)


def test_seeded_generator_restarts_after_forget() -> None:
    logits = torch.zeros(1, 64)  # uniform: every draw depends on the generator alone
    params = [SamplingParams(temperature=1.0, seed=42)]
    sampler = Sampler(torch.device("cpu"))
    first = [sample(sampler, logits, params, ["r"])[0] for _ in range(8)]
    sampler.forget(["r"])
    again = [sample(sampler, logits, params, ["r"])[0] for _ in range(8)]
    other = Sampler(torch.device("cpu"), seed=999)
    elsewhere = [sample(other, logits, params, ["x"])[0] for _ in range(8)]
    assert first == again == elsewhere
    assert len(set(first)) > 1


# ---- logits processors and log probabilities -----------------------------------------------------

VOCAB = 64
CPU = torch.device("cpu")


def make_sequence(sampling: SamplingParams, prompt: Sequence[int] = (), output: Sequence[int] = (),
                  request_id: str = "r") -> ScheduledSequence:
    """A decode row that needs a sample, carrying its history as the scheduler fills it."""
    return ScheduledSequence(request_id=request_id, token_ids=[0], start_position=0, block_table=(), needs_sample=True,
                             sampling=sampling, prompt_token_ids=tuple(prompt), output_token_ids=tuple(output))


def random_logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def random_history(length: int, seed: int) -> tuple[int, ...]:
    """Token ids drawn from a small range so that repeats are common."""
    ids = torch.randint(0, VOCAB // 2, (length,), generator=torch.Generator().manual_seed(seed))
    return tuple(int(t) for t in ids.tolist())


def mixed_sequences() -> list[ScheduledSequence]:
    """One row per processor, plain rows in between, and one row that uses them all."""
    everything = SamplingParams(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4,
                                logit_bias=((3, 5.0), (9, -2.0)), min_tokens=8, min_tokens_banned=(1, 2), seed=5)
    params = [SamplingParams(), SamplingParams(repetition_penalty=1.5), SamplingParams(temperature=1.0),
              SamplingParams(presence_penalty=1.0, frequency_penalty=0.5), SamplingParams(logit_bias=((7, 4.0),)),
              SamplingParams(min_tokens=4, min_tokens_banned=(0, 5)), SamplingParams(temperature=0.9, min_p=0.2),
              everything]
    return [make_sequence(p, random_history(20, 100 + i), random_history(6, 200 + i) if p.needs_history else (),
                          request_id=f"r{i}") for i, p in enumerate(params)]


def test_rows_that_change_nothing_cost_nothing() -> None:
    logits = random_logits(3, 0)
    sequences = [make_sequence(SamplingParams(temperature=1.0, top_k=5, top_p=0.9)) for _ in range(3)]
    assert processed_logits(logits, sequences) is logits


def test_repetition_penalty_matches_transformers() -> None:
    logits = random_logits(4, 1)
    penalties = (1.3, 0.7, 2.0, 1.0)
    sequences = [make_sequence(SamplingParams(repetition_penalty=penalty), random_history(15, i),
                               random_history(5, 9 + i)) for i, penalty in enumerate(penalties)]
    expected = torch.cat([
        RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([[*seq.prompt_token_ids, *seq.output_token_ids]]),
                                                  logits[row:row + 1].clone())
        for row, (penalty, seq) in enumerate(zip(penalties, sequences, strict=True))])
    torch.testing.assert_close(processed_logits(logits, sequences), expected)


def openai_penalties(row: torch.Tensor, output: Sequence[int], presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's formula, token by token: mu[j] -= c[j] * frequency + [c[j] > 0] * presence."""
    penalized = row.clone()
    for token in set(output):
        count = output.count(token)
        penalized[token] -= count * frequency + presence
    return penalized


def test_presence_and_frequency_penalties_follow_openai() -> None:
    logits = random_logits(3, 2)
    settings = ((0.5, 0.3), (-1.0, 2.0), (0.0, 0.0))
    sequences = [make_sequence(SamplingParams(presence_penalty=presence, frequency_penalty=frequency),
                               random_history(12, 30 + i), random_history(10, 40 + i))
                 for i, (presence, frequency) in enumerate(settings)]
    expected = torch.stack([openai_penalties(logits[row], seq.output_token_ids, *setting)
                            for row, (seq, setting) in enumerate(zip(sequences, settings, strict=True))])
    # The prompt does not count: tokens only in the prompt keep their logits.
    torch.testing.assert_close(processed_logits(logits, sequences), expected)


def test_logit_bias_matches_transformers_and_forces_or_forbids() -> None:
    logits = random_logits(2, 3)
    bias = ((4, 2.5), (11, -1.5))
    sequences = [make_sequence(SamplingParams(logit_bias=bias)), make_sequence(SamplingParams())]
    reference = SequenceBiasLogitsProcessor([[[token], value] for token, value in bias])
    expected = torch.cat([reference(torch.tensor([[0]]), logits[:1].clone()), logits[1:]])
    torch.testing.assert_close(processed_logits(logits, sequences), expected)

    best = [int(t) for t in torch.argmax(logits, dim=-1).tolist()]
    forced = [make_sequence(SamplingParams(logit_bias=((13, 100.0),))),
              make_sequence(SamplingParams(logit_bias=((best[1], -100.0),)))]
    tokens, _ = Sampler(CPU).sample_step(logits, forced)
    assert tokens[0] == 13
    assert tokens[1] != best[1]


def test_min_tokens_bans_stop_tokens_until_reached() -> None:
    logits = random_logits(1, 4)
    banned = (int(torch.argmax(logits)), 17)
    sampler = Sampler(CPU)
    for num_outputs in range(6):
        sampling = SamplingParams(min_tokens=3, min_tokens_banned=banned)
        sequence = make_sequence(sampling, (1, 2), tuple(range(num_outputs)))
        reference = MinNewTokensLengthLogitsProcessor(2, 3, list(banned))
        expected = reference(torch.tensor([[1, 2, *range(num_outputs)]]), logits.clone())
        torch.testing.assert_close(processed_logits(logits, [sequence]), expected)
        [token], _ = sampler.sample_step(logits, [sequence])
        assert (token in banned) == (num_outputs >= 3)
        hot = make_sequence(dataclasses.replace(sampling, temperature=100.0), (), tuple(range(num_outputs)))
        draws = [sampler.sample_step(logits, [hot])[0][0] for _ in range(20)]
        assert num_outputs >= 3 or not set(draws) & set(banned)


def test_min_p_matches_transformers_after_top_k() -> None:
    logits = random_logits(3, 5)
    params = [SamplingParams(temperature=0.8, min_p=0.1), SamplingParams(temperature=1.5, top_k=10, min_p=0.3),
              SamplingParams(temperature=1.0)]
    expected = []
    for row, p in enumerate(params):
        scaled = logits[row:row + 1] / p.temperature
        if p.top_k:
            scaled = TopKLogitsWarper(p.top_k)(torch.tensor([[0]]), scaled)
        if p.min_p:
            scaled = MinPLogitsWarper(p.min_p)(torch.tensor([[0]]), scaled)
        expected.append(torch.softmax(scaled, dim=-1))
    probs = filtered_probs(logits, params, CPU)
    torch.testing.assert_close(probs, torch.cat(expected))
    assert int((probs[0] > 0).sum()) < VOCAB


def test_mixed_batch_rows_match_each_row_alone() -> None:
    sequences = mixed_sequences()
    logits = random_logits(len(sequences), 6)
    together = processed_logits(logits, sequences)
    for row, sequence in enumerate(sequences):
        alone = processed_logits(logits[row:row + 1], [sequence])
        torch.testing.assert_close(together[row:row + 1], alone, rtol=0, atol=0)
    greedy = [row for row, seq in enumerate(sequences) if seq.sampling.is_greedy]
    tokens, _ = Sampler(CPU).sample_step(logits, sequences)
    assert [tokens[row] for row in greedy] == [int(together[row].argmax()) for row in greedy]
    assert (together[greedy] != logits[greedy]).any()


def test_logprobs_are_the_raw_log_softmax() -> None:
    sequences = [make_sequence(dataclasses.replace(seq.sampling, logprobs=k), seq.prompt_token_ids,
                               seq.output_token_ids, seq.request_id)
                 for seq, k in zip(mixed_sequences(), (0, 5, 20, None, 1, 3, 2, 20), strict=True)]
    logits = random_logits(len(sequences), 7)
    tokens, logprobs = Sampler(CPU).sample_step(logits, sequences)
    raw = torch.log_softmax(logits, dim=-1)
    assert set(logprobs) == {seq.request_id for seq in sequences if seq.sampling.logprobs is not None}
    for row, (seq, token) in enumerate(zip(sequences, tokens, strict=True)):
        reported = logprobs.get(seq.request_id)
        if reported is None:
            continue
        assert reported.token_id == token
        assert abs(reported.logprob - float(raw[row, token])) < 1e-5
        top_ids = [token_id for token_id, _ in reported.top]
        top_values = [value for _, value in reported.top]
        assert len(reported.top) == seq.sampling.logprobs
        assert top_values == sorted(top_values, reverse=True)
        assert top_ids == [int(t) for t in torch.topk(raw[row], len(top_ids)).indices.tolist()]
        assert all(abs(value - float(raw[row, token_id])) < 1e-5 for token_id, value in reported.top)


def test_logprobs_ignore_the_penalties() -> None:
    logits = random_logits(1, 8)
    best = int(torch.argmax(logits))
    sampling = SamplingParams(repetition_penalty=5.0, presence_penalty=2.0, logit_bias=((best, -50.0),), logprobs=1)
    sequence = make_sequence(sampling, (best,), (best,))
    [token], logprobs = Sampler(CPU).sample_step(logits, [sequence])
    raw = torch.log_softmax(logits[0], dim=-1)
    assert token != best
    assert logprobs["r"].top[0][0] == best
    assert abs(logprobs["r"].logprob - float(raw[token])) < 1e-5


def test_seeded_rows_stay_reproducible_among_penalized_rows() -> None:
    seeded = make_sequence(SamplingParams(temperature=1.0, seed=11, repetition_penalty=1.2, min_p=0.05),
                           (1, 2, 3), (4, 5), request_id="seeded")
    logits = random_logits(len(mixed_sequences()) + 1, 9)
    alone = Sampler(CPU)
    crowded = Sampler(CPU, seed=3)
    first = [alone.sample_step(logits[:1], [seeded])[0][0] for _ in range(10)]
    among = [crowded.sample_step(logits, [seeded, *mixed_sequences()])[0][0] for _ in range(10)]
    assert first == among
    assert len(set(first)) > 1


def test_sampling_applies_the_bias() -> None:
    logits = random_logits(2, 10)
    params = [SamplingParams(logit_bias=((21, 100.0),)), SamplingParams(temperature=1.0, logit_bias=((22, 100.0),))]
    assert sample(Sampler(CPU), logits, params, ["a", "b"]) == [21, 22]


async def test_repetition_penalty_matches_hf_generate(tiny_model: LoadedModel, tiny_reference: Any) -> None:
    sampling = SamplingParams(repetition_penalty=1.8, logprobs=2)
    [events] = await run_together_events(tiny_model, [make_request(PROMPT, MAX_TOKENS, sampling=sampling)])
    input_ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        output = tiny_reference.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                         max_new_tokens=MAX_TOKENS, min_new_tokens=0, repetition_penalty=1.8)
    expected = [int(t) for t in output[0, len(PROMPT):].tolist()]
    assert tokens_of(events) == expected
    assert expected != hf_greedy(tiny_reference, PROMPT, MAX_TOKENS)
    # The log probabilities reach the stream, one per token, raw: those of a plain forward.
    reported = [logprobs for event in events for logprobs in event.logprobs]
    raw = torch.log_softmax(hf_logits(tiny_reference, [*PROMPT, *expected]), dim=-1)[len(PROMPT) - 1:-1]
    assert [r.token_id for r in reported] == expected
    worst = max(abs(r.logprob - float(raw[i, r.token_id])) for i, r in enumerate(reported))
    assert worst < 1e-4
