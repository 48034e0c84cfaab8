"""`fairlane bench quality` on builtin:tiny: every mode is measured and compared with the first."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_quality import PROMPTS, corpus_text, window_logits
from benchmarks.cli import main
from gpu.models import LoadedModel
from tests.factories import make_runner
from tests.gpu.reference import byte_prompt, hf_logits


def test_quality_report_covers_each_mode(tmp_path: Path) -> None:
    out = tmp_path / "quality.json"
    assert main(["bench", "quality", "--model", "builtin:tiny", "--modes", "none:float32,int8,none:bfloat16",
                 "--max-tokens", "4", "--window", "256", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    none, int8, narrow_kv = report["modes"]
    assert (none["mode"], int8["mode"], narrow_kv["mode"]) == ("none:float32", "int8", "none:bfloat16")
    # The windows' later chunks read a bfloat16 pool: close to float32's, not the same.
    assert narrow_kv["perplexity"] != none["perplexity"]
    assert abs(narrow_kv["perplexity"] / none["perplexity"] - 1.0) < 0.02
    assert report["num_prompts"] == len(PROMPTS)
    # Random weights are confidently wrong: worse than uniform over 320 tokens, but finite.
    assert none["perplexity"] > 1.0 and math.isfinite(none["perplexity"])
    assert abs(int8["perplexity"] / none["perplexity"] - 1.0) < 0.2
    assert none["exact_answers"] == none["agreement_before_parting"] == 1.0
    assert 0.0 <= int8["exact_answers"] <= int8["agreement_before_parting"] <= 1.0


def test_paged_perplexity_is_transformers_own_over_the_same_window(tiny_model: LoadedModel, tiny_reference: Any
                                                                   ) -> None:
    """Read in chunks through the paged KV cache, a window's logits are those of one plain forward."""
    tokens = byte_prompt(300)
    runner = make_runner(tiny_model, num_blocks=32)
    paged = window_logits(runner, tokens)
    assert paged.shape == (300, tiny_model.model.config.vocab_size)
    torch.testing.assert_close(paged, hf_logits(tiny_reference, tokens), rtol=1e-4, atol=1e-3)


def test_the_corpus_is_english_text_of_some_length() -> None:
    text = corpus_text()
    assert len(text) > 5_000
    assert "Python" in text
