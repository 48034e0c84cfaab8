"""Incremental detokenization: deltas that join to the full text and never split a character."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from app.serving.detokenizer import IncrementalDetokenizer
from gpu.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer()


def deltas_of(token_runs: list[list[int]], prompt: list[int] | None = None) -> list[str]:
    detokenizer = IncrementalDetokenizer(TOKENIZER, prompt or [TOKENIZER.BOS])
    return [detokenizer.add(run) for run in token_runs] + [detokenizer.flush()]


def test_multibyte_characters_come_out_whole() -> None:
    tokens = TOKENIZER.encode("añ你🙂")

    assert deltas_of([[t] for t in tokens]) == ["a", "", "ñ", "", "", "你", "", "", "", "🙂", ""]


def test_special_tokens_add_no_text() -> None:
    assert deltas_of([[TOKENIZER.EOS], TOKENIZER.encode("ok")]) == ["", "ok", ""]


def test_an_incomplete_last_character_is_flushed_as_a_replacement_char() -> None:
    tokens = TOKENIZER.encode("é")

    assert deltas_of([[tokens[0]]]) == ["", "\ufffd"]


def test_a_prompt_ending_mid_character_does_not_leak_into_the_output() -> None:
    prompt = TOKENIZER.encode("ab你")[:-1]

    assert "".join(deltas_of([TOKENIZER.encode("xyz")], prompt)) == "xyz"


@given(text=st.text(max_size=40), cuts=st.lists(st.integers(min_value=1, max_value=6), max_size=40))
def test_deltas_join_to_the_text_and_none_splits_a_character(text: str, cuts: list[int]) -> None:
    tokens = TOKENIZER.encode(text)
    runs, start = [], 0
    for size in [*cuts, len(tokens)]:
        runs.append(tokens[start:start + size])
        start += size

    deltas = deltas_of(runs)

    assert "".join(deltas) == text
    assert all("\ufffd" not in delta or "\ufffd" in text for delta in deltas)


@given(data=st.binary(max_size=40))
def test_arbitrary_bytes_decode_as_a_whole_would(data: bytes) -> None:
    assert "".join(deltas_of([[b] for b in data])) == TOKENIZER.decode(list(data))
