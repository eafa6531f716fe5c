"""StagingPool: buffers are reused across takes, by size class, within the idle cap."""

from __future__ import annotations

import pytest
import torch

from cache_transfer.packing.staging_pool import MIN_CLASS_BYTES, StagingPool

CPU = torch.device("cpu")


def test_a_returned_buffer_serves_any_request_of_its_size_class() -> None:
    pool = StagingPool()
    first = pool.take(300_000, CPU)
    first_ptr = first.data_ptr()
    assert first.numel() == 300_000 and first.dtype == torch.uint8
    pool.give_back(first)

    second = pool.take(400_000, CPU)  # same 512 KiB class

    assert second.data_ptr() == first_ptr and second.numel() == 400_000
    assert pool.num_lent == 1 and pool.idle_bytes == 0


def test_different_size_classes_do_not_share() -> None:
    pool = StagingPool()
    small = pool.take(MIN_CLASS_BYTES, CPU)
    small_ptr = small.data_ptr()
    pool.give_back(small)

    large = pool.take(4 * MIN_CLASS_BYTES, CPU)

    assert large.data_ptr() != small_ptr
    assert pool.idle_bytes == MIN_CLASS_BYTES


def test_idle_memory_is_capped() -> None:
    pool = StagingPool(max_idle_bytes=1 << 20)
    views = [pool.take(1 << 20, CPU) for _ in range(3)]
    for view in views:
        pool.give_back(view)

    assert pool.idle_bytes == 1 << 20
    assert pool.num_lent == 0


def test_a_discarded_buffer_is_never_handed_out_again() -> None:
    pool = StagingPool()
    view = pool.take(1 << 20, CPU)
    view_ptr = view.data_ptr()
    pool.discard(view)

    again = pool.take(1 << 20, CPU)

    assert again.data_ptr() != view_ptr  # `view` is alive, so only a give_back could alias it
    assert pool.num_lent == 1 and pool.idle_bytes == 0


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="num_bytes must be > 0"):
        StagingPool().take(0, CPU)
    with pytest.raises(ValueError, match="max_idle_bytes must be >= 0"):
        StagingPool(max_idle_bytes=-1)
