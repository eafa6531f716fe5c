"""`derived`: what was derived from some caches is reused while the same tensor objects live,
computed afresh for other tensors, and dropped (with whatever it holds) with the caches."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from cache_transfer.packing.checked_caches import derived


class Derived:
    """Stands for what a copy derives (views that would keep a pool's memory alive)."""

    def __init__(self, n: int) -> None:
        self.n = n


def test_derived_once_per_set_of_live_tensors_and_dropped_with_them() -> None:
    k, v = torch.zeros(4, 2), torch.zeros(4, 2)
    builds: list[Derived] = []

    def build() -> Derived:
        builds.append(Derived(len(builds) + 1))
        return builds[-1]

    assert derived((k, v), build).n == 1
    assert derived((k, v), build).n == 1  # the same tensors: not built again
    assert derived((v, k), build).n == 2  # another set (order counts)
    other = torch.zeros(4, 2)
    assert derived((k, other), build).n == 3
    kept = [weakref.ref(d) for d in builds]
    builds.clear()
    gc.collect()
    assert all(ref() is not None for ref in kept)  # remembered while the tensors live
    del other
    gc.collect()
    assert kept[2]() is None  # (k, other) went with `other`
    assert kept[0]() is not None and kept[1]() is not None
    del k
    gc.collect()
    assert kept[0]() is None and kept[1]() is None  # every set that held k is gone


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
