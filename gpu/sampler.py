"""Token sampling on the whole batch at once: every logits processor is a row-wise tensor op.

The order follows vLLM and OpenAI: log probabilities are read from the raw logits; then logit bias,
the min_tokens ban, the repetition penalty (prompt and output) and the presence and frequency
penalties (output only) reshape the logits of greedy and sampled rows alike. Greedy rows take one
argmax. The other rows go through temperature, top-k, min-p and top-p together; rows without a seed
then draw in one call on the shared generator, and a request with a seed owns a generator seeded
once and advanced one draw per token, so its tokens do not depend on what else shares the batch.

Each processor runs only when some row of the batch uses it, and then once for the whole batch:
rows that do not use it get the neutral value (bias 0, penalty 1 or 0), which changes nothing.

Structured outputs come last, after the processors and before greedy or temperature: one bitmask
for the constrained rows of the batch (see gpu/structured.py) puts every token outside a row's
grammar at -inf. The log probabilities stay the model's raw ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from contract.plan import SamplingParams, ScheduledSequence, TokenLogprobs
from gpu.structured import TokenMasks

History = Sequence[int]
TOP_P_CANDIDATES = 256  # each row's likeliest tokens, among which top-p looks for its nucleus first


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self._shared = torch.Generator(device=device)
        self._shared.manual_seed(seed)
        self._per_request: dict[str, torch.Generator] = {}

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._per_request.pop(request_id, None)

    def sample_step(self, logits: torch.Tensor, sequences: Sequence[ScheduledSequence],
                    masks: TokenMasks | None = None) -> tuple[list[int], dict[str, TokenLogprobs]]:
        """logits: [rows, vocab] float32, one row per sequence (each needs a sample), in order;
        masks: the grammars of the constrained rows, None when there are none. Returns the chosen
        tokens and the log probabilities of the requests that asked for them."""
        params = [seq.sampling for seq in sequences]
        processed = processed_logits(logits, sequences)
        if masks is not None:
            processed = masks.constrain(processed, logits)
        chosen = self._choose(processed, params, [seq.request_id for seq in sequences])
        tokens = [int(t) for t in chosen.tolist()]
        return tokens, token_logprobs(logits, sequences, tokens)

    def _choose(self, processed: torch.Tensor, params: list[SamplingParams], request_ids: list[str]) -> torch.Tensor:
        chosen = torch.argmax(processed, dim=-1)
        sampled_rows = [row for row, p in enumerate(params) if not p.is_greedy]
        if sampled_rows:
            rows = [params[i] for i in sampled_rows]
            probs = filtered_probs(processed[sampled_rows], rows, self.device)
            chosen[sampled_rows] = self.draw(probs, rows, [request_ids[i] for i in sampled_rows])
        return chosen

    def draw(self, probs: torch.Tensor, params: list[SamplingParams], request_ids: list[str]) -> torch.Tensor:
        """A token per row, in proportion to its probabilities: one uniform draw per row, from the shared
        generator for the rows without a seed (in one call) and from its request's own for the others."""
        uniforms = torch.empty(len(params), dtype=torch.float64, device=self.device)
        unseeded = [row for row, p in enumerate(params) if p.seed is None]
        if unseeded:
            uniforms[unseeded] = uniform_draws(len(unseeded), self._shared)
        for row, (p, request_id) in enumerate(zip(params, request_ids, strict=True)):
            if p.seed is not None:
                uniforms[row] = uniform_draws(1, self._generator(request_id, p.seed))[0]
        return draw_from(probs, uniforms)

    def generator_of(self, request_id: str, seed: int | None) -> torch.Generator:
        """The request's own generator when it has a seed, else the shared one."""
        return self._shared if seed is None else self._generator(request_id, seed)

    def _generator(self, request_id: str, seed: int) -> torch.Generator:
        generator = self._per_request.get(request_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
            self._per_request[request_id] = generator
        return generator


def processed_logits(logits: torch.Tensor, sequences: Sequence[ScheduledSequence]) -> torch.Tensor:
    """[rows, vocab] logits after each sequence's bias, min_tokens ban and penalties, before
    temperature: what greedy rows take the argmax of."""
    return process_logits(logits, [seq.sampling for seq in sequences],
                          [seq.prompt_token_ids for seq in sequences], [seq.output_token_ids for seq in sequences])


def process_logits(logits: torch.Tensor, params: Sequence[SamplingParams], prompts: Sequence[History],
                   outputs: Sequence[History]) -> torch.Tensor:
    """As `processed_logits`, from the parts. Never changes `logits` (the log probabilities are read
    from it) and returns it as float32, without a copy, when no row changes anything."""
    is_banning = [p.min_tokens > len(output) and bool(p.min_tokens_banned)
                  for p, output in zip(params, outputs, strict=True)]
    processed = logits.float()  # no copy when float32 already
    if any(p.logit_bias for p in params):
        processed = _add_logit_bias(processed, params)
    if any(is_banning):
        processed = _ban_until_min_tokens(processed, params, is_banning)
    if any(p.repetition_penalty != 1.0 for p in params):
        processed = _penalize_repetition(processed, params, prompts, outputs)
    if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
        processed = _penalize_output_counts(processed, params, outputs)
    return processed


def _add_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    # Ids outside the vocabulary are dropped rather than failing the step of the whole batch.
    vocab = logits.shape[-1]
    entries = [(row, token, bias) for row, p in enumerate(params) for token, bias in p.logit_bias if 0 <= token < vocab]
    if not entries:
        return logits
    rows, tokens, biases = zip(*entries, strict=True)
    return logits.index_put(_index(rows, tokens, logits.device),
                            torch.tensor(biases, dtype=logits.dtype, device=logits.device), accumulate=True)


def _ban_until_min_tokens(logits: torch.Tensor, params: Sequence[SamplingParams], is_banning: Sequence[bool]
                          ) -> torch.Tensor:
    vocab = logits.shape[-1]
    entries = [(row, token) for row, (p, banning) in enumerate(zip(params, is_banning, strict=True)) if banning
               for token in p.min_tokens_banned if 0 <= token < vocab]
    if not entries:
        return logits
    rows, tokens = zip(*entries, strict=True)
    return logits.index_put(_index(rows, tokens, logits.device),
                            torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))


