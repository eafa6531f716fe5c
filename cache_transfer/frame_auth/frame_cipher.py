"""`FrameCipher`: optional (`--kv-encrypt`, off by default; tcp, host memory): a transfer's KV
payloads and its first token travel encrypted, for networks that cannot be trusted.

    cipher key  = HMAC-SHA256(the transfer's FrameKey, "kv-encrypt")
    a payload   AES-256-CTR, its counter block = direction | layer index | token_end | 0...:
                unique per message of a key (a layer's token_end grows strictly), no expansion
    first token FirstToken.sealed = AES-256-CTR(the serialized FirstToken), its own counter

Encrypt-then-MAC: the message's tag (frame_key.py) covers the ciphertext, so a receiver checks
it before it decrypts anything. What stays in clear: the envelope (transfer id, seq), layer
manifests (layer, block range, bytes), acks and results: an observer still learns a prompt's
length and a transfer's timing, not its KV or its first token.
"""

from __future__ import annotations

import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from cache_transfer.frame_auth.frame_key import FrameKey
from pdserve.v1 import transfer_pb2

_TAIL = 16  # bytes `update` returns at the end (update_into wants block_size - 1 spare bytes)
_FIRST_TOKEN = 0xFFFFFFFF  # the first token's counter block: no layer has this index


class FrameCipher:
    def __init__(self, frame_key: FrameKey) -> None:
        self._key = frame_key.derive(b"kv-encrypt")

    def _stream(self, direction: int, first: int, second: int) -> object:
        block = bytes([direction]) + first.to_bytes(4, "big") + second.to_bytes(4, "big")
        return Cipher(algorithms.AES(self._key), modes.CTR(block + bytes(7))).encryptor()

    def payload(
        self, direction: int, manifest: transfer_pb2.LayerManifest, src: torch.Tensor,
        out: torch.Tensor,
    ) -> None:  # fmt: skip
        """`out` = `src`'s bytes encrypted (or decrypted: CTR is its own inverse); both flat
        uint8 in host memory, the same size."""
        stream = self._stream(direction, manifest.layer_idx, manifest.token_end)
        data, dst = src.numpy().data, out.numpy().data
        head = max(0, len(data) - _TAIL)
        if head:  # straight into `out`: it is len - 1 >= head + 15 bytes long
            stream.update_into(data[:head], dst[: len(data) - 1])  # type: ignore[attr-defined]
        dst[head:] = stream.update(data[head:])  # type: ignore[attr-defined]

    def seal_token(self, direction: int, token: transfer_pb2.FirstToken) -> transfer_pb2.FirstToken:
        stream = self._stream(direction, _FIRST_TOKEN, _FIRST_TOKEN)
        return transfer_pb2.FirstToken(sealed=stream.update(token.SerializeToString()))  # type: ignore[attr-defined]

    def open_token(self, direction: int, token: transfer_pb2.FirstToken) -> transfer_pb2.FirstToken:
        """The first token `seal_token` sealed; ValueError when it does not parse."""
        stream = self._stream(direction, _FIRST_TOKEN, _FIRST_TOKEN)
        opened = transfer_pb2.FirstToken()
        try:
            opened.ParseFromString(stream.update(token.sealed))  # type: ignore[attr-defined]
        except Exception as error:  # noqa: BLE001 - protobuf's DecodeError
            raise ValueError(f"the sealed first token does not decrypt: {error}") from None
        return opened
