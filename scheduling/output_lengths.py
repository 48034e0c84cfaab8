"""How many tokens a request will generate, predicted from what is known when it arrives: its
`max_tokens`, its class, and what its tenant's recent requests of about the same prompt length generated.

Per (tenant, class, prompt-length bucket: powers of two), a moving average of the output lengths of the
requests that ended by themselves (a stop token or max_tokens; an abort says nothing of the length).
With nothing seen yet, the tenant's class average over all buckets, then half of max_tokens. Never more
than max_tokens. How well it ranks is measured: Spearman's rank correlation between the predictions and
the lengths that followed, over the last requests (`/stats`).
"""

from __future__ import annotations

from collections import deque

from scheduling.request import PriorityClass, Request

EMA_WEIGHT = 0.2  # of the newest length
HISTORY = 512  # (predicted, actual) pairs kept for the rank correlation
MIN_PAIRS = 8
REFRESH_EVERY = 256  # a refresh sorts HISTORY pairs twice: about 2 ms of a step, amortized to nothing


class OutputLengths:
    def __init__(self) -> None:
        self._by_bucket: dict[tuple[str, PriorityClass, int], float] = {}
        self._by_class: dict[tuple[str, PriorityClass], float] = {}
        self._pairs: deque[tuple[float, float]] = deque(maxlen=HISTORY)
        self.rank_correlation: float | None = None  # refreshed every REFRESH_EVERY requests (snapshots read it)
        self._num_observed = 0

    def predict(self, request: Request) -> int:
        key = (request.tenant_id, request.priority)
        seen = self._by_bucket.get((*key, _bucket(request.num_prompt_tokens)), self._by_class.get(key))
        guess = request.max_tokens / 2 if seen is None else seen
        return max(1, min(request.max_tokens, round(guess)))

    def observe(self, request: Request) -> None:
        """A request that ended by itself: its length teaches the averages."""
        actual = request.num_output_tokens
        self._pairs.append((request.predicted_output_tokens, actual))
        self._num_observed += 1
        count = self._num_observed  # refreshed at 8, 16, 32... requests, then every REFRESH_EVERY
        if count % REFRESH_EVERY == 0 or (count >= MIN_PAIRS and count & (count - 1) == 0):
            self.rank_correlation = self.measured_rank_correlation()
        key = (request.tenant_id, request.priority)
        bucket = (*key, _bucket(request.num_prompt_tokens))
        self._by_bucket[bucket] = _moved(self._by_bucket.get(bucket), actual)
        self._by_class[key] = _moved(self._by_class.get(key), actual)

    def measured_rank_correlation(self) -> float | None:
        """Spearman's rho between predicted and actual lengths; None before MIN_PAIRS or with no spread."""
        if len(self._pairs) < MIN_PAIRS:
            return None
        predicted = _ranks([p for p, _ in self._pairs])
        actual = _ranks([a for _, a in self._pairs])
        return _pearson(predicted, actual)


def _moved(average: float | None, value: float) -> float:
    return value if average is None else (1 - EMA_WEIGHT) * average + EMA_WEIGHT * value


def _bucket(num_prompt_tokens: int) -> int:
    return max(0, num_prompt_tokens - 1).bit_length()


def _ranks(values: list[float]) -> list[float]:
    """Ranks from 1, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for index in order[start:end + 1]:
            ranks[index] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def _pearson(xs: list[float], ys: list[float]) -> float | None:
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    cov = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True))
    var_x = sum((x - mean_x) ** 2 for x in xs)
    var_y = sum((y - mean_y) ** 2 for y in ys)
    if var_x == 0 or var_y == 0:
        return None
    return float(cov / (var_x * var_y) ** 0.5)
