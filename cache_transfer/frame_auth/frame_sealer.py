"""`FrameSealer`: the part of a session that authenticates its messages (a `TransferSession`
owns one; without a key, in an open cluster or before the challenge, headers pass as they are).

    bind(key, encrypted)               the transfer's FrameKey (the sender: on the challenge;
                                       the receiver: on the handshake that proved it), and
                                       with `encrypted` its FrameCipher (--kv-encrypt)
    await parts(messages)              outgoing: what each tag covers of its payload (CUDA
                                       payloads: their digests, awaited; the manifest says so)
    payload(staged, manifest, source)  outgoing: a layer's payload (encrypted, with a cipher)
    seal(seq, body, part)              outgoing: the header on the wire
    forged(msg, header, part)          incoming: why its mac does not verify, or None
    landed_part(msg, payload)          incoming: what its tag covers of a landed payload
    opened(msg, header, payload, ...)  incoming: a landed payload checked (and decrypted)
    await device_part(payload)         the same for a GPU payload's digest, off the loop
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from cache_transfer.frame_auth.frame_cipher import FrameCipher
from cache_transfer.frame_auth.frame_key import Chunk, FrameKey, seal, unseal
from cache_transfer.frame_auth.payload_digests import device_parts, digest_part, host_part
from cache_transfer.packing.packed_layer import LayerSource
from cache_transfer.packing.staging_pool import StagedSend, StagingPool
from cache_transfer.protocol import MessageBody, TransferMessage, kind_of
from pdserve.v1 import transfer_pb2

Outgoing = tuple[torch.Tensor | None, dict[str, MessageBody]]


class FrameSealer:
    def __init__(self, outgoing: int) -> None:
        """`outgoing`: the direction of what this side sends (frame_key.TO_RECEIVER: a sender)."""
        self.key: FrameKey | None = None
        self.cipher: FrameCipher | None = None  # an encrypted transfer's (--kv-encrypt)
        self.required = False  # a cluster secret: no message is authentic before the key
        self._out = outgoing
        self._in = 1 - outgoing

    def bind(self, key: FrameKey | None, encrypted: bool = False) -> None:
        self.key = key
        self.cipher = FrameCipher(key) if encrypted and key is not None else None

    def payload(
        self, staged: StagedSend, manifest: transfer_pb2.LayerManifest, source: LayerSource
    ) -> torch.Tensor:
        """A layer's outgoing payload in `staged`: its source (filled into staging where it
        must be), and for an encrypted transfer that encrypted into staging of its own."""
        payload = staged.payload(source, manifest.num_bytes)
        if self.cipher is None:
            return payload
        return staged.payload(self.encrypting(manifest, payload), manifest.num_bytes)

    def encrypting(
        self, manifest: transfer_pb2.LayerManifest, plain: torch.Tensor
    ) -> Callable[[torch.Tensor], None]:
        """What fills a staging buffer with `plain` encrypted (the sender's payload)."""
        cipher = self.cipher
        assert cipher is not None
        if plain.device.type != "cpu":
            raise ValueError(
                f"encrypted KV frames are host payloads; this one is on {plain.device}"
            )
        return lambda out: cipher.payload(self._out, manifest, plain, out)

    def decrypt(
        self, manifest: transfer_pb2.LayerManifest, sealed: torch.Tensor, out: torch.Tensor
    ) -> None:
        assert self.cipher is not None
        self.cipher.payload(self._in, manifest, sealed, out)

    def seal_token(self, token: transfer_pb2.FirstToken) -> transfer_pb2.FirstToken:
        return token if self.cipher is None else self.cipher.seal_token(self._out, token)

    def open_token(self, token: transfer_pb2.FirstToken) -> transfer_pb2.FirstToken:
        """The first token as sent (ValueError: sealed, and it does not decrypt; or in clear
        where the transfer is encrypted)."""
        if self.cipher is None:
            return token
        if not token.sealed:
            raise ValueError("a first token in clear in an encrypted transfer")
        return self.cipher.open_token(self._in, token)

    async def parts(self, messages: Sequence[Outgoing]) -> list[list[Chunk]]:
        """Per message, what its tag covers of its payload (nothing without a key)."""
        parts: list[list[Chunk]] = [[] for _ in messages]
        if self.key is None:
            return parts
        on_device = [i for i, (payload, _) in enumerate(messages) if _on_cuda(payload)]
        for i, (payload, kind) in enumerate(messages):
            if payload is not None and i not in on_device:
                parts[i] = host_part(payload)
            elif payload is not None:
                kind["layer_manifest"].payload_digest = True  # type: ignore[union-attr]
        digests = await device_parts(self.key, [messages[i][0] for i in on_device])  # type: ignore[misc]
        for i, digest in zip(on_device, digests, strict=True):
            parts[i] = digest
        return parts

    def seal(self, seq: int, body: bytes, part: list[Chunk]) -> bytes:
        if self.key is None:
            return body
        return seal(body, self.key.tag(self._out, seq, body, part))

    def forged(
        self,
        msg: TransferMessage,
        header: bytes,
        part: Sequence[Chunk] = (),
        key: FrameKey | None = None,
    ) -> str | None:
        """Why an incoming message (its whole `header`; `part`: what covers its payload) is
        not authentic under `key` (default: the bound one), or None (always None without a
        key, unless one is `required`)."""
        key = key or self.key
        if key is None:
            return f"a {kind_of(msg)} message before the challenge" if self.required else None
        body = unseal(header, msg.mac)
        if body is None:
            return f"a {kind_of(msg)} message without its MAC"
        if not key.verify(self._in, msg.seq, body, msg.mac, part):
            return f"a {kind_of(msg)} message (seq {msg.seq}) whose MAC does not verify"
        return None

    def landed_part(self, msg: TransferMessage, payload: torch.Tensor) -> list[Chunk]:
        """What the tag of `msg` covers of its landed `payload`, now: its bytes, or (the
        manifest says payload_digest) its digest computed where it landed."""
        assert self.key is not None
        if not msg.layer_manifest.payload_digest:
            return host_part(payload if payload.device.type == "cpu" else payload.cpu())
        return digest_part(self.key, payload)

    def opened(
        self,
        msg: TransferMessage,
        header: bytes,
        payload: torch.Tensor,
        part: list[Chunk] | None,
        staging: StagingPool,
    ) -> tuple[torch.Tensor, str | None]:
        """A landed payload checked against its MAC (`part`: its device digest; None: what
        it covers, now) and, in an encrypted transfer, decrypted into staging of its own
        (the sealed buffer given back): (what to land, why it is forged or None)."""
        part = self.landed_part(msg, payload) if part is None else part
        forged = self.forged(msg, header, part)
        if forged is None and self.cipher is not None:
            sealed, payload = payload, staging.take(payload.numel(), payload.device)
            self.decrypt(msg.layer_manifest, sealed, payload)
            staging.give_back(sealed)
        return payload, forged

    async def device_part(self, payload: torch.Tensor) -> list[Chunk]:
        """A CUDA payload's digest, computed on its GPU and awaited off the loop."""
        assert self.key is not None
        (part,) = await device_parts(self.key, [payload])
        return part


def _on_cuda(payload: torch.Tensor | None) -> bool:
    return payload is not None and payload.device.type == "cuda"
