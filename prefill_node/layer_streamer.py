"""`LayerStreamer`: the prefill engine's per-layer hook, turned into KV sends.

    event loop     open(request_id, num_tokens)                 before the engine sees the request
    event loop     attach(request_id, sender)                   once its ticket is in: at once,
                                                                or later (the router starts the
                                                                prefill before it has the ticket)
    engine thread  on_layer_done(layer_idx, chunks)             right after a layer's KV is queued
                     a request's first chunk: loop.call_soon_threadsafe: sender.start() (or at
                       attach): the handshake and the transfer's deadline start with the
                       prefill, not while the request queues
                     for each chunk that ends its prompt, of a request whose sender is live
                     or not attached yet (its layers wait, packed, in its queue):
                       CUDA: record an event on the compute stream; on the pack stream wait
                             for it and pack (one kernel, K and V); writes in place granted:
                             copy the blocks straight into the receiver's blocks instead (one
                             kernel, one pass, nothing packed: sender.in_place_writer; the
                             loop sends only its header); record `packed`. Nothing waits on
                             the host: the forward is never stalled.
                       CPU:  pack (one index_select) into a new buffer
                       loop.call_soon_threadsafe(queue it)      the next layers compute meanwhile
    event loop     the request's drain task: await the first queued layer's `packed` event
                   (GIL-free, cuda_waits), take it and every queued layer packed by then, and
                   send them as one message (KVSender.send_packed_layers: fewer, larger
                   messages; the decode node still lands and reports each layer); any number
                   in flight. On the receiver's own GPU (the ticket's kv_device) the drain
                   starts with the last layer and hands every layer over at once (those
                   written in place as computed: one manifest message): the decode process
                   puts no work on the GPU, nor our event loop GIL time, during the forward
                   attach: the layers queued so far go out as above (the drain starts)
                   finish(): every layer sent ─► send_first_token ─► await the receiver's result
                   close(): drop the request; a sender still live is failed (the peer is told)

Packing is queued from the engine thread, so it snapshots the blocks: the bytes sent do not
depend on what the engine does to the blocks afterwards (a request whose first token finishes it
frees its blocks in the same step; on CUDA the compute stream waits for the pack stream after
the last layer, so nothing queued later can overwrite a block before it is packed), and the
transport sends that one buffer as it is. The request's block ids are checked and copied to the
device once (first layer), asynchronously.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cache_transfer import KVLayout, KVSender, LayerBlocks, TransferState, pack_layer
from cache_transfer.in_place_writer import ClosedError
from cache_transfer.layout import kv_device_id
from cache_transfer.packing import CheckedIds, check_block_ids
from cache_transfer.transports.cuda_waits import wait_event
from engine.scheduler_output import ScheduledChunk
from pdserve.v1 import generation_pb2
from pdserve.v1.transfer_pb2 import LayerManifest

logger = logging.getLogger(__name__)

MAX_TRACES = 1024  # transfers whose TransferTrace is kept (the most recent)
# CUDA: while a step streams KV, the engine thread runs at most this many layers ahead of the
# GPU. Left alone it would queue the whole forward at once and then block (inside a kernel
# launch, on a full launch queue, or in the step's final copy) holding the GIL, so the event
# loop could not send a layer until the forward ended. Waiting on an event releases the GIL;
# two layers of queued work keep the GPU busy. Layers sent at the end (one GPU) do not bound it.
RUN_AHEAD_LAYERS = 2


@dataclass
class TransferTrace:
    """When each layer of one transfer was computed (the engine's hook fired) and when its send
    completed, in `time.monotonic()` seconds; None where that never happened."""

    transfer_id: str
    request_id: str
    layer_computed_s: list[float | None]
    layer_sent_s: list[float | None]
    # CUDA: layer_computed_s is when the sender saw the layer's KV-written event complete (the
    # hook runs ahead of the GPU; sent at the end: all layers, after the last); CPU: the hook ran
    # milestones by name: "rpc", "computing", "first_token", "layers_sent", "result"
    marks_s: dict[str, float] = field(default_factory=dict)

    def mark(self, name: str) -> None:
        self.marks_s[name] = time.monotonic()


@dataclass
class _PackedLayer:
    """One layer of one request, packed (or queued to be) for sending."""

    layer_idx: int
    packed: torch.Tensor | None  # flat uint8 `[2, num_blocks, block_size, kv_heads, head_dim]`
    ready: torch.cuda.Event | None  # CUDA: recorded once packed; None: packed already
    written: bool = False  # CUDA, in place: copied (`packed` None), `ready` marks it written

    @property
    def is_packed(self) -> bool:
        return self.ready is None or self.ready.query()


@dataclass
class _Outgoing:
    """One request's sends. `broken`, `computing` and `src_ids` are the engine thread's, the
    rest the event loop's (the engine thread reads `sender`)."""

    trace: TransferTrace
    num_blocks: int  # the prompt's blocks, each layer's packed size
    sender: KVSender | None = None  # None until attach (the ticket follows the call)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)  # the drain task and sends
    queued: deque[_PackedLayer] = field(default_factory=deque)  # not yet handed to the sender
    draining: bool = False  # a drain task runs
    broken: bool = False  # packing a layer failed: later layers are not sent
    computing: bool = False  # (engine thread) the engine computed a chunk of it
    started: bool = False  # (event loop) ... and the loop heard: the sender starts (on attach)
    send_at_end: bool = False  # the receiver shares our GPU (known at attach): every layer
    # handed to the sender after the last
    src_ids: CheckedIds | None = None  # the request's block ids on the cache's device


class LayerStreamer:
    def __init__(
        self,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        layout: KVLayout,
        loop: asyncio.AbstractEventLoop,
        max_traces: int = MAX_TRACES,
        kv_device: str | None = None,
    ) -> None:
        """`kv_caches`: the engine's per-layer `(k_cache, v_cache)`, of `layout`; `loop`: where
        sends run; `kv_device`: this cache's device as tickets name it (default:
        `kv_device_id`)."""
        self.traces: OrderedDict[str, TransferTrace] = OrderedDict()  # by transfer_id
        self._kv_caches = kv_caches
        self._layout = layout
        self._loop = loop
        self._max_traces = max_traces
        self._outgoing: dict[str, _Outgoing] = {}  # by request_id
        device = kv_caches[0][0].device
        self._kv_device = kv_device_id(device) if kv_device is None else kv_device
        self._pack_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # the event loop's current stream: nothing is queued on it but what the transport
        # itself does (staging copies), so a transport's wait for it never waits for a pack of
        # a later layer (that waits for the compute of that layer)
        self._send_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._loop_stream_bound = False
        # engine thread, CUDA: this step's newest pack event per layer streamed so far
        self._layers_queued: deque[torch.cuda.Event] = deque()

    def open(self, request_id: str, num_tokens: int) -> TransferTrace:
        """Pack `request_id`'s KV (`num_tokens` prompt tokens) as the engine computes it; it
        goes out through the sender `attach` gives (layers computed before wait for it)."""
        if request_id in self._outgoing:
            raise ValueError(f"request {request_id!r} is already sending its KV")
        num_layers = len(self._kv_caches)
        trace = TransferTrace("", request_id, [None] * num_layers, [None] * num_layers)
        num_blocks = self._layout.num_blocks_for(num_tokens)
        self._outgoing[request_id] = _Outgoing(trace, num_blocks)
        return trace

    def attach(self, request_id: str, sender: KVSender) -> None:
        """(event loop) Send `request_id`'s KV through `sender` (its ticket is in): the layers
        packed so far go out now, the rest as they are computed."""
        outgoing = self._outgoing.get(request_id)
        if outgoing is None:
            raise ValueError(f"request {request_id!r} is not open")
        if outgoing.sender is not None:
            raise ValueError(f"request {request_id!r} already has a sender")
        if sender.num_blocks != outgoing.num_blocks:
            raise ValueError(
                f"request {request_id!r}: a sender of {sender.num_blocks} blocks for a prompt "
                f"of {outgoing.num_blocks}"
            )
        trace = outgoing.trace
        trace.transfer_id = sender.transfer_id
        self.traces[sender.transfer_id] = trace
        while len(self.traces) > self._max_traces:
            self.traces.popitem(last=False)
        # One GPU: a receive per layer on the decode side would interrupt this forward (~0.3
        # ms each, time-sliced); written in place, a message per layer still took ~0.5 ms of
        # our loop's GIL time from the launches (2K: 1.3-1.5 -> 1.5-2.5 ms per layer). So
        # nothing goes before the last layer (writes in place still run as layers compute)
        same_gpu = bool(self._kv_device) and sender.dst_kv_device == self._kv_device
        outgoing.send_at_end = same_gpu
        outgoing.sender = sender
        if outgoing.started:
            sender.start()
        if outgoing.queued and not outgoing.draining:
            last = outgoing.queued[-1].layer_idx == len(self._kv_caches) - 1
            if last or not outgoing.send_at_end:
                outgoing.draining = True
                self._track(outgoing, self._drain(outgoing))

    def on_layer_done(self, layer_idx: int, chunks: Sequence[ScheduledChunk]) -> None:
        """The engine's hook (engine thread): start layer `layer_idx`'s send for every request
        whose prompt ends in this step."""
        packed: torch.cuda.Event | None = None  # CUDA: this layer's last streamed pack, if any
        for chunk in chunks:
            request = chunk.request
            outgoing = self._outgoing.get(request.request_id)
            if outgoing is None:
                continue
            if not outgoing.computing:  # its prefill started (this step): so does the transfer
                outgoing.computing = True
                outgoing.trace.mark("computing")
                self._loop.call_soon_threadsafe(self._start, outgoing)
            if chunk.end_pos != request.prompt_len:
                continue
            sender = outgoing.sender  # (set by the event loop: read once)
            if outgoing.broken or (sender is not None and sender.finished):
                continue
            try:
                layer = self._pack(outgoing, chunk, layer_idx)
            except Exception:  # never let one request's send kill the engine thread
                logger.exception(
                    "request %s: could not pack layer %d", request.request_id, layer_idx
                )
                outgoing.broken = True
                continue
            if layer.ready is None:
                outgoing.trace.layer_computed_s[layer_idx] = time.monotonic()
            self._loop.call_soon_threadsafe(self._queue, outgoing, layer)
            if not outgoing.send_at_end:  # nothing to send before the last layer otherwise
                packed = layer.ready
        if self._pack_stream is None:
            return
        self._bound_run_ahead(layer_idx, packed)
        if layer_idx == len(self._kv_caches) - 1:
            # later work on the compute stream (the next step may reuse freed blocks) runs
            # after every pack queued so far: a GPU-side wait, the host goes on
            torch.cuda.current_stream(self._pack_stream.device).wait_stream(self._pack_stream)

    def _bound_run_ahead(self, layer_idx: int, packed: torch.cuda.Event | None) -> None:
        """(engine thread, CUDA) Keep the host at most RUN_AHEAD_LAYERS layers ahead of the GPU
        while this step streams KV (see RUN_AHEAD_LAYERS), waiting on the pack events (a layer
        is packed after it is computed); the GPU itself never waits."""
        if layer_idx == 0:
            self._layers_queued.clear()  # a new step
        if packed is None:  # nothing of this layer is sent
            return
        self._layers_queued.append(packed)
        while len(self._layers_queued) > RUN_AHEAD_LAYERS:
            self._layers_queued.popleft().synchronize()  # releases the GIL while it waits

    async def finish(
        self,
        request_id: str,
        token_id: int,
        logprob: generation_pb2.TokenLogprob | None,
        finish_reason: str,
    ) -> KVSender:
        """Once every layer's send is done, send the first token and wait for the receiver's
        result (within the sender's deadline); the finished sender."""
        outgoing = self._outgoing[request_id]
        sender = outgoing.sender
        if sender is None:
            raise ValueError(f"request {request_id!r} has no sender (attach) to finish")
        sender.start()  # (the engine's hook started it unless no layer ran, e.g. no hook)
        while outgoing.tasks and sender.remaining_s > 0:  # a drain task may start more sends
            await asyncio.wait(set(outgoing.tasks), timeout=sender.remaining_s)
        outgoing.trace.mark("layers_sent")
        try:
            await sender.send_first_token(token_id, logprob, finish_reason)
        except ValueError as error:  # some layer never went out
            sender.abort(str(error))
        await sender.wait()
        outgoing.trace.mark("result")
        return sender

    def abort(self, request_id: str, reason: str) -> bool:
        """Fail the request's transfer (the receiver is told); False when none is open."""
        outgoing = self._outgoing.get(request_id)
        if outgoing is None or outgoing.sender is None:
            return False
        outgoing.sender.abort(reason)
        return True

    def close(self, request_id: str, reason: str) -> None:
        """Forget the request; fail its sender if it is still live. Sends in progress end on
        their own (a failed sender sends nothing more)."""
        outgoing = self._outgoing.pop(request_id, None)
        if outgoing is not None and outgoing.sender is not None and not outgoing.sender.finished:
            outgoing.sender.abort(reason)

    def _pack(self, outgoing: _Outgoing, chunk: ScheduledChunk, layer_idx: int) -> _PackedLayer:
        """The request's blocks of one layer packed into a new buffer on the cache's device;
        on CUDA queued on the pack stream behind the compute stream's KV write, with the
        event that marks it packed."""
        k_cache, v_cache = self._kv_caches[layer_idx]
        if outgoing.src_ids is None:
            block_ids = chunk.block_ids[: outgoing.num_blocks]
            outgoing.src_ids = check_block_ids(block_ids, k_cache.shape[0], k_cache.device)
        num_bytes = self._layout.layer_bytes(outgoing.num_blocks)
        if self._pack_stream is None:
            packed = torch.empty(num_bytes, dtype=torch.uint8, device=k_cache.device)
            return _PackedLayer(
                layer_idx, pack_layer(k_cache, v_cache, outgoing.src_ids, packed), None
            )
        computed = torch.cuda.Event()
        computed.record(torch.cuda.current_stream(k_cache.device))  # after the layer's KV write
        sender = outgoing.sender
        writer = sender.in_place_writer if sender is not None else None
        with torch.cuda.stream(self._pack_stream):
            self._pack_stream.wait_event(computed)
            if writer is not None:  # block to block into the receiver's blocks: nothing packed
                manifest = LayerManifest(
                    layer_idx=layer_idx, num_blocks=outgoing.num_blocks, num_bytes=num_bytes
                )
                blocks = LayerBlocks(k_cache, v_cache, outgoing.src_ids)
                with contextlib.suppress(ClosedError):  # failed: packed below, sent nowhere
                    written = writer.write([manifest], [blocks])
                    return _PackedLayer(layer_idx, None, written, written=True)
            packed = torch.empty(num_bytes, dtype=torch.uint8, device=k_cache.device)
            pack_layer(k_cache, v_cache, outgoing.src_ids, packed)
            ready = torch.cuda.Event()
            ready.record(self._pack_stream)
        return _PackedLayer(layer_idx, packed, ready)

    def _queue(self, outgoing: _Outgoing, layer: _PackedLayer) -> None:
        """(event loop) Queue a packed layer; start the request's drain task if none runs."""
        if self._send_stream is not None and not self._loop_stream_bound:
            # the transport orders its reads after this thread's current stream: make that the
            # send stream, never the compute or pack stream (a send would wait for later
            # layers); a layer is handed over only once its `packed` event is seen done
            torch.cuda.set_stream(self._send_stream)
            self._loop_stream_bound = True
        outgoing.queued.append(layer)
        if outgoing.sender is None:
            return  # attach drains the queue
        if outgoing.send_at_end and layer.layer_idx != len(self._kv_caches) - 1:
            return  # goes with the last layer
        if not outgoing.draining:
            outgoing.draining = True
            self._track(outgoing, self._drain(outgoing))

    def _start(self, outgoing: _Outgoing) -> None:
        """(event loop) The request's prefill started: so does its transfer, once attached."""
        outgoing.started = True
        if outgoing.sender is not None:
            outgoing.sender.start()

    def _track(self, outgoing: _Outgoing, coro: Coroutine[Any, Any, None]) -> None:
        task = self._loop.create_task(coro)
        outgoing.tasks.add(task)
        task.add_done_callback(outgoing.tasks.discard)

    async def _drain(self, outgoing: _Outgoing) -> None:
        """Hand queued layers to the sender: whatever is packed when the first one is (with
        send_at_end: the last one, so all), as one message (layers in the order they were
        computed); each send runs on its own."""
        sender = outgoing.sender
        try:
            while outgoing.queued:
                await asyncio.sleep(0)  # layers the engine thread queued meanwhile join in
                # packs finish in queue order (one pack stream)
                awaited = outgoing.queued[-1 if outgoing.send_at_end else 0]
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
                self._track(outgoing, self._send(outgoing, batch))
        finally:
            outgoing.draining = False

    async def _send(self, outgoing: _Outgoing, batch: list[_PackedLayer]) -> None:
        sender = outgoing.sender
        layers = [layer.layer_idx for layer in batch]
        try:
            written = [layer for layer in batch if layer.written]  # by the engine thread
            for layer in written:
                sender.in_place_writer.written(layer.ready)
            sends = []  # both messages in flight at once
            if written:
                sends.append(sender.send_written_layers([layer.layer_idx for layer in written]))
            packed = [(layer.layer_idx, layer.packed) for layer in batch if not layer.written]
            if packed:
                sends.append(sender.send_packed_layers(packed))
            await asyncio.gather(*sends)
        except Exception as error:  # a bug, not the peer: fail this transfer only
            logger.exception("transfer %s: sending layers %s failed", sender.transfer_id, layers)
            sender.abort(f"sending layers {layers} failed: {error!r}")
            return
        if sender.state != TransferState.FAILED:
            now = time.monotonic()
            for layer_idx in layers:
                outgoing.trace.layer_sent_s[layer_idx] = now
