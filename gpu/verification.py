"""Speculative decoding's verification: a sequence's proposed tokens were fed as extra rows of its decode,
so the forward gave a logits row at each proposal's position and one after the last. Each row is
processed as the sampler would have processed it had the proposals before it been sampled (penalties and
min_tokens read them as output), then checked:

- greedy rows accept a proposal while it is the row's argmax; the first row that disagrees gives its
  argmax, and when every proposal stands the row after the last gives one more token. The output is the
  one plain decoding makes, token for token, up to the near-ties a different kernel can flip.
- sampled rows use rejection sampling with a point-mass proposer (n-gram and suffix proposals are one
  token each, drawn with probability 1): a proposal d is kept with probability p(d); on a rejection the
  token is drawn from p without d, renormalized (the residual max(0, p - q) of "Fast Inference from
  Transformers via Speculative Decoding", Leviathan et al., 2023), and the sequence stops there. Every
  emitted token is distributed exactly as plain sampling's.

Sequences without proposals in the same step are sampled as `Sampler.sample_step` samples them: a seeded
request draws once per token from its own generator, so its tokens do not change with speculation beside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from contract.plan import SamplingParams, ScheduledSequence, TokenLogprobs
from gpu.sampler import Sampler, draw_from, filtered_probs, logprobs_of_rows, process_logits, uniform_draws
from gpu.structured import TokenMasks


@dataclass(slots=True)
class _Rows:
    """The logits rows of one sequence: `first` onward, one per proposal and one after them."""

    first: int
    drafts: list[int]

    @property
    def count(self) -> int:
        return len(self.drafts) + 1


def num_rows(seq: ScheduledSequence) -> int:
    """The logits rows a sampled sequence takes: its proposals' and the one after them."""
    return seq.num_draft_tokens + 1


def verify_step(sampler: Sampler, logits: torch.Tensor, sequences: Sequence[ScheduledSequence],
                masks: TokenMasks | None = None) -> tuple[list[list[int]], dict[str, tuple[TokenLogprobs, ...]]]:
    """logits: [rows, vocab] float32, `num_rows(seq)` consecutive rows per sequence, in order; masks: the
    grammars of the constrained rows. Returns the tokens
    each sequence emits (accepted proposals, then one) and the log probabilities of the requests that asked."""
    layout: list[_Rows] = []
    params: list[SamplingParams] = []
    prompts: list[tuple[int, ...]] = []
    outputs: list[tuple[int, ...]] = []
    for seq in sequences:
        drafts = list(seq.token_ids[len(seq.token_ids) - seq.num_draft_tokens:]) if seq.num_draft_tokens else []
        layout.append(_Rows(len(params), drafts))
        for j in range(len(drafts) + 1):  # row j sees proposals before it as output already sampled
            params.append(seq.sampling)
            prompts.append(seq.prompt_token_ids)
            outputs.append((*seq.output_token_ids, *drafts[:j]))
    processed = process_logits(logits, params, prompts, outputs)
    if masks is not None:  # by logits row (GrammarMatchers.masks)
        processed = masks.constrain(processed, logits)
    argmax = torch.argmax(processed, dim=-1).tolist()
    sampled_rows = [row for row, p in enumerate(params) if not p.is_greedy]
    probs = filtered_probs(processed[sampled_rows], [params[r] for r in sampled_rows], logits.device) \
        if sampled_rows else None
    prob_row = {row: index for index, row in enumerate(sampled_rows)}
    emitted: list[list[int]] = []
    for seq, rows in zip(sequences, layout, strict=True):
        if seq.sampling.is_greedy:
            emitted.append(_greedy(rows, argmax))
        else:
            assert probs is not None
            seq_probs = probs[[prob_row[rows.first + j] for j in range(rows.count)]]
            emitted.append(_sampled(sampler, seq, rows, seq_probs))
    return emitted, _logprobs(logits, sequences, layout, emitted)


def _greedy(rows: _Rows, argmax: list[int]) -> list[int]:
    tokens: list[int] = []
    for j, draft in enumerate(rows.drafts):
        target = argmax[rows.first + j]
        tokens.append(target)
        if target != draft:
            return tokens
    tokens.append(argmax[rows.first + len(rows.drafts)])
    return tokens


def _sampled(sampler: Sampler, seq: ScheduledSequence, rows: _Rows, probs: torch.Tensor) -> list[int]:
    """Rejection sampling against a point-mass proposer; probs: [rows.count, vocab]."""
    if not rows.drafts:  # plain sampling, with the request's own generator when it has a seed
        return [int(sampler.draw(probs, [seq.sampling], [seq.request_id])[0])]
    generator = sampler.generator_of(seq.request_id, seq.sampling.seed)
    accepted = torch.rand(len(rows.drafts), generator=generator, device=probs.device).tolist()
    drafts = torch.tensor(rows.drafts, dtype=torch.long, device=probs.device)
    keep_odds = probs[torch.arange(len(rows.drafts), device=probs.device), drafts].tolist()
    tokens: list[int] = []
    for j, draft in enumerate(rows.drafts):
        if accepted[j] < keep_odds[j]:
            tokens.append(draft)
            continue
        residual = probs[j].clone()
        residual[draft] = 0.0
        tokens.append(_draw_one(residual, generator))
        return tokens
    tokens.append(_draw_one(probs[len(rows.drafts)], generator))
    return tokens


def _draw_one(weights: torch.Tensor, generator: torch.Generator) -> int:
    """One token drawn in proportion to `weights` (they need not sum to 1)."""
    return int(draw_from(weights[None], uniform_draws(1, generator))[0])


def _logprobs(logits: torch.Tensor, sequences: Sequence[ScheduledSequence], layout: list[_Rows],
              emitted: list[list[int]]) -> dict[str, tuple[TokenLogprobs, ...]]:
    """Each emitted token's raw log probabilities, from the row it was chosen at."""
    asked = [(seq, rows, tokens) for seq, rows, tokens in zip(sequences, layout, emitted, strict=True)
             if seq.sampling.logprobs is not None]
    if not asked:
        return {}
    row_index = [rows.first + j for _, rows, tokens in asked for j in range(len(tokens))]
    ks = [seq.sampling.logprobs or 0 for seq, _, tokens in asked for _ in tokens]
    chosen = [token for _, _, tokens in asked for token in tokens]
    entries = iter(logprobs_of_rows(logits[row_index], ks, chosen))
    return {seq.request_id: tuple(next(entries) for _ in tokens) for seq, _, tokens in asked}
