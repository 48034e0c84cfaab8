"""`fairlane bench quality` on builtin:tiny: every mode is measured and compared with the first."""

from __future__ import annotations

import json
import math
from pathlib import Path

from benchmarks.bench_quality import PROMPTS, corpus_text
from benchmarks.cli import main


def test_quality_report_covers_each_mode(tmp_path: Path) -> None:
    out = tmp_path / "quality.json"
    assert main(["bench", "quality", "--model", "builtin:tiny", "--modes", "none,int8", "--max-tokens", "4",
                 "--window", "256", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    none, int8 = report["modes"]
    assert (none["mode"], int8["mode"]) == ("none", "int8")
    assert report["num_prompts"] == len(PROMPTS)
    # Random weights are confidently wrong: worse than uniform over 320 tokens, but finite.
    assert none["perplexity"] > 1.0 and math.isfinite(none["perplexity"])
    assert abs(int8["perplexity"] / none["perplexity"] - 1.0) < 0.2
    assert none["exact_answers"] == none["agreement_before_parting"] == 1.0
    assert 0.0 <= int8["exact_answers"] <= int8["agreement_before_parting"] <= 1.0


def test_the_corpus_is_english_text_of_some_length() -> None:
    text = corpus_text()
    assert len(text) > 5_000
    assert "Python" in text
