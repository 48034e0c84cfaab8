"""A step's predicted time from what it holds, fitted online from the measured steps.

The model is linear in four counts of a step (`StepWork`): a fixed cost, a cost per token computed,
a cost per sequence (its sampling and bookkeeping), and an attention term, the context each new
token reads. Swap copies are a fifth term. On a GPU the fixed and per-sequence costs dominate
small steps; on a CPU the per-token cost does: the fit finds out which on the machine it runs on.

A step's time is not one line on every machine: a CPU's kernels change with the row count (packed
weight-only kernels below some rows, a dense copy above, on the default model a jump of 50 ms), so the
line alone can miss a lone decode by 2x. The prediction is the line plus what it missed by lately for
steps of about that many tokens: the median residual per bucket of the token count (each count up to 16
its own, then powers of two), interpolated in the token count between the buckets seen. A bucket keeps
its last steps, not what the line missed them by: the residuals are taken again against each new fit.
Kept as misses of the line of their day, they went stale at every refit, and where the terms are nearly
collinear (a window of one step kind: decode rows are tokens and sequences alike) a refit moves the line
a lot: four fresh servers' fits read an attention cost of 3.5e-5 to 2.0e-3 s a unit and a batch decode's
added cost of 2.1 to 3.4 ms. A window that went from lone decodes to four-row steps left a lone decode
predicted at 28.5 ms for its 10 (tests/scheduling/test_step_shaping.py).

Timed steps of each kind (scheduling/calibration.py) anchor it from the start: they are fitted at once
and stay in every later fit, so the window's steps, often all of one kind, refine it without leaving the
rest of the range to extrapolation. It is refitted every few steps over a sliding window, by least
squares that give outliers (a garbage collection, a page fault) less weight (Huber weights, a few
reweighting rounds) and keep every coefficient non-negative (a negative cost would let the shaper add
work for free). Its error is the median absolute relative error of the predictions made before each
step, on the steps that followed them.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import median

import numpy as np

NUM_TERMS = 5  # fixed, tokens, sequences, attention, swapped blocks
RESIDUALS_KEPT = 16  # per token-count bucket
ATTENTION_UNIT = 1000.0  # context positions read per unit of the attention term, to keep terms of one scale


@dataclass(slots=True)
class StepWork:
    """What a step holds, as the cost model counts it."""

    tokens: int = 0
    # Rows sampled: a sequence each, and each proposed token a verification checks (scheduling/speculation.py),
    # which costs what a decode of its own does: its logits row, and on a CPU its row of the packed kernels.
    sequences: int = 0
    attention: float = 0.0  # sum over sequences of new tokens x the context they read, / ATTENTION_UNIT
    swapped_blocks: int = 0

    def add_sequence(self, num_new: int, start_position: int) -> None:
        self.tokens += num_new
        self.sequences += 1
        self.attention += sequence_attention(num_new, start_position)

    def terms(self) -> tuple[float, ...]:
        return (1.0, float(self.tokens), float(self.sequences), self.attention, float(self.swapped_blocks))


def sequence_attention(num_new: int, start_position: int) -> float:
    """Context positions read by num_new tokens starting at start_position (each reads those before it)."""
    return num_new * (start_position + (num_new + 1) / 2) / ATTENTION_UNIT


@dataclass(slots=True, frozen=True)
class CostCoefficients:
    """Seconds per unit of each term; a step's prediction is their dot product with its terms."""

    fixed_s: float
    per_token_s: float
    per_sequence_s: float
    per_attention_s: float
    per_swapped_block_s: float

    def predict(self, work: StepWork) -> float:
        return self.predict_terms(work.terms())

    def predict_terms(self, terms: tuple[float, ...]) -> float:
        """The prediction for a step's terms (StepWork.terms: the constant 1, then the four counts)."""
        return (self.fixed_s + self.per_token_s * terms[1] + self.per_sequence_s * terms[2]
                + self.per_attention_s * terms[3] + self.per_swapped_block_s * terms[4])

    def added_by(self, num_new: int, start_position: int) -> float:
        """The cost one more sequence of num_new tokens from start_position adds to a step."""
        return (self.per_token_s * num_new + self.per_sequence_s
                + self.per_attention_s * sequence_attention(num_new, start_position))


