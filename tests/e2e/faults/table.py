"""The fault table: every fault test writes one row; `python -m tests.e2e.faults.table` prints
them (a Markdown table, for the closing note of issue 15); pytest prints it at the end of a run
that ran fault tests (tests/e2e/faults/conftest.py).

Rows are JSON lines appended to `$PDSERVE_FAULT_TABLE` (default: pdserve-fault-table-<hash of
this checkout's path>.jsonl in the system's temporary folder: runs of two checkouts on one
machine keep apart); a pytest run that may run fault tests starts the file afresh, its parallel
workers append to it (tests/conftest.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

ENV_VAR = "PDSERVE_FAULT_TABLE"
_CHECKOUT = Path(__file__).resolve().parents[3]
COLUMNS = ("fault", "sent", "completed", "clear_errors", "leaked_blocks", "hung", "notes")


@dataclass
class FaultRow:
    fault: str
    sent: int
    completed: int  # requests that got their tokens and a finish_reason
    clear_errors: int  # requests that got a status from the allowed set, with a message
    leaked_blocks: int  # KV blocks not free again on the surviving nodes
    hung: int  # requests past their deadline (DEADLINE_EXCEEDED, or no answer)
    notes: str = ""


def table_path() -> Path:
    explicit = os.environ.get(ENV_VAR)
    if explicit:
        return Path(explicit)
    checkout = hashlib.sha256(str(_CHECKOUT).encode()).hexdigest()[:8]
    return Path(tempfile.gettempdir()) / f"pdserve-fault-table-{checkout}.jsonl"


def reset() -> None:
    table_path().unlink(missing_ok=True)


def record(row: FaultRow) -> None:
    with table_path().open("a", encoding="utf-8") as f:
        f.write(json.dumps(asdict(row)) + "\n")


def read_rows(path: Path | None = None) -> list[FaultRow]:
    path = path or table_path()
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    return [FaultRow(**json.loads(line)) for line in lines if line.strip()]


def render(rows: list[FaultRow]) -> str:
    """A Markdown table with a totals row."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(str(getattr(row, c)) for c in COLUMNS) + " |")
    if rows:
        totals = [sum(getattr(r, c) for r in rows) for c in COLUMNS[1:-1]]
        lines.append("| **total** | " + " | ".join(str(t) for t in totals) + " | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    path = Path(argv[0]) if argv else table_path()
    rows = read_rows(path)
    if not rows:
        print(f"no fault rows in {path} (run: pytest tests/e2e/faults)", file=sys.stderr)
        return 1
    print(render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
