"""pd-bench serve's metric arithmetic on synthetic timelines (vLLM's definitions)."""

from __future__ import annotations

import math
import random

import pytest

from benchmarks.serve.metrics import NO_FINISH, OK, RequestRecord, Slo, percentile, summarize


def _record(index, send, chunks, end, status=OK, prompt_len=10):
    """`chunks`: [(arrival_s, num_tokens), ...]."""
    return RequestRecord(
        index=index, prompt_len=prompt_len, max_tokens=100, send_s=send, end_s=end,
        chunk_times_s=[t for t, _ in chunks], chunk_tokens=[n for _, n in chunks],
        status=status, finish_reason="length" if status == OK else "",
    )  # fmt: skip


def test_percentile_interpolates_like_numpy():
    values = [random.Random(3).uniform(0, 10) for _ in range(37)]
    ordered = sorted(values)
    assert percentile(values, 0) == ordered[0]
    assert percentile(values, 100) == ordered[-1]
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    assert percentile([5.0], 99) == 5.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_request_timings_follow_vllm_definitions():
    # sent at 1.0; chunks of 1, 2, 1 tokens at 1.5, 1.7, 2.0; stream ends at 2.1
    record = _record(0, 1.0, [(1.5, 1), (1.7, 2), (2.0, 1)], 2.1)
    assert record.output_len == 4
    assert record.ttft_s == pytest.approx(0.5)
    assert record.e2e_s == pytest.approx(1.1)
    assert record.tpot_s == pytest.approx((1.1 - 0.5) / 3)  # (E2E - TTFT) / (tokens - 1)
    assert record.itls_s == pytest.approx([0.2, 0.3])  # one gap per later chunk


def test_one_token_request_has_ttft_but_no_tpot():
    record = _record(0, 0.0, [(0.2, 1)], 0.25)
    assert record.ttft_s == pytest.approx(0.2)
    assert record.tpot_s is None
    assert record.itls_s == []


def test_summary_counts_failed_requests_as_failed_never_fast():
    records = [
        _record(0, 0.0, [(0.1, 1), (0.2, 1)], 0.2),
        _record(1, 0.0, [], 0.001, status="INVALID_ARGUMENT"),  # failed at once
        _record(2, 0.0, [(0.05, 1)], 0.06, status=NO_FINISH),  # cut without a finish
        _record(3, 0.0, [(0.3, 1), (0.5, 1)], 0.5),
    ]
    summary = summarize(records, duration_s=2.0, slo=Slo())
    assert summary["num_sent"] == 4
    assert summary["num_completed"] == 2
    assert summary["num_failed"] == 2
    assert summary["failures_by_status"] == {"INVALID_ARGUMENT": 1, NO_FINISH: 1}
    assert summary["ttft_ms"]["count"] == 2  # only completed requests' timings
    assert summary["ttft_ms"]["mean"] == pytest.approx(200.0)  # (100 + 300) / 2, not the 1 ms
    assert summary["request_throughput"] == pytest.approx(1.0)
    assert summary["output_throughput"] == pytest.approx(2.0)
    assert summary["total_token_throughput"] == pytest.approx((20 + 4) / 2.0)
    assert summary["goodput"] == pytest.approx(1.0)  # no SLO: every completed request
    assert summary["slo_attainment"] == pytest.approx(0.5)


def test_goodput_with_each_slo_and_both():
    fast = _record(0, 0.0, [(0.1, 1), (0.11, 1)], 0.11)  # TTFT 100 ms, TPOT 10 ms
    slow_first = _record(1, 0.0, [(0.4, 1), (0.41, 1)], 0.41)  # TTFT 400, TPOT 10
    slow_decode = _record(2, 0.0, [(0.1, 1), (0.2, 1)], 0.2)  # TTFT 100, TPOT 100
    one_token = _record(3, 0.0, [(0.1, 1)], 0.1)  # TTFT 100, no TPOT
    records = [fast, slow_first, slow_decode, one_token]
    good = lambda slo: summarize(records, 1.0, slo)["num_good"]  # noqa: E731
    assert good(Slo()) == 4
    assert good(Slo(ttft_ms=250)) == 3
    assert good(Slo(tpot_ms=50)) == 3  # a request without TPOT meets a TPOT target
    assert good(Slo(ttft_ms=250, tpot_ms=50)) == 2
    assert summarize(records, 2.0, Slo(ttft_ms=250, tpot_ms=50))["goodput"] == pytest.approx(1.0)


def test_distribution_is_ordered_and_in_ms():
    rng = random.Random(7)
    records = []
    for i in range(50):
        ttft = rng.uniform(0.01, 1.0)
        records.append(_record(i, 0.0, [(ttft, 1), (ttft + 0.02, 3)], ttft + 0.02))
    summary = summarize(records, 10.0, Slo())
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        d = summary[metric]
        assert d["median"] <= d["p90"] <= d["p99"]
    assert summary["tpot_ms"]["mean"] == pytest.approx(20.0 / 3)
    assert summary["itl_ms"]["median"] == pytest.approx(20.0)


def test_empty_run_has_no_figures():
    summary = summarize([_record(0, 0.0, [], 0.1, status="UNAVAILABLE")], 0.1, Slo(100, 10))
    assert summary["num_completed"] == 0 and summary["goodput"] == 0.0
    assert summary["ttft_ms"]["p90"] is None and summary["ttft_ms"]["count"] == 0
    assert math.isnan(summarize([], 0.0, Slo())["request_throughput"])
