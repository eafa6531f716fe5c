"""`InPlaceWriter`: a sender's writes into a receiver's KV caches, mapped in this process.

    InPlaceWriter(sharing, export, dst_block_ids, device)   maps the receiver's pool (cached by
                                                            `sharing`); ValueError if it cannot
    write(manifests, sources) -> event | None    each layer into its dst blocks, on the current
                                                 stream: LayerBlocks copied block to block (one
                                                 pass, nothing packed; the layers of one span in
                                                 one launch), packed bytes unpacked;
                                                 CUDA: the event that marks them written
    written(event)                               the caller saw it complete
    await drain(timeout_s) -> bool               closes it (write() returns None from then
                                                 on), then: every write launched is done

write() may be called from the prefill engine's thread (a layer written as soon as it is
packed, on the pack stream) while the event loop drains: one lock makes "closed, or this write
is tracked" atomic, so a drained notice never leaves a write behind it.

Only the ticket's dst_block_ids are ever written (the ids are checked against the mapped pool
once, distinct). What mapping a pool trusts: cache_transfer/README.md, "Writes in place".
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import torch

from cache_transfer.in_place.pool_sharing import PoolSharing
from cache_transfer.packing.block_copy import LayerBlocks, copy_layers
from cache_transfer.packing.block_ids import check_block_ids
from cache_transfer.packing.packed_layer import LayerSource, unpack_layer
from cache_transfer.transports.cuda_waits import new_event, wait_event
from pdserve.v1 import transfer_pb2

logger = logging.getLogger(__name__)


class ClosedError(RuntimeError):
    """A write after the transfer ended (the writer was drained)."""


class InPlaceWriter:
    def __init__(
        self,
        sharing: PoolSharing,
        export: transfer_pb2.KVPoolExport,
        dst_block_ids: Sequence[int],
        device: torch.device,
    ) -> None:
        self._caches = sharing.open(export, device)
        self._dst_ids = check_block_ids(
            dst_block_ids, self._caches[0][0].shape[0], device, unique=True
        )
        self.device = device
        self._pending: set[torch.cuda.Event] = set()
        self._lock = threading.Lock()
        self._closed = False

    def write(
        self,
        manifests: Sequence[transfer_pb2.LayerManifest],
        sources: Sequence[LayerSource],
    ) -> torch.cuda.Event | None:
        """Each layer (its blocks in the sender's cache, its packed bytes, or what packs them
        into a buffer) into its blocks, on the current stream; CUDA: the event that marks them
        written. Raises ClosedError once drained (nothing is written then)."""
        with self._lock:
            if self._closed:
                raise ClosedError("the transfer ended: no more writes in place")
            return self._write(manifests, sources)

    def _write(
        self,
        manifests: Sequence[transfer_pb2.LayerManifest],
        sources: Sequence[LayerSource],
    ) -> torch.cuda.Event | None:
        batch: dict[tuple[int, int], list[tuple[LayerBlocks, int]]] = {}
        for manifest, source in zip(manifests, sources, strict=True):
            span = (manifest.block_offset, manifest.num_blocks)
            if isinstance(source, LayerBlocks) and source.k_cache.device == self.device:
                batch.setdefault(span, []).append((source, manifest.layer_idx))
                continue
            k_cache, v_cache = self._caches[manifest.layer_idx]
            dst_ids = self._dst_ids[span[0] : span[0] + span[1]]
            if isinstance(source, torch.Tensor):
                payload = source.to(self.device)
            else:
                payload = torch.empty(manifest.num_bytes, dtype=torch.uint8, device=self.device)
                source(payload)
            unpack_layer(payload, k_cache, v_cache, dst_ids)
        for (first, num_blocks), layers in batch.items():  # block to block, a launch per span
            dsts = [self._caches[layer_idx] for _, layer_idx in layers]
            dst_ids = self._dst_ids[first : first + num_blocks]
            copy_layers([src for src, _ in layers], dsts, dst_ids)
        if self.device.type != "cuda":
            return None  # done already
        written = new_event()
        written.record()
        self._pending.add(written)
        return written

    def written(self, event: torch.cuda.Event) -> None:
        self._pending.discard(event)

    async def drain(self, timeout_s: float) -> bool:
        """Close; True once every write launched has completed, False if one did not in time."""
        with self._lock:
            self._closed = True
        for event in list(self._pending):
            try:
                await wait_event(event, timeout_s)
            except Exception as error:  # noqa: BLE001 - reported as "not drained"
                logger.error("an in-place write did not complete: %r", error)
                return False
            self._pending.discard(event)
        return True
