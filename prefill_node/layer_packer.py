"""`LayerPacker`: (engine thread) one layer of one request's KV made ready to send, right after
the engine wrote it; `LayerStreamer` calls it from the engine's per-layer hook.

    pack(outgoing, block_ids, layer_idx) -> PackedLayer
        CUDA: record an event on the compute stream; on the pack stream wait for it and pack
              (one kernel, K and V), or, written in place, copy the blocks into the
              receiver's (sender.in_place_writer; only a header is sent); record `packed`.
              The forward never waits.
        CPU:  pack (one index_select) into a new buffer
    layer_done(layer_idx, packed)   (CUDA) after each layer's packs: keep the host at most
              RUN_AHEAD_LAYERS layers ahead of the GPU; after the last layer, later work on
              the compute stream waits for every pack queued (a GPU-side wait)

Packing snapshots the blocks: the bytes sent do not depend on what the engine does to them
afterwards (a request whose first token finishes it frees its blocks in the same step; on CUDA
the compute stream waits for the pack stream after the last layer, so nothing queued later can
overwrite a block before it is packed). The request's block ids are checked and copied to the
device once (first layer), asynchronously.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Sequence

import torch

from cache_transfer import KVLayout, LayerBlocks, pack_layer
from cache_transfer.in_place.writer import ClosedError
from cache_transfer.packing.block_ids import check_block_ids
from pdserve.v1.transfer_pb2 import LayerManifest
from prefill_node.outgoing import Outgoing, PackedLayer

# CUDA: while a step streams KV, the engine thread runs at most this many layers ahead of the
# GPU. Left alone it would queue the whole forward at once and then block (inside a kernel
# launch, on a full launch queue, or in the step's final copy) holding the GIL, so the event
# loop could not send a layer until the forward ended. Waiting on an event releases the GIL;
# two layers of queued work keep the GPU busy. Layers held back (one GPU) do not bound it.
RUN_AHEAD_LAYERS = 2


class LayerPacker:
    def __init__(
        self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], layout: KVLayout
    ) -> None:
        self._kv_caches = kv_caches
        self._layout = layout
        device = kv_caches[0][0].device
        self._pack_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # CUDA: this step's newest pack event per layer streamed so far
        self._layers_queued: deque[torch.cuda.Event] = deque()

    def pack(self, outgoing: Outgoing, block_ids: Sequence[int], layer_idx: int) -> PackedLayer:
        """The request's blocks of one layer packed into a new buffer on the cache's device
        (`block_ids`: its block table; the first `outgoing.num_blocks` hold the prompt, of
        which those after the receiver's `num_cached_blocks` are packed: all until the ticket
        says otherwise); on CUDA queued on the pack stream behind the compute stream's KV
        write, with the event that marks it packed."""
        k_cache, v_cache = self._kv_caches[layer_idx]
        sender = outgoing.sender  # (read before the count: attach sets the count first)
        num_cached = outgoing.num_cached_blocks
        if outgoing.src_ids is None or outgoing.src_ids_from != num_cached:
            prompt_blocks = block_ids[num_cached : outgoing.num_blocks]
            outgoing.src_ids = check_block_ids(prompt_blocks, k_cache.shape[0], k_cache.device)
            outgoing.src_ids_from = num_cached
        num_blocks = outgoing.num_blocks - num_cached
        num_bytes = self._layout.layer_bytes(num_blocks)
        if self._pack_stream is None:
            packed = torch.empty(num_bytes, dtype=torch.uint8, device=k_cache.device)
            packed = pack_layer(k_cache, v_cache, outgoing.src_ids, packed)
            return PackedLayer(layer_idx, packed, None, num_cached_blocks=num_cached)
        computed = torch.cuda.Event()
        computed.record(torch.cuda.current_stream(k_cache.device))  # after the layer's KV write
        writer = sender.in_place_writer if sender is not None else None
        with torch.cuda.stream(self._pack_stream):
            self._pack_stream.wait_event(computed)
            if writer is not None:  # block to block into the receiver's blocks: nothing packed
                manifest = LayerManifest(
                    layer_idx=layer_idx, num_blocks=num_blocks, num_bytes=num_bytes
                )
                blocks = LayerBlocks(k_cache, v_cache, outgoing.src_ids)
                with contextlib.suppress(ClosedError):  # failed: packed below, sent nowhere
                    written = writer.write([manifest], [blocks])
                    return PackedLayer(layer_idx, None, written, True, num_cached)
            packed = torch.empty(num_bytes, dtype=torch.uint8, device=k_cache.device)
            pack_layer(k_cache, v_cache, outgoing.src_ids, packed)
            ready = torch.cuda.Event()
            ready.record(self._pack_stream)
        return PackedLayer(layer_idx, packed, ready, num_cached_blocks=num_cached)

    def layer_done(self, layer_idx: int, packed: torch.cuda.Event | None) -> None:
        """Every request's pack of layer `layer_idx` is queued; `packed`: the event of the
        last one whose sends bound the run-ahead (None: nothing of this layer does)."""
        if self._pack_stream is None:
            return
        self._bound_run_ahead(layer_idx, packed)
        if layer_idx == len(self._kv_caches) - 1:
            # later work on the compute stream (the next step may reuse freed blocks) runs
            # after every pack queued so far: a GPU-side wait, the host goes on
            torch.cuda.current_stream(self._pack_stream.device).wait_stream(self._pack_stream)

    def _bound_run_ahead(self, layer_idx: int, packed: torch.cuda.Event | None) -> None:
        """Keep the host at most RUN_AHEAD_LAYERS layers ahead of the GPU while this step
        streams KV (see RUN_AHEAD_LAYERS), waiting on the pack events (a layer is packed after
        it is computed); the GPU itself never waits."""
        if layer_idx == 0:
            self._layers_queued.clear()  # a new step
        if packed is None:  # nothing of this layer is sent
            return
        self._layers_queued.append(packed)
        while len(self._layers_queued) > RUN_AHEAD_LAYERS:
            self._layers_queued.popleft().synchronize()  # releases the GIL while it waits
