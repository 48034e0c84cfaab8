"""Token sampling on the whole batch at once: temperature, top-k and top-p as row-wise tensor ops.

Greedy rows take one argmax. The other rows are filtered together; rows without a seed then draw
in one call on the shared generator, and a request with a seed owns a generator seeded once and
advanced one draw per token, so its tokens do not depend on what else shares the batch.
"""

from __future__ import annotations

import torch

from gpu.plan import SamplingParams


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self._shared = torch.Generator(device=device)
        self._shared.manual_seed(seed)
        self._per_request: dict[str, torch.Generator] = {}

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._per_request.pop(request_id, None)

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], request_ids: list[str]) -> list[int]:
        """logits: [rows, vocab] float32, one row per request, in the order of params."""
        chosen = torch.argmax(logits, dim=-1)
        sampled_rows = [row for row, p in enumerate(params) if not p.is_greedy]
        if sampled_rows:
            rows = [params[i] for i in sampled_rows]
            probs = filtered_probs(logits[sampled_rows], rows, self.device)
            chosen[sampled_rows] = self._draw(probs, rows, [request_ids[i] for i in sampled_rows])
        return [int(t) for t in chosen.tolist()]

    def _draw(self, probs: torch.Tensor, params: list[SamplingParams], request_ids: list[str]) -> torch.Tensor:
        drawn = torch.empty(len(params), dtype=torch.long, device=self.device)
        unseeded = [row for row, p in enumerate(params) if p.seed is None]
        if unseeded:
            drawn[unseeded] = torch.multinomial(probs[unseeded], 1, generator=self._shared)[:, 0]
        for row, (p, request_id) in enumerate(zip(params, request_ids, strict=True)):
            if p.seed is not None:
                drawn[row] = torch.multinomial(probs[row], 1, generator=self._generator(request_id, p.seed))[0]
        return drawn

    def _generator(self, request_id: str, seed: int) -> torch.Generator:
        generator = self._per_request.get(request_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
            self._per_request[request_id] = generator
        return generator


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams], device: torch.device) -> torch.Tensor:
    """[rows, vocab] probabilities after each row's temperature, top-k and top-p."""
    temperatures = torch.tensor([p.temperature for p in params], device=device)[:, None]
    scaled = logits.float() / temperatures
    if any(0 < p.top_k < scaled.shape[-1] for p in params):
        scaled = _keep_top_k(scaled, [p.top_k for p in params])
    probs = torch.softmax(scaled, dim=-1)
    if any(p.top_p < 1.0 for p in params):
        probs = _keep_top_p(probs, torch.tensor([p.top_p for p in params], device=device))
    return probs


def _keep_top_k(scaled: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    vocab = scaled.shape[-1]
    k = torch.tensor([t if 0 < t < vocab else vocab for t in top_k], device=scaled.device)
    top = torch.topk(scaled, int(k.max()), dim=-1).values
    kth = top.gather(1, (k - 1)[:, None])
    return scaled.masked_fill(scaled < kth, float("-inf"))


def _keep_top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest prefix of each row, by probability, whose mass reaches its top_p (the top
    token always stays)."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= top_p[:, None]
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs.masked_fill(drop, 0.0))
