"""`FrameKey`: the MAC key of one hand-off's messages, and the tag of one message.

```
key     = HMAC(secret-derived "kv-frame" key; transfer id, challenge nonce, connection)
k_frame = HMAC-SHA256(key; direction, seq)                    a one-time key per message
tag     = Poly1305(k_frame; len(body) | body | payload part)  16 bytes, in TransferMessage.mac
```

`body` is the serialized envelope without its `mac`; the payload part is the payload's bytes
(host memory) or its device digest (payload_digests.py). Every (direction, seq) of a key is
used for one message only, as Poly1305 requires: seq counts each direction's messages and a
takeover's new sender gets a new key (a new nonce and connection). The mac is serialized last
(field 15, 16 bytes: `seal`), so the receiver MACs exactly the bytes before it (`unseal`).
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.poly1305 import Poly1305

from kernels.kv_digest import CHUNK_WORDS, LANES, PRIME
from pdserve.security import ClusterAuth

TO_RECEIVER, TO_SENDER = 0, 1  # a message's direction (P -> D, D -> P)
TAG_BYTES = 16
_MAC_FIELD = bytes([15 << 3 | 2, TAG_BYTES])  # TransferMessage.mac: field 15, 16 bytes

Chunk = bytes | memoryview


class FrameKey:
    def __init__(self, auth: ClusterAuth, transfer_id: str, nonce: bytes, connection: str) -> None:
        """The key of the messages of `transfer_id` on `connection` (the sender's transport
        peer id), after the challenge that gave `nonce`."""
        self._key = auth.sign("kv-frame", transfer_id, nonce, connection)
        self._digest_keys: dict[torch.device, torch.Tensor] = {}

    def tag(self, direction: int, seq: int, body: bytes, payload: Iterable[Chunk] = ()) -> bytes:
        """The 16-byte tag of one message: its envelope bytes and what covers its payload."""
        one_time = hmac.digest(self._key, bytes([direction]) + seq.to_bytes(8, "big"), "sha256")
        mac = Poly1305(one_time)
        mac.update(len(body).to_bytes(8, "big"))
        mac.update(body)
        for chunk in payload:
            mac.update(chunk)
        return mac.finalize()

    def verify(
        self, direction: int, seq: int, body: bytes, tag: bytes, payload: Iterable[Chunk] = ()
    ) -> bool:
        return hmac.compare_digest(tag, self.tag(direction, seq, body, payload))

    def derive(self, label: bytes) -> bytes:
        """A 32-byte key for another use of this transfer's key (HMAC-SHA256 with `label`)."""
        return hmac.digest(self._key, label, "sha256")

    def digest_key(self, device: torch.device) -> torch.Tensor:
        """The device digest's key for this transfer (`kernels.kv_digest`: LANES x CHUNK_WORDS
        int64 in [0, PRIME)): an AES-256-CTR keystream under a key derived from this one, 31
        bits a word (2^31 - 1 becomes 0: each value has probability <= 2 / 2^31)."""
        key = self._digest_keys.get(device)
        if key is None:
            seed = self.derive(b"kv-digest-key")
            stream = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor()
            raw = stream.update(bytes(4 * LANES * CHUNK_WORDS))
            words = torch.frombuffer(bytearray(raw), dtype=torch.int32).to(torch.int64)
            key = ((words & 0x7FFFFFFF) % PRIME).view(LANES, CHUNK_WORDS).to(device)
            self._digest_keys[device] = key
        return key


def seal(body: bytes, tag: bytes) -> bytes:
    """The header on the wire: the envelope's bytes, then its mac (always last)."""
    return body + _MAC_FIELD + tag


def unseal(header: bytes, mac: bytes) -> bytes | None:
    """The bytes a message's `mac` (as parsed) covers: its header up to the mac, serialized
    last; None when the header does not end with it (no mac, or not where `seal` puts it)."""
    if len(mac) != TAG_BYTES or not header.endswith(_MAC_FIELD + mac):
        return None
    return header[: -len(_MAC_FIELD) - TAG_BYTES]
