"""`InPlaceWrites`: the writes-in-place part of one `KVSender`, which owns one.

    asks                          the handshake asks for it: the ticket's kv_device is ours
    take_grant(export)            the ack granted it: map the receiver's caches (InPlaceWriter)
    writes_to(device)             granted and mapped: a cache on `device` is written in place
    await write(manifests, sources, timeout_s)   the layers into the receiver's blocks, waited for
    announcements(manifests)      what tells the receiver: header only, one per token span
    await land(manifests, sources, timeout_s)    both: written (sources None: by the caller,
                                  through `writer`), then the announcements, or why not
    await drain()                 the transfer failed: every write launched is done (or not)
    await drained_notice(reason)  ... and the failed result that says so (writes_drained)

It never talks to the receiver nor ends the session: the sender sends what it returns and
fails with the reasons it returns.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from cache_transfer.in_place.pool_sharing import PoolSharing
from cache_transfer.in_place.writer import InPlaceWriter
from cache_transfer.packing.packed_layer import LayerSource
from cache_transfer.transports.cuda_waits import wait_event
from pdserve.v1 import node_pb2, transfer_pb2

logger = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 10.0  # a failed in-place sender waits this long for its launched writes


class InPlaceWrites:
    def __init__(
        self,
        sharing: PoolSharing | None,
        kv_device: str,
        device: torch.device | None,
        ticket: node_pb2.TransferTicket,
        num_blocks: int,
    ) -> None:
        """`sharing`: how to map a receiver's pool (None: never ask); `kv_device`: the name of
        this node's cache's GPU, as tickets name it; `device`: where the pool is mapped;
        `num_blocks`: of the ticket's dst_block_ids, those the KV goes to."""
        self._sharing = sharing
        self.kv_device = kv_device
        self._device = device
        self._transfer_id = ticket.transfer_id
        self._dst_block_ids = list(ticket.dst_block_ids[:num_blocks])
        self.asks = sharing is not None and bool(kv_device) and kv_device == ticket.kv_device
        self.granted = False  # the receiver granted writes in place
        self.writer: InPlaceWriter | None = None  # ... and its pool is mapped here

    def take_grant(self, export: transfer_pb2.KVPoolExport) -> str | None:
        """The receiver granted writes in place: map its caches (or send payloads after all,
        which it accepts too, if they cannot be mapped here). Why it is refused, or None."""
        if not self.asks or self._sharing is None or self._device is None:
            return "refused writes in place this sender did not ask for"
        self.granted = True
        try:
            self.writer = InPlaceWriter(self._sharing, export, self._dst_block_ids, self._device)
        except Exception as error:  # noqa: BLE001 - the payload path still works
            logger.warning("sender %s: cannot map the receiver's KV pool (%r); sending payloads",
                           self._transfer_id, error)  # fmt: skip
        return None

    def writes_to(self, device: torch.device) -> bool:
        """Whether layers of a cache on `device` are written in place."""
        return self.writer is not None and device == self.writer.device

    async def write(
        self,
        manifests: Sequence[transfer_pb2.LayerManifest],
        sources: Sequence[LayerSource],
        timeout_s: float,
    ) -> str | None:
        """Land the layers in the receiver's blocks ourselves and wait until they are written;
        why they were not (closed: failed meanwhile; the deadline; CUDA), or None."""
        assert self.writer is not None
        try:
            written = self.writer.write(manifests, sources)
            if written is not None:
                await wait_event(written, timeout_s)
                self.writer.written(written)
        except Exception as error:  # the session fails with it
            return f"an in-place write did not complete: {error!r}"
        return None

    async def land(
        self,
        manifests: Sequence[transfer_pb2.LayerManifest],
        sources: Sequence[LayerSource] | None,
        timeout_s: float,
    ) -> list[transfer_pb2.LayerManifest] | str:
        """`write` (unless `sources` is None: the caller wrote them), then `announcements`;
        or why the layers were not written."""
        if sources is not None:
            error = await self.write(manifests, sources, timeout_s)
            if error is not None:
                return error
        return self.announcements(manifests)

    async def drained_notice(self, reason: str) -> transfer_pb2.TransferResult | None:
        """The failed result (`reason`) to tell the receiver once every write launched is
        done, or None when one did not drain (it keeps its blocks until our deadline is past)."""
        if not await self.drain():
            return None
        return transfer_pb2.TransferResult(ok=False, error=reason, writes_drained=True)

    async def drain(self) -> bool:
        """Stop writing; True once every write launched has completed (nothing was mapped: at
        once), False if one did not within DRAIN_TIMEOUT_S (the receiver then keeps its blocks
        until our deadline is past)."""
        return self.writer is None or await self.writer.drain(DRAIN_TIMEOUT_S)

    @staticmethod
    def announcements(
        manifests: Sequence[transfer_pb2.LayerManifest],
    ) -> list[transfer_pb2.LayerManifest]:
        """Manifests of layers written in place, merged: one per token span (the first layer's,
        the others of that span in `more_layer_ids`): the receiver checks and lands 32 layers of
        one message for little more than one (~23 us of Python each on one H200 host, traced:
        benchmarks/results/2026-12-03-h200-kv-handoff.txt run 25)."""
        by_span: dict[tuple[int, int, int, int], transfer_pb2.LayerManifest] = {}
        for manifest in manifests:
            span = (
                manifest.block_offset, manifest.num_blocks, manifest.num_bytes, manifest.token_end
            )  # fmt: skip
            first = by_span.get(span)
            if first is None:
                manifest.written_in_place = True
                by_span[span] = manifest
            else:
                first.more_layer_ids.append(manifest.layer_idx)
        return list(by_span.values())
