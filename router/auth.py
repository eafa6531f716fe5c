"""Client API keys on the router (`--api-key-file`): one key a line; clients send
`authorization: Bearer KEY` (gRPC metadata, or the HTTP header).

```
ApiKeys.from_file(path)     the keys (blank lines and '#' comments skipped)
keys.check(header_value)    whether "Bearer KEY" names one of them (constant time)
check_api_key(header)       the same against the keys the running router installed
                            (`install`); True when the router needs no key
keys.grpc_check             a RequestGuard check (pdserve.grpc_security): UNAUTHENTICATED
```
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

AUTHORIZATION = "authorization"
_installed: ApiKeys | None = None


class ApiKeys:
    def __init__(self, keys: list[str]) -> None:
        if not keys:
            raise ValueError("the API key file lists no key")
        self._digests = [hashlib.sha256(key.encode()).digest() for key in keys]

    @classmethod
    def from_file(cls, path: str | Path) -> ApiKeys:
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"cannot read the API key file {path}: {error}") from None
        keys = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
        if not keys:
            raise ValueError(f"the API key file {path} lists no key (one a line)")
        return cls(keys)

    def check(self, header_value: str | None) -> bool:
        """Whether `header_value` is "Bearer KEY" for a listed KEY (compared in constant time,
        against every key)."""
        if not header_value:
            return False
        scheme, _, key = header_value.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return False
        digest = hashlib.sha256(key.strip().encode()).digest()
        found = False
        for listed in self._digests:
            found |= hmac.compare_digest(digest, listed)
        return found

    def grpc_check(self, method: str, metadata: dict[str, str]) -> str | None:
        if self.check(metadata.get(AUTHORIZATION)):
            return None
        return "send a valid API key as 'authorization: Bearer KEY' metadata"


def install(keys: ApiKeys | None) -> None:
    """The keys `check_api_key` checks (the router does this when it starts)."""
    global _installed
    _installed = keys


def check_api_key(header_value: str | None) -> bool:
    """Whether a client's `Authorization` header value may use this router: True when no
    `--api-key-file` is configured, else whether it is "Bearer KEY" for a listed key."""
    return _installed is None or _installed.check(header_value)
