"""Tenants of the prefix cache: the cache salt each request carries to the nodes.

```
CacheSalts(auth, deployment_salt, per_tenant, keyed_tenants)
  salt(authorization, client_salt) -> str
    tenant      the client's API key (its "Bearer KEY"), with --api-key-file and per_tenant;
                else none: every client shares the deployment's namespace
    ""          neither a tenant nor a client salt: the deployment's namespace
    else        hex HMAC-SHA256(key, tenant, client salt): what the nodes' block hashes are
                rooted in (pdserve.block_hash.root_hash), and the router's prefix-aware policy
```

Two tenants' requests never find each other's blocks, so `usage.cached_tokens` (and the time to
the first token, which follows the prefill work) tells a tenant only about its own prompts: no
cross-tenant prefix oracle. A client's `cache_salt` (vLLM's) narrows its namespace within its
tenant's; it never reaches another tenant's. `--share-prefix-cache-across-tenants` makes the API
key not count (clients' cache_salt still does), for deployments whose tenants trust each other.

The digest is keyed (by a key derived from the cluster secret, else from the deployment's
--prefix-cache-salt): the API key itself never leaves the router, and whoever reads a node's
traffic or logs cannot test guesses of a key against its salt without that key.
"""

from __future__ import annotations

import hashlib
import hmac

from pdserve.security import ClusterAuth

MAX_CLIENT_SALT_CHARS = 1024
_PURPOSE = "prefix-cache-tenant-salt"
_UNKEYED = b"pdserve.prefix-cache.tenant-salt.v1\x00"


class CacheSalts:
    def __init__(
        self,
        auth: ClusterAuth | None,
        deployment_salt: str | None,
        per_tenant: bool,
        keyed_tenants: bool,
    ) -> None:
        """`keyed_tenants`: clients present API keys (--api-key-file): each key is a tenant."""
        if auth is not None:
            self._key = auth.sign(_PURPOSE)
        else:
            self._key = hashlib.sha256(_UNKEYED + (deployment_salt or "").encode()).digest()
        self.per_tenant = per_tenant and keyed_tenants

    def salt(self, authorization: str | None, client_salt: str) -> str:
        """The request's namespace, as the nodes get it ("" for the deployment's own)."""
        tenant = _bearer_key(authorization) if self.per_tenant else ""
        if not tenant and not client_salt:
            return ""
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        for part in (tenant, client_salt):
            data = part.encode()
            mac.update(len(data).to_bytes(8, "big"))
            mac.update(data)
        return mac.hexdigest()


def _bearer_key(authorization: str | None) -> str:
    """KEY of "Bearer KEY" ("" when the header says nothing else): the request got past the
    API key check, so it is a listed key."""
    if not authorization:
        return ""
    scheme, _, key = authorization.strip().partition(" ")
    return key.strip() if scheme.lower() == "bearer" else ""
