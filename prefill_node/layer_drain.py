"""`LayerDrain` (event loop): a request's packed layers, handed to its sender as they are packed.

```
queue(outgoing, layer)        a layer the engine thread packed (call_soon_threadsafe);
                              starts the request's drain task once it has a sender and
                              the layer is not held back (one GPU: hold_until)
start(outgoing, sender)       the drain task (LayerStreamer.attach: the layers so far)
drain task                    await the first queued layer's `packed` event (GIL-free,
                              cuda_waits), take it and every queued layer packed by then,
                              send them as one message (KVSender.send_packed_layers; written
                              in place: send_written_layers); any number in flight; a layer
                              packed before the ticket said the receiver holds the prompt's
                              first blocks goes cut to the rest (`suffix_of`)
outgoing.handing              futures done once the drain and each send hold their layers
                              in the sender's hands (LayerStreamer.finish waits for them)
```
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any

import torch

from cache_transfer import TransferState
from cache_transfer.transports.cuda_waits import wait_event
from prefill_node.outgoing import KVSink, Outgoing, PackedLayer

logger = logging.getLogger(__name__)


class LayerDrain:
    def __init__(self, loop: asyncio.AbstractEventLoop, device: torch.device) -> None:
        self._loop = loop
        # the event loop's current stream: nothing is queued on it but what the transport
        # itself does (staging copies), so a transport's wait for it never waits for a pack of
        # a later layer (that waits for the compute of that layer)
        self._send_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._loop_stream_bound = False

    def queue(self, outgoing: Outgoing, layer: PackedLayer) -> None:
        """(event loop) Queue a packed layer; start the request's drain task if none runs."""
        if self._send_stream is not None and not self._loop_stream_bound:
            # the transport orders its reads after this thread's current stream: make that the
            # send stream, never the compute or pack stream (a send would wait for later
            # layers); a layer is handed over only once its `packed` event is seen done
            torch.cuda.set_stream(self._send_stream)
            self._loop_stream_bound = True
        outgoing.queued.append(layer)
        sender = outgoing.sender
        if sender is None:
            return  # attach drains the queue
        if layer.layer_idx < outgoing.hold_until:
            return  # goes with a later layer
        if not outgoing.draining:
            self.start(outgoing, sender)

    def start(self, outgoing: Outgoing, sender: KVSink) -> None:
        outgoing.draining = True
        self._track(outgoing, self._drain(outgoing, sender, self._handing(outgoing)))

    def _track(self, outgoing: Outgoing, coro: Coroutine[Any, Any, None]) -> None:
        task = self._loop.create_task(coro)
        outgoing.tasks.add(task)
        task.add_done_callback(outgoing.tasks.discard)

    def _handing(self, outgoing: Outgoing) -> asyncio.Future[None]:  # `finish` waits for it
        handed = self._loop.create_future()
        outgoing.handing.add(handed)
        handed.add_done_callback(outgoing.handing.discard)
        return handed

    async def _drain(
        self, outgoing: Outgoing, sender: KVSink, handed: asyncio.Future[None]
    ) -> None:
        """Hand queued layers to the sender: whatever is packed when the first one is (one
        GPU: when the layer held until is), as one message (layers in the order they were
        computed); each send runs on its own."""
        try:
            while outgoing.queued:
                await asyncio.sleep(0)  # layers the engine thread queued meanwhile join in
                # packs finish in queue order (one pack stream)
                upto = max(outgoing.hold_until, outgoing.queued[0].layer_idx)
                awaited = [layer for layer in outgoing.queued if layer.layer_idx <= upto][-1]
                if awaited.ready is not None:
                    try:
                        await wait_event(awaited.ready, sender.remaining_s)
                    except Exception as error:  # the deadline, or a CUDA error
                        sender.abort(f"layer {awaited.layer_idx} was not packed: {error!r}")
                        outgoing.queued.clear()
                        return
                batch = [outgoing.queued.popleft()]
                while outgoing.queued and outgoing.queued[0].is_packed:
                    batch.append(outgoing.queued.popleft())
                now = time.monotonic()
                for layer in batch:
                    if layer.ready is not None:  # CUDA: computed when seen packed
                        outgoing.trace.layer_computed_s[layer.layer_idx] = now
                sending = self._send(outgoing, sender, batch, self._handing(outgoing))
                self._track(outgoing, sending)
        finally:
            outgoing.draining = False
            handed.set_result(None)

    async def _send(
        self,
        outgoing: Outgoing,
        sender: KVSink,
        batch: list[PackedLayer],
        handed: asyncio.Future[None],
    ) -> None:
        layers = [layer.layer_idx for layer in batch]
        try:
            written = [layer for layer in batch if layer.written]  # by the engine thread
            writer = sender.in_place_writer
            for layer in written:
                assert writer is not None and layer.ready is not None  # written in place
                writer.written(layer.ready)
            sends = []  # both messages in flight at once
            if written:
                sends.append(sender.send_written_layers([layer.layer_idx for layer in written]))
            packed = [
                (layer.layer_idx, suffix_of(layer, outgoing))
                for layer in batch
                if layer.packed is not None
            ]
            if packed:
                sends.append(sender.send_packed_layers(packed))
            sending = asyncio.gather(*sends)
            await asyncio.sleep(0)  # its tasks ran first (FIFO): the sender holds the layers
            handed.set_result(None)
            await sending
        except Exception as error:  # a bug, not the peer: fail this transfer only
            logger.exception("transfer %s: sending layers %s failed", sender.transfer_id, layers,
                             extra={"request_id": sender.log_id})  # fmt: skip
            sender.abort(f"sending layers {layers} failed: {error!r}")
            return
        finally:
            if not handed.done():
                handed.set_result(None)
        if sender.state != TransferState.FAILED:
            now = time.monotonic()
            for layer_idx in layers:
                outgoing.trace.layer_sent_s[layer_idx] = now


def suffix_of(layer: PackedLayer, outgoing: Outgoing) -> torch.Tensor:
    """A layer's packed blocks the receiver lacks: the packed buffer itself, or, packed before
    the ticket said the receiver holds the prompt's first blocks, a copy of the rest (K's
    blocks, then V's)."""
    assert layer.packed is not None
    extra = outgoing.num_cached_blocks - layer.num_cached_blocks
    if extra == 0:
        return layer.packed
    num_packed = outgoing.num_blocks - layer.num_cached_blocks
    return layer.packed.view(2, num_packed, -1)[:, extra:].reshape(-1)  # a copy: K, V runs
