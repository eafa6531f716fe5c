"""`LayerStreamer`: the prefill engine's per-layer hook, turned into KV sends.

    event loop     open(request_id, num_tokens)                 before the engine sees the request
    event loop     attach(request_id, sender)                   once its ticket is in: at once,
                                                                or later (the router starts the
                                                                prefill before it has the ticket)
    engine thread  on_layer_done(layer_idx, chunks)             right after a layer's KV is queued
                   (chunks: the step's PrefillLayerChunk records, engine/outputs.py)
                     a request's first chunk: loop.call_soon_threadsafe: sender.start() (or at
                       attach): the hand-off's own time starts with the prefill
                     the last layer of a chunk: the request's computed tokens (`progress()`,
                       read by ProgressBeats)
                     for each chunk that ends its prompt, of a request whose sender is live
                     or not attached yet (its layers wait, packed, in its queue):
                       LayerPacker.pack (prefill_node/layer_packer.py): packed, or written in
                       place, on the pack stream behind the KV write; the forward never waits
                       loop.call_soon_threadsafe(queue it)      the next layers compute meanwhile
                     LayerPacker.layer_done: (CUDA) the host's run-ahead bounded
    event loop     the request's drain task (LayerDrain, prefill_node/layer_drain.py): await
                   the first queued layer's `packed` event (GIL-free, cuda_waits), take it and
                   every queued layer packed by then, and send them as one message
                   (KVSender.send_packed_layers: fewer, larger messages; the decode node still
                   lands and reports each layer); any number in flight. On the receiver's
                   own GPU (the ticket's kv_device) the drain starts with the layer before the
                   last and hands over every layer but the last at once (written in place as computed: one manifest message), then
                   the last: during the forward the decode process puts no work on the GPU,
                   nor our event loop per-layer GIL time
                   attach: the layers queued so far go out as above (the drain starts)
                   finish(): every layer in the sender's hands ─► send_first_token (behind
                     them: the transport keeps the order) ─► await the receiver's result
                   close(): drop the request; a sender still live is failed (the peer is told)

Packing is queued from the engine thread, so it snapshots the blocks (see layer_packer.py),
and the transport sends that one buffer as it is.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence

import torch

from cache_transfer import KVLayout
from cache_transfer.layout import kv_device_id
from engine.outputs import PrefillLayerChunk
from pdserve.v1 import generation_pb2
from prefill_node.layer_drain import LayerDrain
from prefill_node.layer_packer import LayerPacker
from prefill_node.outgoing import KVSink, Outgoing
from prefill_node.transfer_trace import TransferTrace

logger = logging.getLogger(__name__)

MAX_TRACES = 1024  # transfers whose TransferTrace is kept (the most recent)
# One GPU: every layer but the last goes in one message once the one before the last is written
# (2K on one H200: a message per layer slowed the forward, 1P1D TTFT 1.23-1.63x colocated; all
# after the last layer, D heard of it 1.6-1.8 ms after it was written; this way 0.5-1.0 ms (8K),
# 2K TTFT 1.02-1.10x: benchmarks/results/2026-12-03-h200-kv-handoff.txt runs 23-27)
SAME_GPU_HELD_UNTIL_LAST = 2  # ... the 2nd last layer: the layers before it wait for it
MAX_CLOSED = 4096  # (auto_open) requests remembered as closed


class LayerStreamer:
    def __init__(
        self,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        layout: KVLayout,
        loop: asyncio.AbstractEventLoop,
        max_traces: int = MAX_TRACES,
        kv_device: str | None = None,
        auto_open: bool = False,
    ) -> None:
        """`kv_caches`: the engine's per-layer `(k_cache, v_cache)`, of `layout`; `loop`: where
        sends run; `kv_device`: this cache's device as tickets name it (default:
        `kv_device_id`); `auto_open`: open every request the engine computes, until `close`d
        (a TP node's other ranks: rank 0 names the requests only once it has the ticket)."""
        self._auto_open = auto_open
        self._closed: OrderedDict[str, None] = OrderedDict()  # (auto_open) closed recently
        self.traces: OrderedDict[str, TransferTrace] = OrderedDict()  # by transfer_id
        self._kv_caches = kv_caches
        self._layout = layout
        self._loop = loop
        self._max_traces = max_traces
        self._outgoing: dict[str, Outgoing] = {}  # by request_id
        device = kv_caches[0][0].device
        self._kv_device = kv_device_id(device) if kv_device is None else kv_device
        self._packer = LayerPacker(kv_caches, layout)  # the engine thread's
        self._drain = LayerDrain(loop, device)  # the event loop's: packed layers -> sender

    def open(self, request_id: str, num_tokens: int) -> TransferTrace:
        """Pack `request_id`'s KV (`num_tokens` prompt tokens) as the engine computes it; it
        goes out through the sender `attach` gives (layers computed before wait for it)."""
        if request_id in self._outgoing:
            raise ValueError(f"request {request_id!r} is already sending its KV")
        return self.open_if_needed(request_id, num_tokens).trace

    def open_if_needed(self, request_id: str, num_tokens: int) -> Outgoing:
        """The request's queue, opened unless it is (either thread: a tensor-parallel rank
        opens a request when its engine computes it, or when its ticket comes first)."""
        num_layers = len(self._kv_caches)
        trace = TransferTrace("", request_id, [None] * num_layers, [None] * num_layers)
        outgoing = Outgoing(trace, self._layout.num_blocks_for(num_tokens))
        return self._outgoing.setdefault(request_id, outgoing)  # (atomic)

    @property
    def num_open(self) -> int:
        """Requests whose KV is kept (packed or being sent)."""
        return len(self._outgoing)

    def attach(self, request_id: str, sender: KVSink) -> None:
        """(event loop) Send `request_id`'s KV through `sender` (its ticket is in): the layers
        packed so far go out now, the rest as they are computed."""
        outgoing = self._outgoing.get(request_id)
        if outgoing is None:
            raise ValueError(f"request {request_id!r} is not open")
        if outgoing.sender is not None:
            raise ValueError(f"request {request_id!r} already has a sender")
        num_cached = outgoing.num_blocks - sender.num_blocks  # the receiver holds (KVSuffix)
        if num_cached != sender.suffix.num_cached_blocks:
            raise ValueError(
                f"request {request_id!r}: a sender of {sender.num_blocks} blocks for a prompt "
                f"of {outgoing.num_blocks}"
            )
        outgoing.num_cached_blocks = num_cached  # before `sender`: the packer reads it after
        trace = outgoing.trace
        trace.transfer_id = sender.transfer_id
        self.traces[sender.transfer_id] = trace
        while len(self.traces) > self._max_traces:
            self.traces.popitem(last=False)
        # One GPU: a receive per layer on the decode side would interrupt this forward (~0.3
        # ms each, time-sliced); written in place, a message per layer still took our loop's
        # GIL time from the launches. So layers are held back (writes in place still run as
        # layers compute): see SAME_GPU_HELD_UNTIL_LAST
        outgoing.same_gpu = bool(self._kv_device) and sender.dst_kv_device == self._kv_device
        if outgoing.same_gpu:
            outgoing.hold_until = max(0, len(self._kv_caches) - SAME_GPU_HELD_UNTIL_LAST)
        outgoing.sender = sender
        if outgoing.started:
            sender.start()
        queued = outgoing.queued
        if queued and not outgoing.draining and queued[-1].layer_idx >= outgoing.hold_until:
            self._drain.start(outgoing, sender)

    def on_layer_done(self, layer_idx: int, chunks: Sequence[PrefillLayerChunk]) -> None:
        """The engine's hook (engine thread): start layer `layer_idx`'s send for every request
        whose prompt ends in this step."""
        packed: torch.cuda.Event | None = None  # CUDA: this layer's last streamed pack, if any
        for chunk in chunks:
            outgoing = self._outgoing.get(chunk.request_id)
            if outgoing is None and self._auto_open and chunk.request_id not in self._closed:
                outgoing = self.open_if_needed(chunk.request_id, chunk.prompt_len)
            if outgoing is None:
                continue
            if not outgoing.computing:  # its prefill started (this step): so does the transfer
                outgoing.computing = True
                outgoing.trace.mark("computing")
                self._loop.call_soon_threadsafe(self._start, outgoing)
            if layer_idx == len(self._kv_caches) - 1:
                outgoing.num_computed_tokens = chunk.end_pos
            if not chunk.ends_prompt:
                continue
            sender = outgoing.sender  # (set by the event loop: read once)
            if outgoing.broken or (sender is not None and sender.finished):
                continue
            try:
                layer = self._packer.pack(outgoing, chunk.block_ids, layer_idx)
            except Exception:  # never let one request's send kill the engine thread
                logger.exception("request %s: could not pack layer %d", chunk.request_id,
                                 layer_idx, extra={"request_id": chunk.request_id})  # fmt: skip
                outgoing.broken = True
                continue
            if layer.ready is None:
                outgoing.trace.layer_computed_s[layer_idx] = time.monotonic()
            self._loop.call_soon_threadsafe(self._drain.queue, outgoing, layer)
            if not outgoing.same_gpu:  # bound the run-ahead only where sends are heavy
                packed = layer.ready
        self._packer.layer_done(layer_idx, packed)

    async def finish(
        self,
        request_id: str,
        token_id: int,
        logprob: generation_pb2.TokenLogprob | None,
        finish_reason: str,
        draft_token_ids: Sequence[int] = (),
    ) -> KVSink:
        """Once every layer is in the sender's hands, send the first token (behind them, with
        any drafts) and wait for the receiver's result (within the sender's deadline); the
        finished sender."""
        outgoing = self._outgoing[request_id]
        sender = outgoing.sender
        if sender is None:
            raise ValueError(f"request {request_id!r} has no sender (attach) to finish")
        sender.start()  # (the engine's hook started it unless no layer ran, e.g. no hook)
        while outgoing.handing and sender.remaining_s > 0:  # a drain task may start more sends
            await asyncio.wait(set(outgoing.handing), timeout=sender.remaining_s)
        outgoing.trace.mark("layers_handed")  # the first token goes right behind them
        try:
            await sender.send_first_token(token_id, logprob, finish_reason, draft_token_ids)
        except ValueError as error:  # some layer never went out
            sender.abort(str(error))
        await sender.wait()
        outgoing.trace.mark("result")
        return sender

    def progress(self) -> list[tuple[KVSink, int]]:
        """(event loop) Each live sender, with how many of its prompt's tokens are computed."""
        return [
            (outgoing.sender, outgoing.num_computed_tokens)
            for outgoing in self._outgoing.values()
            if outgoing.sender is not None and not outgoing.sender.finished
        ]

    def computing(self, request_id: str) -> bool:
        """The engine computed a chunk of the request's prompt (its prefill started)."""
        outgoing = self._outgoing.get(request_id)
        return outgoing is not None and outgoing.computing

    def abort(self, request_id: str, reason: str) -> bool:
        """Cancel the request's transfer (the receiver is told); False when none is open."""
        outgoing = self._outgoing.get(request_id)
        if outgoing is None or outgoing.sender is None:
            return False
        outgoing.sender.cancel(reason)
        return True

    def close(self, request_id: str, reason: str) -> None:
        """Forget the request; cancel its sender if it is still live. Sends in progress end on
        their own (a failed sender sends nothing more)."""
        outgoing = self._outgoing.pop(request_id, None)
        if self._auto_open:  # not opened again by a step still under way
            self._closed[request_id] = None
            if len(self._closed) > MAX_CLOSED:
                self._closed.popitem(last=False)  # (one in, at most one out)
        if outgoing is not None and outgoing.sender is not None and not outgoing.sender.finished:
            outgoing.sender.cancel(reason)

    def _start(self, outgoing: Outgoing) -> None:
        """(event loop) The request's prefill started: so does its transfer, once attached."""
        outgoing.started = True
        if outgoing.sender is not None:
            outgoing.sender.start()
