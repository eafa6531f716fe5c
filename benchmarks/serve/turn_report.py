"""`pd-bench serve --multi-turn`'s figures per turn index: TTFT, and the KV bytes each turn's
hand-off moved and skipped (the decode nodes' counters, read around each turn when requests
ran one at a time).

```
turn  n  prompt  growth  TTFT mean / median / p90 (ms)  KV MiB  skipped MiB  KV B/growth tok
```
`growth`: prompt tokens beyond the previous turn's prompt (its answer and the new message; the
whole prompt for turn 1): a suffix-only hand-off moves KV in proportion to it, a full one in
proportion to the prompt. A last row, `2+`, takes every turn after the first together.
"""

from __future__ import annotations

from typing import Any

from benchmarks.serve.metrics import distribution_ms
from benchmarks.serve.multi_turn import TurnRecord
from benchmarks.serve.report import fmt, table

MIB = 1 << 20


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def turn_summary(records: list[TurnRecord]) -> list[dict[str, Any]]:
    """One row per turn index, its completed turns' figures; then, with later turns, one row
    "2+" over every turn after the first (a conversation's reused turns, together)."""
    indices = sorted({r.turn for r in records})
    rows = [_turn_row(turn, [r for r in records if r.turn == turn]) for turn in indices]
    if len(indices) > 1:
        rows.append(_turn_row("2+", [r for r in records if r.turn >= 2]))
    return rows


def _turn_row(turn: int | str, records: list[TurnRecord]) -> dict[str, Any]:
    done = [r for r in records if r.completed]
    exact = [r for r in done if r.kv_bytes is not None and r.kv_skipped_bytes is not None]
    growth = sum(r.growth_len for r in exact)
    return {
        "turn": turn,
        "num_completed": len(done),
        "mean_prompt_len": _mean([r.prompt_len for r in done]),
        "mean_growth_len": _mean([r.growth_len for r in done]),
        "ttft_ms": distribution_ms([r.ttft_s for r in done if r.ttft_s is not None]),
        "num_exact_kv": len(exact),
        "mean_kv_bytes": _mean([r.kv_bytes or 0 for r in exact]),
        "mean_kv_skipped_bytes": _mean([r.kv_skipped_bytes or 0 for r in exact]),
        "kv_bytes_per_growth_token": sum(r.kv_bytes or 0 for r in exact) / growth
        if growth else None,
    }  # fmt: skip


def turn_table(config: str, rows: list[dict[str, Any]]) -> str:
    header = ["config", "turn", "n", "prompt", "growth", "TTFT mean", "median", "p90",
              "KV MiB", "skipped MiB", "KV B/growth tok"]  # fmt: skip
    body = []
    for row in rows:
        ttft = row["ttft_ms"]
        kv, skipped = row["mean_kv_bytes"], row["mean_kv_skipped_bytes"]
        body.append([
            config, str(row["turn"]), str(row["num_completed"]), fmt(row["mean_prompt_len"]),
            fmt(row["mean_growth_len"]), fmt(ttft["mean"]), fmt(ttft["median"]),
            fmt(ttft["p90"]), fmt(kv / MIB if kv is not None else None, 2),
            fmt(skipped / MIB if skipped is not None else None, 2),
            fmt(row["kv_bytes_per_growth_token"], 0),
        ])  # fmt: skip
    return table(header, body)
