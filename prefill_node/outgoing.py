"""What `LayerStreamer` keeps per request: `Outgoing` (one request's queue of layers and the
tasks that send them) and `PackedLayer` (one layer, packed or written, and when)."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

import torch

from cache_transfer import KVSender
from cache_transfer.packing.block_ids import CheckedIds
from cache_transfer.tp import FanOutSender
from prefill_node.transfer_trace import TransferTrace

# What a request's layers go through: one session (a TP 1 hand-off), or a tensor-parallel
# rank's routes as one (cache_transfer/tp/fan_out.py)
KVSink = KVSender | FanOutSender


@dataclass
class PackedLayer:
    """One layer of one request, packed (or queued to be) for sending."""

    layer_idx: int
    packed: torch.Tensor | None  # flat uint8 `[2, num_blocks, block_size, kv_heads, head_dim]`
    ready: torch.cuda.Event | None  # CUDA: recorded once packed; None: packed already
    written: bool = False  # CUDA, in place: copied (`packed` None), `ready` marks it written
    num_cached_blocks: int = 0  # the prompt's leading blocks left out (`Outgoing`'s, when packed)

    @property
    def is_packed(self) -> bool:
        return self.ready is None or self.ready.query()


@dataclass
class Outgoing:
    """One request's sends. `broken`, `computing`, `num_computed_tokens` and `src_ids*` are
    the engine thread's, the rest the event loop's (the engine thread reads `sender` and
    `num_cached_blocks`)."""

    trace: TransferTrace
    num_blocks: int  # the prompt's blocks, each layer's packed size
    sender: KVSink | None = None  # None until attach (the ticket follows the call)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)  # drain and sends, kept alive
    # until every queued layer is in the sender's hands: the drain task's and each send's
    handing: set[asyncio.Future[None]] = field(default_factory=set)
    queued: deque[PackedLayer] = field(default_factory=deque)  # not yet handed to the sender
    draining: bool = False  # a drain task runs
    broken: bool = False  # packing a layer failed: later layers are not sent
    computing: bool = False  # (engine thread) the engine computed a chunk of it
    num_computed_tokens: int = 0  # (engine thread) of the prompt, once a step's last layer ran
    started: bool = False  # (event loop) ... and the loop heard: the sender starts (on attach)
    same_gpu: bool = False  # the receiver shares our GPU (known at attach)
    hold_until: int = 0  # (same_gpu) earlier layers wait, queued, until this one is queued
    # the receiver holds the prompt's first blocks (KVSuffix): set at attach, before `sender`
    num_cached_blocks: int = 0
    # the request's block ids on the cache's device, from block src_ids_from on
    src_ids: CheckedIds | None = None
    src_ids_from: int = 0