class StepCostModel:
    def __init__(self, window: int = 256, refit_every: int = 16, min_samples: int = 16) -> None:
        self.window = window
        self.refit_every = refit_every
        self.min_samples = min_samples
        self._samples: deque[tuple[tuple[float, ...], float]] = deque(maxlen=window)
        self._anchors: list[tuple[tuple[float, ...], float]] = []  # calibration steps, kept in every fit
        self._errors: deque[float] = deque(maxlen=window)  # |predicted - measured| / measured
        self._since_fit = 0
        self.coefficients: CostCoefficients | None = None  # None until min_samples steps were seen
        # Per bucket of a step's token count (powers of two): its last steps, and the median of what the
        # current line misses them by (a median: a garbage collection's pause moves it not at all). A CPU's
        # kernels change with the row count (packed below some rows, dense above), so a step's time is not
        # one line; the line plus its bucket's residual follows it. A bucket never seen takes its neighbours'.
        # (terms, measured, when: the count of steps observed then) per bucket. A bucket not seen lately and
        # dearer than its neighbours is dropped at a refit (see _drop_stale_dear_buckets).
        self._kept: dict[int, deque[tuple[tuple[float, ...], float, int]]] = {}
        self._observed = 0  # steps observed so far
        self._residuals: dict[int, tuple[float, float]] = {}  # per bucket: (its steps' mean tokens, median missed)
        # Their values sorted by token count, kept with them: a step asks for residuals once per decode and
        # proposal count when it weighs speculation (scheduling/speculation.py).
        self._residual_points: list[tuple[float, float]] = []
        self.lone_decode_s: float | None = None  # the measured time of a step of one decode (a moving average)
        self.last_predicted_s: float | None = None
        self.last_measured_s: float | None = None
        # Median |predicted - measured| / measured over the recent predictions, as of the last refit (the
        # scheduler's snapshot reads it every step; sorting the window that often would be waste).
        self.median_error: float | None = None

    def predict(self, work: StepWork) -> float | None:
        if self.coefficients is None:
            return None
        return max(0.0, self.coefficients.predict(work) + self.residual(work.tokens))

    def residual(self, num_tokens: int) -> float:
        """What the line misses by for a step of num_tokens tokens, lately: interpolated in the token
        count between the buckets seen on each side (the nearest one's beyond the ends; 0 with none)."""
        return _interpolated(self._residual_points, num_tokens)

    def forget(self) -> None:
        """Drop every step seen: they were run by another forward (the eager one, before the compiled one
        took over), and a fit over both would predict neither. Nothing is predicted until min_samples
        steps of the new forward have been seen (or it is calibrated again)."""
        self._samples.clear()
        self._anchors.clear()
        self._kept.clear()
        self._residuals.clear()
        self._residual_points = []
        self._errors.clear()
        self._since_fit = 0
        self.coefficients = self.median_error = self.lone_decode_s = None

    def anchor(self, work: StepWork, measured_s: float) -> None:
        """Record a calibration step; the model is refitted once it has seen enough: steps of several kinds
        chosen to pin every term, so fewer than min_samples served steps. A shape calibrated again keeps
        its quicker time: the forward's first run at a shape may pay once for what later steps find ready
        (a lone decode on a Zen 1 EPYC: 40.2 ms, then 30.0), and a client starting beside the calibration
        slows some of its steps (after one such start the 8-token bucket read 297 ms over the line, where
        served steps of 9 decodes took 145-148 ms, below it: four batch rows beside four streams were priced
        out). The lone decode, whose multiples are the derived targets, is that shape's quicker time too."""
        terms = work.terms()
        repeat = next((index for index, (seen, _) in enumerate(self._anchors) if seen == terms), None)
        if repeat is None:
            self._anchors.append((terms, measured_s))
        else:
            measured_s = min(measured_s, self._anchors[repeat][1])
            self._anchors[repeat] = (terms, measured_s)
        if _is_lone_decode(work):
            self.lone_decode_s = measured_s
        if len(self._anchors) >= 2 * NUM_TERMS or len(self._anchors) + len(self._samples) >= self.min_samples:
            self._kept.clear()
            for terms, seconds in self._anchors:
                self._keep(terms, seconds)
            self._refit()

    @property
    def num_anchors(self) -> int:
        return len(self._anchors)

    def observe(self, work: StepWork, measured_s: float) -> None:
        """Record a step that took measured_s; its prediction, if there was one, counts toward the error."""
        predicted = self.predict(work)
        if predicted is not None and measured_s > 0:
            self._errors.append(abs(predicted - measured_s) / measured_s)
        self.last_predicted_s, self.last_measured_s = predicted, measured_s
        self._observed += 1
        self._note_lone_decode(work, measured_s)
        terms = work.terms()
        bucket = self._keep(terms, measured_s)
        if self.coefficients is not None:
            self._residuals[bucket] = self._residual_of(self._kept[bucket])
            self._residual_points = sorted(self._residuals.values())
        self._samples.append((terms, measured_s))
        self._since_fit += 1
        if len(self._samples) + len(self._anchors) >= self.min_samples and (
                self.coefficients is None or self._since_fit >= self.refit_every):
            self._refit()
            self.median_error = median(self._errors) if self._errors else None
        elif self.median_error is None and self._errors:  # the first predictions: do not wait for a refit
            self.median_error = median(self._errors)

    def _refit(self) -> None:
        """Fit the line to the anchors and the window, and take every bucket's residual against it."""
        self.coefficients = fit([*self._anchors, *self._samples])
        self._since_fit = 0
        self._residuals = {bucket: self._residual_of(kept) for bucket, kept in self._kept.items()}
        self._drop_stale_dear_buckets()
        self._residual_points = sorted(self._residuals.values())

    def _keep(self, terms: tuple[float, ...], measured_s: float) -> int:
        """Keep a step in its bucket; the bucket."""
        bucket = _bucket(int(terms[1]))
        self._kept.setdefault(bucket, deque(maxlen=RESIDUALS_KEPT)).append((terms, measured_s, self._observed))
        return bucket

    def _drop_stale_dear_buckets(self) -> None:
        """Forget the buckets not seen within the window (the fit's) whose residual is above what their
        neighbours' would give them: a step size priced out of every step is never served again, so its
        residual is never corrected. On an AVX2 EPYC (batch's share at 0.42), steps of 5 tokens seen only
        before a flood priced one batch token beside four decoding streams at 153 ms (their step took 54 ms;
        with two more rows, about 100) through the whole 40 s flood, and batch work made 0 tokens/s. Dropped,
        the bucket takes its neighbours' residuals until a step of that size is measured again. A stale
        bucket cheaper than its neighbours keeps nothing out (steps of its size are served when wanted, and
        measured), so it stays: a lone decode between many-row steps."""
        oldest = self._observed - self.window
        stale = [bucket for bucket, kept in self._kept.items() if kept[-1][2] < oldest]
        fresh = sorted(point for bucket, point in self._residuals.items() if bucket not in stale)
        for bucket in stale:
            mean_tokens, residual = self._residuals[bucket]
            if residual > _interpolated(fresh, round(mean_tokens)):
                del self._kept[bucket], self._residuals[bucket]

    def _residual_of(self, kept: deque[tuple[tuple[float, ...], float, int]]) -> tuple[float, float]:
        """A bucket's steps' mean token count, and the median of what the current line misses them by."""
        line = self.coefficients
        assert line is not None
        return (sum(terms[1] for terms, _, _ in kept) / len(kept),
                median(seconds - line.predict_terms(terms) for terms, seconds, _ in kept))

    def _note_lone_decode(self, work: StepWork, measured_s: float) -> None:
        """A lone decode's time is measured, not predicted: steps are not linear in their tokens on every
        machine (a CPU's kernels change with the row count), and the line fitted through every kind of
        step can miss the smallest one by 2x. No step that computes a row is quicker than a lone decode: one
        that was says the lone decode's time is out of date (timed while the machine was busier), and takes
        its place. Under a flood no lone decode is served to correct it, and every derived target is a
        multiple of it: on a Zen 1 EPYC the calibrated lone decode read 48-84 ms from one fresh server to the
        next, against 44-56 ms for lone decodes served."""
        last = self.lone_decode_s
        if _is_lone_decode(work):
            self.lone_decode_s = measured_s if last is None else 0.8 * last + 0.2 * measured_s
        elif last is not None and work.sequences and measured_s < last:
            self.lone_decode_s = measured_s


