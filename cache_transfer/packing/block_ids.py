"""`CheckedIds`, `check_block_ids`: a request's block ids, checked once against a pool and put
on the cache's device (the hot paths build one per request and slice it per layer: no
per-layer validation, no per-layer host-to-device copy)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

BlockIds = Sequence[int] | torch.Tensor


class CheckedIds:
    """Block ids already checked against a pool, as an int64 tensor on the cache's device."""

    __slots__ = ("index",)

    def __init__(self, index: torch.Tensor) -> None:
        self.index = index

    def __len__(self) -> int:
        return self.index.numel()

    def __getitem__(self, span: slice) -> CheckedIds:
        return CheckedIds(self.index[span])


def check_block_ids(
    block_ids: BlockIds | CheckedIds,
    pool_blocks: int,
    device: torch.device | str,
    *,
    unique: bool = False,
) -> CheckedIds:
    """Validate block ids (vectorised: no Python loop over blocks) and put them on `device`;
    from host to a CUDA device the copy is asynchronous (pinned), so it never waits for the
    stream's queued work. `CheckedIds` are returned as they are (checked already)."""
    if isinstance(block_ids, CheckedIds):
        return block_ids
    ids = torch.as_tensor(block_ids, dtype=torch.int64, device="cpu").reshape(-1)
    if ids.numel() == 0:
        raise ValueError("block_ids is empty: a packed layer needs at least one block")
    low, high = torch.aminmax(ids)
    if low < 0 or high >= pool_blocks:
        bad = ids[(ids < 0) | (ids >= pool_blocks)][:8].tolist()
        raise ValueError(f"block ids {bad} are outside the cache's [0, {pool_blocks}) blocks")
    if unique and torch.unique(ids).numel() != ids.numel():
        raise ValueError(f"destination block ids must be distinct, got {ids[:64].tolist()}")
    device = torch.device(device)
    if device.type == "cuda":
        ids = ids.pin_memory().to(device, non_blocking=True)
    return CheckedIds(ids.to(device))
