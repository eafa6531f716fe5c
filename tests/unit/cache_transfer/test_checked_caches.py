"""`derived`: what was derived from some caches is reused while the same tensor objects live,
computed afresh for other tensors (even at a recycled address), and dropped with the caches."""

from __future__ import annotations

import gc

import pytest
import torch

from cache_transfer import checked_caches
from cache_transfer.checked_caches import derived


def test_derived_once_per_set_of_live_tensors_and_dropped_with_them() -> None:
    k, v = torch.zeros(4, 2), torch.zeros(4, 2)
    builds: list[int] = []

    def build() -> int:
        builds.append(1)
        return len(builds)

    before = checked_caches.num_entries()
    assert derived((k, v), build) == 1
    assert derived((k, v), build) == 1  # the same tensors: not built again
    assert derived((v, k), build) == 2  # another set (order counts)
    other = torch.zeros(4, 2)
    assert derived((k, other), build) == 3
    assert checked_caches.num_entries() == before + 3
    del k, other
    gc.collect()
    assert checked_caches.num_entries() == before  # every set that held k or other is gone


def test_a_failed_build_is_not_remembered() -> None:
    k = torch.zeros(2)
    calls: list[int] = []

    def failing() -> None:
        calls.append(1)
        raise ValueError("mismatched caches")

    for _ in range(2):
        with pytest.raises(ValueError, match="mismatched"):
            derived((k,), failing)
    assert len(calls) == 2  # built again: a failure is not an answer to keep
