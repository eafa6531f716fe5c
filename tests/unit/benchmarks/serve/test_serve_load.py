"""pd-bench serve's arrival processes: seeded Poisson and gamma, and the rate list."""

from __future__ import annotations

import math
import statistics

import pytest

from benchmarks.serve.load import arrival_offsets_s, parse_rates, rate_label


def _gaps(offsets):
    return [b - a for a, b in zip(offsets, offsets[1:])]


def test_parse_rates():
    assert parse_rates("1,2.5, 4") == [1.0, 2.5, 4.0]
    assert parse_rates("inf") == [math.inf]
    for bad in ("0", "-1", "nan", "x", "1,,2"):
        with pytest.raises(ValueError):
            parse_rates(bad)
    assert rate_label(math.inf) == "inf" and rate_label(2.0) == "2"


def test_infinite_rate_sends_everything_at_once():
    assert arrival_offsets_s(5, math.inf) == [0.0] * 5


def test_same_seed_same_times_other_seed_other_times():
    a = arrival_offsets_s(100, 4.0, seed=1)
    assert a == arrival_offsets_s(100, 4.0, seed=1)
    assert a != arrival_offsets_s(100, 4.0, seed=2)
    assert a[0] == 0.0 and a == sorted(a)


def test_poisson_gaps_have_the_rate_as_mean():
    gaps = _gaps(arrival_offsets_s(20001, 10.0, burstiness=1.0, seed=0))
    assert statistics.fmean(gaps) == pytest.approx(0.1, rel=0.05)
    # exponential: the standard deviation equals the mean
    assert statistics.pstdev(gaps) == pytest.approx(0.1, rel=0.05)


def test_burstiness_keeps_the_rate_and_changes_the_spread():
    bursty = _gaps(arrival_offsets_s(20001, 10.0, burstiness=0.25, seed=0))
    regular = _gaps(arrival_offsets_s(20001, 10.0, burstiness=4.0, seed=0))
    for gaps in (bursty, regular):
        assert statistics.fmean(gaps) == pytest.approx(0.1, rel=0.07)
    # gamma with shape k: coefficient of variation 1 / sqrt(k)
    assert statistics.pstdev(bursty) / statistics.fmean(bursty) == pytest.approx(2.0, rel=0.1)
    assert statistics.pstdev(regular) / statistics.fmean(regular) == pytest.approx(0.5, rel=0.1)
    with pytest.raises(ValueError):
        arrival_offsets_s(3, 1.0, burstiness=0)
