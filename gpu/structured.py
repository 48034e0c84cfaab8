"""Structured outputs by constrained decoding: each constrained row's logits are masked so that only
tokens that keep the output inside its grammar (a JSON schema, any JSON object, a regex) can be
drawn; once the grammar is complete only the tokenizer's EOS tokens remain.

The library is llguidance 1.9.1, chosen over xgrammar 0.2.9 after measuring both on this 2-core
machine (one torch thread; SmolLM2's 49,152-token vocabulary unless said otherwise):
- correctness first: random walks under each library's mask (24 JSON schemas, 30 walks each, byte
  vocabulary) gave invalid JSON for 10 of the 24 schemas with xgrammar (a string with minLength or
  maxLength admits raw control characters and no escapes) and for none with llguidance.
- mask fill per row and token, 341 tokens of valid output replayed: llguidance mean 58 us (p50 44,
  p90 95), xgrammar 12.5 us (p50 8, p90 26); eight rows at staggered positions: llguidance 672 us
  serial, 292 us on its executor (threads, no GIL), xgrammar 88 us. xgrammar is faster where it
  is right, but a wrong JSON is not a price to pay. In the runner, 16 SmolLM2 rows: 0.84 ms of
  fill per step next to a 274 ms forward.
- grammar setup: llguidance 0.6 ms per matcher (mean of the 24 schemas), 0.03 ms to copy a cached
  one; xgrammar compiles in 8-36 ms. Tokenizer setup: 0.54 s against 0.35 s.
- applying the mask: xgrammar's CPU kernel takes 135 us per row and llguidance ships a
  torch.compile kernel; looking up 8 logit offsets (0 or -inf) per mask byte and one index_add_
  takes 30-45 us per row here and runs unchanged on CUDA (see `mask_offsets`).
- install: llguidance has no dependencies (8 MB); xgrammar pulls triton (1 GB) and apache-tvm-ffi.

Filling the masks in a helper thread while the forward runs was measured and not kept: 16 rows,
275.4 ms per step in sequence against 273.0 ms overlapped with one torch thread, 2,166 against
2,173 ms with two; the fill is under 1% of a CPU step and the difference is within the noise. On a
GPU, where a step takes milliseconds, it may be worth measuring again.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import accumulate
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import torch

from contract.plan import ScheduledSequence, StructuredOutput
from gpu.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

logger = logging.getLogger(__name__)

GRAMMAR_CACHE_SIZE = 64
# Compact JSON in json.dumps' style, no free whitespace: a model cannot stall in a run of blanks.
# A schema may still ask otherwise through llguidance's "x-guidance" key.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class _ByteVocabulary:
    """ByteTokenizer as llguidance's TokenizerWrapper reads it: ids 0-255 are the raw bytes; the
    specials and unused ids are marked special (llguidance's 0xFF prefix), so no grammar admits them
    and EOS only as the stop token. (The raw byte 0xFF looks special too; no UTF-8 text holds it.)"""

    def __init__(self, vocab_size: int) -> None:
        names = {ByteTokenizer.BOS: b"bos", ByteTokenizer.EOS: b"eos", ByteTokenizer.PAD: b"pad"}
        self.tokens = [bytes([i]) for i in range(256)] + [
            b"\xff<|" + names.get(i, b"unused_%d" % i) + b"|>" for i in range(256, vocab_size)]
        self.special_token_ids = list(range(256, vocab_size))
        self.eos_token_id = ByteTokenizer.EOS
        self.bos_token_id = ByteTokenizer.BOS

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode("utf-8"))


def grammar_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """The vocabulary as llguidance sees it, `vocab_size` wide (the model's logits, which may be wider
    than the tokenizer), with the tokenizer's EOS ids as the stop tokens allowed at the end."""
    eos = sorted(tokenizer.eos_token_ids)
    if not eos:
        raise ValueError("structured outputs need a tokenizer with an EOS token to end the output")
    if isinstance(tokenizer, HFTokenizer):
        return llguidance.hf.from_tokenizer(tokenizer.hf_tokenizer, n_vocab=vocab_size, eos_token=eos)
    if isinstance(tokenizer, ByteTokenizer):
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocabulary(vocab_size)), n_vocab=vocab_size,
                                      eos_token=eos)
    raise ValueError(f"structured outputs are not supported for the tokenizer {type(tokenizer).__name__}")


