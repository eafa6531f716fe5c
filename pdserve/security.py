"""`ClusterAuth`: the cluster secret, and every proof made with it (torch-free, grpc-free).

```
load_cluster_auth(SecurityConfig)   --cluster-secret-file, else PDSERVE_CLUSTER_SECRET_FILE;
                                    None: the cluster is open (launchers log it)
auth.sign(purpose, *parts)          HMAC-SHA256 under a per-purpose key derived from the secret
auth.verify(mac, purpose, *parts)   constant-time (hmac.compare_digest)
auth.call_token(method, audience)   gRPC call proof "MS.NONCE.MAC" over (method, audience,
                                    MS, NONCE), MS: unix time in milliseconds; `audience`: the
                                    node it is for (the HOST:PORT the caller dials: the address
                                    of its registry record, or the router's static list)
auth.check_call(method, token,      None, or why the call is refused: bad MAC (another secret,
                names)              or made for a node not named in `names`), outside the time
                                    window, or a replayed nonce (each node remembers its own)
```

The secret never leaves the process: peers see only MACs, each bound to what it proves (a
method name, a transfer id and addresses, a registry record), so a forged registry record that
draws calls to an attacker's address learns nothing it can reuse elsewhere. Parts are
length-prefixed before they are MACed, so no two part lists sign the same bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Collection
from pathlib import Path

from pdserve import envs
from pdserve.config import SecurityConfig

MIN_SECRET_BYTES = 16
AUTH_METADATA_KEY = "x-pdserve-auth"  # gRPC metadata key of a call proof
_MAX_NONCES = 1 << 16  # remembered nonces (replay refusal within the time window)

Part = str | bytes | int | float


class ClusterAuth:
    """Proofs made with one cluster secret."""

    def __init__(self, secret: bytes, window_s: float = 60.0) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(
                f"the cluster secret has {len(secret)} bytes; use at least {MIN_SECRET_BYTES} "
                "(e.g. `openssl rand -hex 32 > secret`)"
            )
        self._secret = secret
        self.window_s = window_s
        self._keys: dict[str, bytes] = {}
        self._nonces: OrderedDict[str, float] = OrderedDict()  # nonce -> when it expires

    def _key(self, purpose: str) -> bytes:
        key = self._keys.get(purpose)
        if key is None:
            key = self._keys[purpose] = hmac.digest(self._secret, purpose.encode(), "sha256")
        return key

    def sign(self, purpose: str, *parts: Part) -> bytes:
        mac = hmac.new(self._key(purpose), digestmod=hashlib.sha256)
        for part in parts:
            data = part if isinstance(part, bytes) else str(part).encode()
            mac.update(len(data).to_bytes(8, "big"))
            mac.update(data)
        return mac.digest()

    def verify(self, mac: bytes, purpose: str, *parts: Part) -> bool:
        return hmac.compare_digest(mac, self.sign(purpose, *parts))

    def fresh(self, unix_s: float, now_s: float | None = None) -> bool:
        """Whether a timestamp is within the window of now (either side: clock skew)."""
        now_s = time.time() if now_s is None else now_s
        return abs(now_s - unix_s) <= self.window_s

    def call_token(self, method: str, audience: str) -> str:
        stamp, nonce = str(int(time.time() * 1000)), secrets.token_hex(12)
        mac = self.sign("grpc-call", method, audience, stamp, nonce)
        return f"{stamp}.{nonce}.{mac.hex()}"

    def check_call(self, method: str, token: str | None, names: Collection[str]) -> str | None:
        """None when `token` proves the secret for `method` on a node named one of `names`;
        else why not (never the secret)."""
        if not token:
            return "the call carries no cluster proof (x-pdserve-auth metadata)"
        try:
            stamp, nonce, mac_hex = token.split(".", 2)
            stamp_s, mac = int(stamp[:20]) / 1000, bytes.fromhex(mac_hex[:128])
        except ValueError:
            return "the cluster proof is malformed"
        if not any(self.verify(mac, "grpc-call", method, name, stamp, nonce) for name in names):
            return (
                f"the cluster proof does not verify for this node ({', '.join(sorted(names))}): "
                "made for another node, or with a different cluster secret"
            )
        if not self.fresh(stamp_s):
            return f"the cluster proof is older than {self.window_s} s (clock skew?)"
        return self._remember(nonce)

    def _remember(self, nonce: str) -> str | None:
        now_s = time.monotonic()
        while self._nonces and (
            next(iter(self._nonces.values())) < now_s or len(self._nonces) >= _MAX_NONCES
        ):
            self._nonces.popitem(last=False)
        if nonce in self._nonces:
            return "the cluster proof was replayed"
        self._nonces[nonce] = now_s + 2 * self.window_s
        return None


def read_secret(path: str | Path) -> bytes:
    """The secret in `path`, surrounding whitespace stripped; ValueError says what is wrong."""
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as error:
        raise ValueError(f"cannot read the cluster secret file {path}: {error}") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"the cluster secret file {path} holds {len(secret)} bytes; use at least "
            f"{MIN_SECRET_BYTES} (e.g. `openssl rand -hex 32 > {path}`)"
        )
    return secret


def secret_file(config: SecurityConfig) -> str | None:
    return config.cluster_secret_file or envs.cluster_secret_file()


def load_cluster_auth(config: SecurityConfig) -> ClusterAuth | None:
    """The cluster's `ClusterAuth`, or None when no secret is configured (an open cluster)."""
    path = secret_file(config)
    if path is None:
        return None
    return ClusterAuth(read_secret(path), window_s=config.auth_window_s)


OPEN_CLUSTER = (
    "open cluster (no --cluster-secret-file): any process that reaches a node may call it, "
    "reserve its KV blocks and send it KV"
)


def open_cluster_warning(role: str) -> str:
    """The router's start-up warning of an open cluster (nodes add theirs to one line)."""
    return f"{role}: {OPEN_CLUSTER}; README.md, 'Security', says how to close it"
