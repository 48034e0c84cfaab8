"""The requests that did not end ok, listed in a long run's report with what the client knew of each
(`RequestRecord.failure_json`): counts per outcome cannot tell one odd stream among hundreds from
another, its completion id finds it in the server's request log, and its reason and detail say what
the client saw. Clients that left mid-stream on purpose (`dropped`) are not failures.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loadtest.client import RequestRecord

MAX_LISTED = 200  # in the JSON report, in the order they were sent
MAX_ROWS = 20  # in the Markdown table
MAX_DETAIL_CHARS = 60  # of a detail in the Markdown table; the JSON keeps DETAIL_CHARS


def failed_requests(failed: Sequence[tuple[dict[str, str], RequestRecord]]) -> dict[str, Any]:
    """The failed requests, each given as (its labels in this run, e.g. kind and class; its record):
    how many there were, and the first MAX_LISTED of them."""
    return {"count": len(failed), "listed": [labels | record.failure_json() for labels, record in failed[:MAX_LISTED]]}


def failed_requests_markdown(section: dict[str, Any], label_names: Sequence[str],
                             what: str = "Requests that did not end ok") -> list[str]:
    """A short table of the first failed requests, after a line that says how many there were."""
    listed = section["listed"]
    if not listed:
        return [f"{what}: none."]
    shown = f"the first {MAX_ROWS} below, " if len(listed) > MAX_ROWS else ""
    in_json = "all" if section["count"] <= MAX_LISTED else f"the first {MAX_LISTED}"
    names = ["sent at (s)", "elapsed (s)", *label_names, "tenant", "status", "outcome", "reason", "events / bytes",
             "completion id", "detail"]
    numeric = {"sent at (s)", "elapsed (s)", "status", "events / bytes"}
    return [f"{what}: {section['count']} ({shown}{in_json} in report.json).", "",
            _table_row(names), _table_row(["---:" if name in numeric else "---" for name in names]),
            *(_table_row(_cells(row, label_names)) for row in listed[:MAX_ROWS])]


def _table_row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _cells(row: dict[str, Any], label_names: Sequence[str]) -> list[str]:
    return [f"{row['sent_at_s']:.1f}", "-" if row["elapsed_s"] is None else f"{row['elapsed_s']:.2f}",
            *(str(row[name]) for name in label_names), row["tenant"], str(row["status"] or "-"), row["outcome"],
            row["reason"] or "-", f"{row['num_events']} / {row['num_bytes']}",
            row["completion_id"] or row["request_id"] or "-", _detail_cell(row["detail"])]


def _detail_cell(detail: str | None) -> str:
    """A character that does not print (a line break, U+2028) shows as its escape: it is often the
    clue, and it would break the table."""
    if detail is None:
        return "-"
    visible = "".join(c if c.isprintable() else f"\\u{ord(c):04x}" for c in detail)
    cut = visible[:MAX_DETAIL_CHARS] + ("..." if len(visible) > MAX_DETAIL_CHARS else "")
    return "`" + cut.replace("`", "'").replace("|", "\\|") + "`"