def _index(rows: Sequence[int], tokens: Sequence[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor(rows, dtype=torch.long, device=device), torch.tensor(tokens, dtype=torch.long, device=device))


def _penalize_repetition(logits: torch.Tensor, params: Sequence[SamplingParams], prompts: Sequence[History],
                         outputs: Sequence[History]) -> torch.Tensor:
    """transformers' RepetitionPenaltyLogitsProcessor: a token seen anywhere in the sequence has its
    logit divided by the penalty when positive, multiplied when not."""
    # Rows with no penalty count nothing, so the padded history is as wide as the penalized ones need.
    seen = [(*prompt, *output) if p.repetition_penalty != 1.0 else ()
            for p, prompt, output in zip(params, prompts, outputs, strict=True)]
    is_seen = token_counts(seen, logits.shape[-1], logits.device) > 0
    penalties = _column([p.repetition_penalty for p in params], logits)
    penalized = torch.where(logits > 0, logits / penalties, logits * penalties)
    return torch.where(is_seen, penalized, logits)


def _penalize_output_counts(logits: torch.Tensor, params: Sequence[SamplingParams], outputs: Sequence[History]
                            ) -> torch.Tensor:
    """OpenAI's: logit -= frequency * count + presence * [count > 0], counting the output only."""
    counts = token_counts(outputs, logits.shape[-1], logits.device).to(logits.dtype)
    frequency = _column([p.frequency_penalty for p in params], logits)
    presence = _column([p.presence_penalty for p in params], logits)
    return logits - (frequency * counts + presence * (counts > 0).to(logits.dtype))


def _column(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    """[rows, 1]: one value per row, to broadcast over the vocabulary."""
    return torch.tensor(values, dtype=like.dtype, device=like.device)[:, None]


def token_counts(histories: Sequence[History], vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] int64: how often each token occurs in each row's history. One scatter_add_ over
    the histories padded with an extra id `vocab`, whose column is then dropped."""
    width = max((len(history) for history in histories), default=0)
    padded = [[*history, *([vocab] * (width - len(history)))] for history in histories]
    ids = torch.tensor(padded, dtype=torch.long, device=device).reshape(len(histories), width)
    counts = torch.zeros(len(histories), vocab + 1, dtype=torch.long, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids))
    return counts[:, :vocab]


def token_logprobs(logits: torch.Tensor, sequences: Sequence[ScheduledSequence], tokens: Sequence[int]
                   ) -> dict[str, TokenLogprobs]:
    """The raw log-softmax of the chosen token and of the k most likely ones, for each sequence that
    asked for them."""
    asked = [(row, seq.request_id, seq.sampling.logprobs) for row, seq in enumerate(sequences)
             if seq.sampling.logprobs is not None]
    if not asked:
        return {}
    rows = [row for row, _, _ in asked]
    entries = logprobs_of_rows(logits[rows], [k or 0 for _, _, k in asked], [tokens[row] for row in rows])
    return {request_id: entry for (_, request_id, _), entry in zip(asked, entries, strict=True)}


def logprobs_of_rows(logits: torch.Tensor, ks: Sequence[int], tokens: Sequence[int]) -> list[TokenLogprobs]:
    """For each row of logits: the chosen token's raw log-softmax and the row's k most likely; one
    log_softmax, gather and topk (on the largest k) for all, each read back once."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = torch.tensor(list(tokens), dtype=torch.long, device=logits.device)
    picked = logprobs.gather(1, chosen[:, None])[:, 0].tolist()
    max_k = min(max(ks), logprobs.shape[-1])
    top = torch.topk(logprobs, max_k, dim=-1)
    top_ids, top_values = top.indices.tolist(), top.values.tolist()
    return [TokenLogprobs(token, logprob, tuple(zip(ids[:k], values[:k], strict=True)))
            for token, k, logprob, ids, values in zip(tokens, ks, picked, top_ids, top_values, strict=True)]


def uniform_draws(count: int, generator: torch.Generator) -> torch.Tensor:
    """`count` draws from [0, 1), in float64, on the generator's device."""
    return torch.rand(count, generator=generator, dtype=torch.float64, device=generator.device)


def draw_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """[rows] tokens, each drawn in proportion to its row of `probs` (a row need not sum to 1), by inverting
    the row's cumulative sum at its uniform draw: the first token whose running sum passes the draw times the
    row's mass. A token of probability 0 adds nothing to the sum, so it is never drawn.

    Not `torch.multinomial`: on a CPU it took 0.74 ms a row over SmolLM2's 49,152 tokens, 19.6 ms for 28 rows,
    more than the step's forward; this takes 0.04 ms and 2.2 ms (docs/benchmarks/kernels.md). The sums are
    in float64: float32's rounding over 49,152 terms would move mass between neighbouring tokens."""
    sums = probs.to(torch.float64).cumsum(dim=-1)
    mass = sums[:, -1]
    # The draw times the mass stays below it (a draw a hair under 1 could round up to it), so that the
    # token found is never past the row's last one of any probability.
    targets = torch.minimum(uniforms.to(torch.float64) * mass, torch.nextafter(mass, torch.zeros_like(mass)))
    return torch.searchsorted(sums, targets[:, None], right=True)[:, 0]


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams], device: torch.device) -> torch.Tensor:
    """[rows, vocab] probabilities after each row's temperature, top-k, min-p and top-p."""
    temperatures = torch.tensor([p.temperature for p in params], device=device)[:, None]
    scaled = logits.float() / temperatures
    if any(0 < p.top_k < scaled.shape[-1] for p in params):
        scaled = _keep_top_k(scaled, [p.top_k for p in params])
    probs = torch.softmax(scaled, dim=-1)
    if any(p.min_p > 0.0 for p in params):
        probs = _keep_min_p(probs, torch.tensor([p.min_p for p in params], device=device))
    if any(p.top_p < 1.0 for p in params):
        probs = _keep_top_p(probs, torch.tensor([p.top_p for p in params], device=device))
    return probs


