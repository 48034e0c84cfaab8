"""Token sampling: greedy rows in one argmax; sampled rows each with their own generator.

A request with a seed owns a generator seeded once and advanced one draw per token, so its tokens
do not depend on what else shares the batch.
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
        for row, (p, request_id) in enumerate(zip(params, request_ids, strict=True)):
            if not p.is_greedy:
                chosen[row] = self._draw(logits[row], p, self._generator(request_id, p))
        return [int(t) for t in chosen.tolist()]

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self._shared
        generator = self._per_request.get(request_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
            self._per_request[request_id] = generator
        return generator

    @staticmethod
    def _draw(row: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
        scaled = row.float() / params.temperature
        if params.top_k > 0 and params.top_k < scaled.shape[-1]:
            kth = torch.topk(scaled, params.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
            drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= params.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return torch.multinomial(probs, 1, generator=generator)[0]