def _is_lone_decode(work: StepWork) -> bool:
    return work.tokens == 1 and work.sequences == 1 and not work.swapped_blocks


EXACT_BUCKETS = 16  # steps of up to this many tokens each have a bucket of their own


def _bucket(num_tokens: int) -> int:
    """Each small token count its own bucket, then powers of two. The small steps are a CPU's decodes and
    verifications (scheduling/speculation.py), whose kernels change with every few rows: on the default
    model 1 row took 19 ms, 3 rows 29 ms, 6 rows 50 ms and 8 rows 47 ms."""
    if num_tokens <= EXACT_BUCKETS:
        return num_tokens
    return EXACT_BUCKETS + (num_tokens - 1).bit_length()


def _interpolated(points: list[tuple[float, float]], num_tokens: int) -> float:
    """points: (token count, residual) sorted by token count."""
    if not points:
        return 0.0
    if num_tokens <= points[0][0]:
        return points[0][1]
    high_index = bisect_left(points, (num_tokens,))  # the first point at or past num_tokens
    if high_index == len(points):
        return points[-1][1]
    (low_tokens, low), (high_tokens, high) = points[high_index - 1], points[high_index]
    share = (num_tokens - low_tokens) / (high_tokens - low_tokens) if high_tokens > low_tokens else 1.0
    return low + share * (high - low)


