"""`LayerLanding`: where a `KVReceiver`'s accepted layers land; the receiver owns one.

    take(payload_bytes)          a staging buffer for a layer the checks accepted (counted in
                                 `num_landing` until it lands or is abandoned)
    land(msg, header, payload)   its bytes are in: its MAC verified (at once: no key, or host
                                 bytes; off the loop: its digest computed on the GPU), then it
                                 is unpacked into the session's own blocks ──► session.on_landed
                                 a MAC that fails ──► session.fail (the payload is never read)
    abandon(payload)             the connection broke while it was landing: given back

Only the session's `dst_block_ids` are written (checked once, on the cache's device, no
repeats), and nothing once the session has finished, even bytes accepted earlier.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any, Protocol

import torch

from cache_transfer.frame_auth.frame_key import Chunk
from cache_transfer.frame_auth.frame_sealer import FrameSealer
from cache_transfer.layout import KVCaches
from cache_transfer.packing.block_ids import CheckedIds, check_block_ids
from cache_transfer.packing.packed_layer import unpack_layer
from cache_transfer.packing.staging_pool import StagingPool
from cache_transfer.protocol import TransferMessage
from pdserve.v1 import transfer_pb2


class LandingSession(Protocol):
    """What a `LayerLanding` needs of its receiver (`KVReceiver` is one)."""

    @property
    def finished(self) -> bool: ...
    def fail(self, reason: str) -> None: ...
    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None: ...
    def on_landed(self, manifest: transfer_pb2.LayerManifest, layer_ids: list[int]) -> None: ...


class LayerLanding:
    def __init__(
        self,
        session: LandingSession,
        frames: FrameSealer,
        staging: StagingPool,
        kv_caches: KVCaches,
        dst_block_ids: Sequence[int],
        device: torch.device,
    ) -> None:
        """`frames`: the session's (its MAC key, once bound); `device`: where staging buffers
        live (the transport's buffer device for the caches')."""
        self.num_landing = 0  # payloads take() handed out whose bytes have not landed yet
        self._session, self._frames, self._staging = session, frames, staging
        self._kv_caches, self._device = kv_caches, device
        self._dst_block_ids = list(dst_block_ids)
        self._dst_ids: CheckedIds | None = None  # dst_block_ids on the cache's device, once

    def take(self, payload_bytes: int) -> torch.Tensor:
        """A staging buffer for an accepted layer's payload."""
        self.num_landing += 1
        return self._staging.take(payload_bytes, self._device)

    def abandon(self, payload: torch.Tensor) -> None:
        """A payload take() handed out will never land."""
        self.num_landing -= 1
        self._staging.give_back(payload)

    def land(self, msg: TransferMessage, header: bytes, payload: torch.Tensor) -> None:
        """Unpack a landed payload once its MAC verifies: at once (no key; host bytes), or off
        the loop (its digest computed on the GPU); one that fails fails the session, unread."""
        if self._frames.key is None:
            self._unpack(msg.layer_manifest, payload)
        elif msg.layer_manifest.payload_digest and payload.device.type == "cuda":
            self._session.spawn(self._verify_on_device(msg, header, payload))
        else:
            self._land_checked(msg, header, payload, None)

    async def _verify_on_device(
        self, msg: TransferMessage, header: bytes, payload: torch.Tensor
    ) -> None:
        part = None
        try:
            part = await self._frames.device_part(payload)
        except asyncio.CancelledError:  # (the manager closing): nothing lands
            self.abandon(payload)
            raise
        except Exception as error:  # noqa: BLE001 - a CUDA error, or a hung device
            layer_idx = msg.layer_manifest.layer_idx
            self._session.fail(f"could not check layer {layer_idx}'s MAC: {error!r}")
        self._land_checked(msg, header, payload, part)

    def _land_checked(
        self, msg: TransferMessage, header: bytes, payload: torch.Tensor, part: list[Chunk] | None
    ) -> None:
        if not self._session.finished:
            payload, forged = self._frames.opened(msg, header, payload, part, self._staging)
            if forged is not None:
                self._session.fail(f"refused layer {msg.layer_manifest.layer_idx}: {forged}")
        self._unpack(msg.layer_manifest, payload)  # (a failed session writes nothing)

    def _unpack(self, manifest: transfer_pb2.LayerManifest, payload: torch.Tensor) -> None:
        self.num_landing -= 1
        try:
            if not self._session.finished:  # a failed session never writes
                k_cache, v_cache = self._kv_caches[manifest.layer_idx]
                if self._dst_ids is None:
                    self._dst_ids = check_block_ids(
                        self._dst_block_ids, k_cache.shape[0], k_cache.device, unique=True
                    )
                first = manifest.block_offset
                dst_ids = self._dst_ids[first : first + manifest.num_blocks]
                unpack_layer(payload, k_cache, v_cache, dst_ids)
                self._session.on_landed(manifest, [manifest.layer_idx])
        finally:
            self._staging.give_back(payload)
