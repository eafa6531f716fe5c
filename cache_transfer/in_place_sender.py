"""`InPlaceSending`: the writes-in-place part of `KVSender` (a mixin; `KVSender.__init__`
sets what it reads: `_sharing`, `_kv_device`, `_device`, `_ticket`, `num_blocks`, `in_place`,
`_writer`, and it uses the session's `fail`, `_send_all`, `_notify`, `_advance`).

    may_write_in_place     the ticket's kv_device is ours (and sharing is on): the handshake asks
    _map_pool(export)      the ack granted it: map the receiver's caches (InPlaceWriter)
    _write_in_place        a batch of layers written (or already written by the caller through
                           `in_place_writer`), then their manifests, header only, one message
    send_written_layers    for layers the prefill engine wrote itself as it packed them
    fail                   granted: the receiver hears only once every write launched is done
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import torch

from cache_transfer.in_place_writer import InPlaceWriter
from cache_transfer.state import TransferState
from cache_transfer.transports.cuda_waits import wait_event
from pdserve.v1 import transfer_pb2

logger = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 10.0  # a failed in-place sender waits this long for its launched writes
# packed bytes, or what packs them into a buffer (a LayerBlocks: copied block to block in place)
Source = torch.Tensor | Callable[[torch.Tensor], object]


class InPlaceSending:
    _writer: InPlaceWriter | None

    @property
    def may_write_in_place(self) -> bool:
        """Whether the handshake asks to write in place (the receiver is on our GPU)."""
        ours = self._kv_device
        return self._sharing is not None and bool(ours) and ours == self._ticket.kv_device

    def fail(self, reason: str, *, notify_peer: bool = True) -> None:
        """As any session; granted writes in place, the receiver hears only once every write
        this sender launched is done (writes_drained), whoever ended the transfer."""
        if self.finished or not self.in_place:
            super().fail(reason, notify_peer=notify_peer)
            return
        super().fail(reason, notify_peer=False)
        if self._peer_address is not None:
            self.spawn(self._drain_then_notify(reason))

    async def _drain_then_notify(self, reason: str) -> None:
        if self._writer is not None and not await self._writer.drain(DRAIN_TIMEOUT_S):
            return  # the receiver keeps its blocks until our deadline is past
        result = transfer_pb2.TransferResult(ok=False, error=reason, writes_drained=True)
        await self._notify(result=result)

    @property
    def in_place_writer(self) -> InPlaceWriter | None:
        """Granted writes in place and mapped: what writes a layer into the receiver's blocks
        (any thread); report such layers with `send_written_layers`."""
        return self._writer

    async def send_written_layers(
        self, layer_ids: Sequence[int], token_end: int | None = None
    ) -> None:
        """Layers the caller wrote through `in_place_writer` (their writes complete): tell
        the receiver, one message. ValueError, nothing sent, when any is wrong."""
        if self._writer is None:
            raise ValueError(f"transfer {self.transfer_id}: no writes in place were granted")
        token_end = self.num_tokens if token_end is None else token_end
        if len(set(layer_ids)) != len(layer_ids) or not layer_ids:
            raise ValueError(f"send_written_layers needs distinct layers, got {layer_ids}")
        manifests = [self._manifest(i, *self._layer_span(i, token_end), token_end) for i in layer_ids]  # fmt: skip
        for layer_idx in layer_ids:
            self._layer_token_end[layer_idx] = token_end
        await self._send_layers(manifests, None, self._writer.device)

    async def _write_in_place(
        self,
        manifests: list[transfer_pb2.LayerManifest],
        payloads: list[Source] | None,
        submitted: asyncio.Future[None],
    ) -> None:
        """Land packed layers in the receiver's blocks ourselves (`payloads` None: the caller
        did, through `in_place_writer`, and saw the write complete); once written, tell the
        receiver in one message (header only: a manifest per token span, naming its layers)."""
        assert self._writer is not None
        self._advance(TransferState.TRANSFERRING)
        if payloads is not None:
            try:
                written = self._writer.write(manifests, payloads)
                if written is not None:
                    await wait_event(written, self.remaining_s)
                    self._writer.written(written)
            except Exception as error:  # closed (failed meanwhile), the deadline, CUDA
                self.fail(f"an in-place write did not complete: {error!r}")
                return
        self.num_bytes_sent += sum(m.num_bytes for m in manifests)  # as in _send_payloads
        announced = [(None, {"layer_manifest": m}) for m in _one_per_span(manifests)]
        await self._send_all(announced, submitted)

    def _map_pool(self, export: transfer_pb2.KVPoolExport) -> None:
        """The receiver granted writes in place: map its caches (or send payloads after all,
        which it accepts too, if they cannot be mapped here)."""
        if not self.may_write_in_place or self._device is None:
            self.fail("refused writes in place this sender did not ask for")
            return
        self.in_place = True
        try:
            dst_block_ids = self._ticket.dst_block_ids[: self.num_blocks]
            self._writer = InPlaceWriter(self._sharing, export, dst_block_ids, self._device)
        except Exception as error:  # noqa: BLE001 - the payload path still works
            logger.warning("sender %s: cannot map the receiver's KV pool (%r); sending payloads",
                           self.transfer_id, error)  # fmt: skip


def _one_per_span(
    manifests: list[transfer_pb2.LayerManifest],
) -> list[transfer_pb2.LayerManifest]:
    """Manifests of layers written in place, merged: one per token span (the first layer's,
    the others of that span in `more_layer_ids`): the receiver checks and lands 32 layers of
    one message for little more than one (~23 us of Python each on one H200 host, traced:
    benchmarks/results/2026-12-03-h200-kv-handoff.txt run 25)."""
    by_span: dict[tuple[int, int, int, int], transfer_pb2.LayerManifest] = {}
    for manifest in manifests:
        span = (manifest.block_offset, manifest.num_blocks, manifest.num_bytes, manifest.token_end)
        first = by_span.get(span)
        if first is None:
            manifest.written_in_place = True
            by_span[span] = manifest
        else:
            first.more_layer_ids.append(manifest.layer_idx)
    return list(by_span.values())