def fit(samples: Sequence[tuple[tuple[float, ...], float]], rounds: int = 3) -> CostCoefficients:
    terms = np.array([s[0] for s in samples], dtype=np.float64)
    times = np.array([s[1] for s in samples], dtype=np.float64)
    weights = np.ones(len(times))
    coefficients = np.zeros(NUM_TERMS)
    for _ in range(rounds):
        coefficients = nonnegative_least_squares(terms * weights[:, None], times * weights)
        weights = huber_weights(times - terms @ coefficients)
    return CostCoefficients(*(float(c) for c in coefficients))


def nonnegative_least_squares(terms: np.ndarray, times: np.ndarray) -> np.ndarray:
    """Least squares with the terms whose coefficient comes out negative dropped, one at a time (with
    five terms, a plain active-set loop is enough). Terms that never vary are dropped too."""
    active = [i for i in range(terms.shape[1]) if i == 0 or np.ptp(terms[:, i]) > 0]
    coefficients = np.zeros(terms.shape[1])
    # The normal equations are 5 x 5: solving them is a few microseconds where lstsq on the whole window
    # took hundreds, and the fit runs on the event loop between steps. Terms are of one scale
    # (ATTENTION_UNIT), so their conditioning is fine; lstsq stays the fallback for a singular system.
    gram, moments = terms.T @ terms, terms.T @ times
    while active:
        try:
            solved = np.linalg.solve(gram[np.ix_(active, active)], moments[active])
        except np.linalg.LinAlgError:
            solved, *_ = np.linalg.lstsq(terms[:, active], times, rcond=None)
        if (solved >= 0).all():
            coefficients[active] = solved
            break
        active.pop(int(np.argmin(solved)))
    return coefficients


def huber_weights(residuals: np.ndarray, k: float = 1.5) -> np.ndarray:
    """Weights that leave residuals within k robust standard deviations alone and shrink the rest."""
    scale = 1.4826 * float(np.median(np.abs(residuals - np.median(residuals))))
    if scale <= 0:
        return np.ones(len(residuals))
    ratio = np.abs(residuals) / (k * scale)
    weights: np.ndarray = np.sqrt(np.minimum(1.0, 1.0 / np.maximum(ratio, 1e-12)))
    return weights