def grammar_text(structured: StructuredOutput) -> str:
    """llguidance's grammar for a structured output; ValueError when the spec is not even JSON."""
    if structured.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if structured.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(_schema_of(structured.spec), defaults=JSON_OPTIONS)
    if structured.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(structured.spec)
    raise ValueError(f"unknown structured output kind {structured.kind!r}")


def _schema_of(spec: str) -> dict[str, Any]:
    try:
        schema = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid json schema: not JSON ({exc})") from exc
    if not isinstance(schema, dict):
        raise ValueError("invalid json schema: the schema must be a JSON object")
    return schema


class GrammarCache:
    """Compiled grammars by (scope, kind, spec), the least recently used dropped past `capacity`: a
    tenant's grammars are its own (see StructuredOutput.scope).

    An entry is a pristine matcher, never advanced: a request gets a copy (0.03 ms against 0.6 ms
    to build one from the grammar text, more for large schemas). Thread-safe: the API layer may
    `check` from its threads while the runner compiles in its worker. The tokenizer is read on first
    use (SmolLM2's takes ~0.5 s), so a runner that never sees a structured request never pays for it.

    OpenAI's `strict` is always on: every json_schema request is held to its schema. Keywords the
    library does not implement are an error, not silently ignored.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, capacity: int = GRAMMAR_CACHE_SIZE) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = tokenizer.eos_token_ids
        self.capacity = capacity
        self._grammar_tokenizer: llguidance.LLTokenizer | None = None
        self._matchers: OrderedDict[tuple[str, str, str], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._matchers)

    def new_matcher(self, structured: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher at the start of the grammar; ValueError when it does not compile."""
        return self._compiled(structured).deep_copy()

    def _compiled(self, structured: StructuredOutput) -> llguidance.LLMatcher:
        key = (structured.scope, structured.kind, structured.spec)
        with self._lock:
            matcher = self._matchers.get(key)
            if matcher is not None:
                self._matchers.move_to_end(key)
                return matcher
            if self._grammar_tokenizer is None:
                self._grammar_tokenizer = grammar_tokenizer(self._tokenizer, self.vocab_size)
            tokenizer = self._grammar_tokenizer
        # Outside the lock (llguidance drops the GIL while it builds): two threads may compile the
        # same grammar once each, but no caller waits behind another's compile.
        matcher = llguidance.LLMatcher(tokenizer, grammar_text(structured), log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid {structured.kind.replace('_', ' ')}: {matcher.get_error().strip()}")
        with self._lock:
            self._matchers[key] = matcher
            while len(self._matchers) > self.capacity:
                self._matchers.popitem(last=False)
        return matcher


def check(structured: StructuredOutput, grammars: GrammarCache) -> None:
    """Raise ValueError (a 400 for the API) when the grammar does not compile. It compiles through
    the runner's cache, so the request's first step finds it ready. It may block for a large schema
    or the first structured request's tokenizer setup: call it off the event loop."""
    grammars.new_matcher(structured)


# ---- masks -----------------------------------------------------------------------------------

_BYTE_OFFSETS: dict[torch.device, torch.Tensor] = {}


def _byte_offsets(device: torch.device) -> torch.Tensor:
    """[256, 8] float32: for each byte of a bitmask, the offsets of its 8 tokens (bit i: token i,
    0 when set, -inf when not)."""
    offsets = _BYTE_OFFSETS.get(device)
    if offsets is None:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        offsets = torch.where(bits.bool(), 0.0, float("-inf")).to(device)
        _BYTE_OFFSETS[device] = offsets
    return offsets


def mask_offsets(bitmask: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab_size] float32 on `device`: 0 for the tokens a bitmask row allows, -inf for the
    rest. bitmask: [rows, ceil(vocab / 32)] int32 (little-endian words: token t is bit t % 32 of
    word t // 32, so byte by byte the tokens come in order)."""
    mask_bytes = bitmask.view(torch.uint8).flatten().to(device=device, dtype=torch.int32, non_blocking=True)
    offsets = _byte_offsets(device).index_select(0, mask_bytes)
    return offsets.view(bitmask.shape[0], -1)[:, :vocab_size]


@dataclass(slots=True)
class TokenMasks:
    """The allowed tokens of the constrained rows of one sample step."""

    bitmask: torch.Tensor  # [len(rows), ceil(vocab / 32)] int32 on the CPU; a set bit allows its token
    rows: list[int]  # the logits rows (of the step's sampled sequences) that bitmask's rows belong to

    def constrain(self, processed: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
        """`processed` with each constrained row's disallowed tokens at -inf. `raw` (the model's
        logits, which the log probabilities are read from) is never changed.

        What must stay true: every constrained row keeps a finite logit, or greedy would take an
        id outside the grammar and sampling would draw from NaN. A row whose processors left none
        of its allowed tokens finite (a min_tokens ban on EOS once the grammar is complete) is
        masked from its raw logits instead: the grammar wins."""
        masked = processed.clone() if processed is raw else processed
        index = torch.tensor(self.rows, dtype=torch.long, device=masked.device)
        offsets = mask_offsets(self.bitmask, masked.shape[-1], masked.device)
        masked.index_add_(0, index, offsets)
        # amax over every row, then pick: no copy of the constrained rows.
        is_dead = masked.amax(dim=-1).index_select(0, index) == float("-inf")
        if bool(is_dead.any()):
            dead = is_dead.nonzero()[:, 0]
            masked.index_copy_(0, index[dead], raw.index_select(0, index[dead]).float() + offsets[dead])
        return masked


class GrammarMatchers:
    """Per-request grammar state: a matcher created on the request's first sample, advanced with each
    token it samples, dropped when the plan lists the request as finished. A recompute preemption
    keeps the request id and its output, so the matcher stays valid and is never reset. Called from
    the runner's worker thread only."""

    def __init__(self, grammars: GrammarCache) -> None:
        self.grammars = grammars
        self._words = -(-grammars.vocab_size // 32)
        self._stop_only = _stop_only_row(grammars.stop_token_ids, self._words)
        # None once the request's grammar failed (compile, or a rejected token): it may only stop.
        self._matchers: dict[str, llguidance.LLMatcher | None] = {}
        self._executor: llguidance.LLExecutor | None = None

    @property
    def request_ids(self) -> frozenset[str]:
        """The requests holding grammar state (for tests and stats)."""
        return frozenset(self._matchers)

    def forget(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self._matchers.pop(request_id, None)

    def masks(self, sequences: Sequence[ScheduledSequence]) -> TokenMasks | None:
        """The masks of the constrained rows among the logits rows of `sequences` (the sequences to sample,
        in order, one row each and one more per proposed token); None when no row is constrained, so
        unconstrained batches cost nothing. A proposal's row is masked as the grammar stands once the
        proposals before it are consumed."""
        firsts = list(accumulate((1 + seq.num_draft_tokens for seq in sequences), initial=0))
        constrained = [index for index, seq in enumerate(sequences) if seq.sampling.structured is not None]
        if not constrained:
            return None
        rows = [firsts[index] + j for index in constrained for j in range(1 + sequences[index].num_draft_tokens)]
        position_of = {row: position for position, row in enumerate(rows)}
        bitmask = torch.zeros((len(rows), self._words), dtype=torch.int32)
        active: list[tuple[llguidance.LLMatcher, int]] = []
        for index in constrained:
            matcher = self._matcher(sequences[index])
            if matcher is not None:
                active.append((matcher, position_of[firsts[index]]))
        if active:
            self._fill(active, bitmask)
        for index in constrained:
            seq = sequences[index]
            matcher = self._matchers[seq.request_id]
            if matcher is None:
                for j in range(1 + seq.num_draft_tokens):
                    bitmask[position_of[firsts[index] + j]] = self._stop_only
            elif seq.num_draft_tokens:
                self._fill_draft_rows(matcher, seq, [position_of[firsts[index] + j]
                                                     for j in range(1, 1 + seq.num_draft_tokens)], bitmask)
        return TokenMasks(bitmask, rows)

    def _fill_draft_rows(self, matcher: llguidance.LLMatcher, seq: ScheduledSequence, positions: list[int],
                         bitmask: torch.Tensor) -> None:
        """The masks after each proposal, consumed one at a time and rolled back: the matcher is advanced by
        what the verification emits. `cut_drafts` left only proposals the grammar admits."""
        drafts = seq.token_ids[len(seq.token_ids) - seq.num_draft_tokens:]
        consumed = 0
        for token, position in zip(drafts, positions, strict=True):
            if matcher.is_stopped() or not matcher.consume_token(token):
                bitmask[position] = self._stop_only  # never reached: verification stops at the row before
                continue
            consumed += 1
            self._fill([(matcher, position)], bitmask)
        if consumed:
            matcher.rollback(consumed)

    def cut_drafts(self, sequences: Sequence[ScheduledSequence]) -> list[ScheduledSequence]:
        """The sequences, each constrained one's proposals cut before the first its grammar rejects: a
        proposal the grammar rejects is not computed."""
        cut = list(sequences)
        for index, seq in enumerate(sequences):
            if not seq.num_draft_tokens or seq.sampling.structured is None:
                continue
            matcher = self._matcher(seq)
            drafts = seq.token_ids[len(seq.token_ids) - seq.num_draft_tokens:]
            valid = 0 if matcher is None or matcher.is_stopped() else matcher.validate_tokens(drafts)
            if valid < len(drafts):
                cut[index] = replace(seq, token_ids=seq.token_ids[:len(seq.token_ids) - len(drafts) + valid],
                                     num_draft_tokens=valid)
        return cut

    def advance(self, sequences: Sequence[ScheduledSequence], tokens: Sequence[int]) -> None:
        """Feed each constrained row its sampled token."""
        for seq, token in zip(sequences, tokens, strict=True):
            matcher = self._matchers.get(seq.request_id)
            if matcher is None or matcher.is_stopped():
                continue  # unconstrained, failed, or done: its mask allows only EOS
            if not matcher.consume_token(token):
                # The error goes on with the parser's state and the whole grammar: its first line says why.
                reason = next(iter(matcher.get_error().splitlines()), "")
                logger.error("request %s: sampled token %d left its grammar (%s); only EOS is allowed from now",
                             seq.request_id, token, reason)
                self._matchers[seq.request_id] = None

    def _matcher(self, seq: ScheduledSequence) -> llguidance.LLMatcher | None:
        if seq.request_id not in self._matchers:
            self._matchers[seq.request_id] = self._new_matcher(seq)
        return self._matchers[seq.request_id]

    def _new_matcher(self, seq: ScheduledSequence) -> llguidance.LLMatcher | None:
        structured = seq.sampling.structured
        assert structured is not None
        try:
            return self.grammars.new_matcher(structured)
        except ValueError as exc:
            # The API layer checks first; one that slips through ends its request (EOS), not the step.
            logger.error("request %s: structured output does not compile, ending it: %s", seq.request_id, exc)
            return None

    def _fill(self, active: list[tuple[llguidance.LLMatcher, int]], bitmask: torch.Tensor) -> None:
        """One call for all rows: llguidance spreads them over its threads without the GIL. A stopped
        matcher (grammar complete) fills a mask with EOS alone."""
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        assert bitmask.is_contiguous()
        self._executor.unsafe_compute_mask_ptr(active, bitmask.data_ptr(), self._words * 4, bitmask.shape[0])


def _stop_only_row(stop_token_ids: frozenset[int], words: int) -> torch.Tensor:
    """[words] int32 with the bits of the stop tokens set."""
    values = [0] * words
    for token in stop_token_ids:
        if 0 <= token < words * 32:
            values[token // 32] |= 1 << (token % 32)
    return torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in values], dtype=torch.int32)
