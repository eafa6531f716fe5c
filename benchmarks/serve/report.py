"""How `pd-bench serve` / `compare` show their runs: tables, a JSON file, a plot.

A run is {"config": name, "request_rate": r, "summary": serve_metrics.summarize(...),
"requests": [per-request timelines]}. `--json FILE` holds the command, the SLO, the dataset and
every run; `--plot FILE.png` draws goodput and p90 TTFT / TPOT against the request rate, one
line per configuration (matplotlib, Agg backend, imported only when plotting).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from benchmarks.serve.load import rate_label
from benchmarks.serve.metrics import Slo


def fmt(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    head = "  ".join(cell.rjust(width) for cell, width in zip(header, widths))
    return "\n".join([head, "  ".join("-" * w for w in widths), *lines])


def throughput_table(runs: list[dict]) -> str:
    header = ["config", "rate", "sent", "ok", "failed", "dur s", "req/s", "out tok/s",
              "goodput", "SLO %"]  # fmt: skip
    rows = []
    for run in runs:
        s = run["summary"]
        rows.append([run["config"], rate_label(run["request_rate"]), str(s["num_sent"]),
                     str(s["num_completed"]), str(s["num_failed"]), fmt(s["duration_s"]),
                     fmt(s["request_throughput"], 2), fmt(s["output_throughput"]),
                     fmt(s["goodput"], 2), fmt(100 * s["slo_attainment"])])  # fmt: skip
    return table(header, rows)


def latency_table(runs: list[dict]) -> str:
    header = ["config", "rate", "metric (ms)", "mean", "median", "p90", "p99"]
    rows = []
    for run in runs:
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            d = run["summary"][metric]
            rows.append([run["config"], rate_label(run["request_rate"]), metric[:-3].upper(),
                         *(fmt(d[k]) for k in ("mean", "median", "p90", "p99"))])  # fmt: skip
    return table(header, rows)


def failures_text(runs: list[dict]) -> str:
    lines = []
    for run in runs:
        failures = run["summary"]["failures_by_status"]
        if failures:
            first = next(r["error"] for r in run["requests"] if r["status"] != "OK")
            lines.append(f"{run['config']} @ {rate_label(run['request_rate'])}: {failures} "
                         f"(first: {first[:200]})")  # fmt: skip
    return "\n".join(lines)


def slo_text(slo: Slo) -> str:
    parts = [f"TTFT <= {slo.ttft_ms:g} ms" if slo.ttft_ms is not None else None,
             f"TPOT <= {slo.tpot_ms:g} ms" if slo.tpot_ms is not None else None]  # fmt: skip
    return " and ".join(p for p in parts if p) or "none (goodput = completed requests/s)"


def max_goodput(runs: list[dict], config: str) -> float:
    return max((r["summary"]["goodput"] for r in runs if r["config"] == config), default=0.0)


def write_json(path: str | Path, payload: dict) -> None:
    text = json.dumps(payload, indent=1, allow_nan=True)
    Path(path).write_text(text + "\n", encoding="utf-8")


def plot(path: str | Path, runs: list[dict], slo: Slo) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({r["request_rate"] for r in runs})
    configs = list(dict.fromkeys(r["config"] for r in runs))
    panels = [("goodput (req/s)", lambda s: s["goodput"], None),
              ("p90 TTFT (ms)", lambda s: s["ttft_ms"]["p90"], slo.ttft_ms),
              ("p90 TPOT (ms)", lambda s: s["tpot_ms"]["p90"], slo.tpot_ms)]  # fmt: skip
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for axis, (title, value, target) in zip(axes, panels):
        for config in configs:
            by_rate = {
                r["request_rate"]: value(r["summary"]) for r in runs if r["config"] == config
            }
            xs = [i for i, rate in enumerate(rates) if by_rate.get(rate) is not None]
            axis.plot(xs, [by_rate[rates[i]] for i in xs], marker="o", label=config)
        if target is not None:
            axis.axhline(target, color="gray", linestyle="--", label="SLO")
        axis.set_xticks(range(len(rates)), [rate_label(r) for r in rates])
        axis.set_xlabel("request rate (req/s)")
        axis.set_title(title)
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle(f"pd-bench: SLO {slo_text(slo)}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
