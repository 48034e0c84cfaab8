"""What every `fairlane bench` command prints and writes: a fixed-width table, the JSON report at --out."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def write_report(out: str | None, document: Any) -> None:
    """The benchmark's JSON report at --out, if one was asked for."""
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(document, indent=2) + "\n")


def write_run_report(report: dict[str, Any], out_dir: Path, summary: str) -> str:
    """A long run's report.json and summary.md in out_dir; the summary, to print."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(report, indent=2))
    (out_dir / "summary.md").write_text(summary, encoding="utf-8")
    return summary


def format_table(rows: Sequence[Sequence[str]]) -> str:
    """A plain fixed-width table; the first row is the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths,
                                                                                                strict=True)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
