"""Incremental detokenization: token ids in, text deltas out, never half a character.

Decoding each new token alone breaks multi-byte characters (a byte-level tokenizer emits one byte
of "é" per token) and, for sentencepiece-style vocabularies, loses the spaces a token only shows
next to its neighbour. So, like vLLM's `detokenize_incrementally`, we decode a short window twice:
the tokens already emitted (`prefix_offset:read_offset`, context only) and the same window with
the new tokens. The text beyond the first decode is the delta. A delta that ends in U+FFFD is an
incomplete character: it is held back until the next token completes it. Once a delta is emitted
the window slides forward, so each token costs O(window), not O(output so far).
"""

from __future__ import annotations

from collections.abc import Sequence

from gpu.tokenizer import Tokenizer

# Prompt tokens kept as left context for the first decodes (vLLM uses the same number).
NUM_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """The text of one request's output, produced one delta at a time."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._token_ids = list(prompt_token_ids[-NUM_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # start of the decode window: context for the next delta
        self._read_offset = len(self._token_ids)  # tokens before this have been emitted as text

    def add(self, new_token_ids: Sequence[int]) -> str:
        """The text that `new_token_ids` complete; "" while a character is still incomplete."""
        self._token_ids.extend(new_token_ids)
        text = self._pending_text()
        if not text or text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        return text

    def flush(self) -> str:
        """Whatever is still held back, at the end of the output. An incomplete character at the
        very end can never be completed, so it is emitted as U+FFFD rather than dropped."""
        text = self._pending_text()
        self._prefix_offset = self._read_offset = len(self._token_ids)
        return text

    def _pending_text(self) -> str:
        window = self._token_ids[self._prefix_offset:]
        emitted = self._tokenizer.decode(window[:self._read_offset - self._prefix_offset])
        full = self._tokenizer.decode(window)
        # A longer window can re-render the emitted part differently; only its growth counts.
        return full[len(emitted):] if len(full) > len(emitted) else ""