def _keep_top_k(scaled: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    vocab = scaled.shape[-1]
    widths = [t if 0 < t < vocab else vocab for t in top_k]
    k = torch.tensor(widths, device=scaled.device)
    top = torch.topk(scaled, max(widths), dim=-1).values  # the widest from the list: no wait on the device
    kth = top.gather(1, (k - 1)[:, None])
    return scaled.masked_fill(scaled < kth, float("-inf"))


def _keep_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """transformers' MinPLogitsWarper: drop tokens less likely than min_p times the row's top token
    (which always stays), then renormalize so that top-p measures the mass that is left."""
    kept = probs.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


def _keep_top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest prefix of each row, by probability, whose mass reaches its top_p (the top
    token always stays). Rows of top_p 1 keep every token, on every device: a running sum rounded to
    1.0 before the row's end would otherwise drop its least likely tokens."""
    keeps_all = top_p >= 1.0
    return torch.where(keeps_all[:, None], probs, _nuclei(probs, top_p, keeps_all))


def _nuclei(probs: torch.Tensor, top_p: torch.Tensor, keeps_all: torch.Tensor) -> torch.Tensor:
    """Each row's nucleus (rows in `keeps_all` may come out cut: the caller keeps them whole). On a CPU the
    prefix is looked for among each row's `TOP_P_CANDIDATES` likeliest tokens first, and only the rows whose
    nucleus is wider are sorted whole: sorting 28 rows of 49,152 tokens took 40 ms there, their candidates
    1.6 ms (a model's nucleus of 0.9 is rarely more than a few hundred tokens; a flat row's is most of the
    vocabulary, and one flat row sorted the other 27 too). Which rows those are is a read of the tensor,
    which on a GPU would wait for its kernels: there the rows are sorted, which is quick."""
    if probs.device.type == "cpu" and probs.shape[-1] > TOP_P_CANDIDATES:
        top_probs, top_order = torch.topk(probs, TOP_P_CANDIDATES, dim=-1)  # the likeliest first
        wide = ((top_probs.sum(dim=-1) < top_p) & ~keeps_all).nonzero().flatten()
        kept = _nucleus(probs, top_probs, top_order, top_p)
        if wide.numel():
            kept[wide] = _sorted_nucleus(probs[wide], top_p[wide])
        return kept
    return _sorted_nucleus(probs, top_p)


def _sorted_nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    return _nucleus(probs, sorted_probs, order, top_p)


def _nucleus(probs: torch.Tensor, sorted_probs: torch.Tensor, order: torch.Tensor, top_p: torch.Tensor
             ) -> torch.Tensor:
    """The rows' probabilities with only the prefix of `sorted_probs` (the likeliest first, at `order`)
    whose mass before each token is still below top_p; every other token 0."""
    drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= top_p[:, None]
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs.masked_fill(drop, 0.0))
