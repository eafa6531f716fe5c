"""The prefix cache's block hash chain, written once for the engine and the router.

```
root_hash(salt, request_salt)    the parent of a sequence's first block: sha256 of a domain tag
                                 and the deployment's salt (--prefix-cache-salt, else
                                 PDSERVE_PREFIX_CACHE_SALT, else none) and the request's own
                                 (its tenant's and client's `cache_salt`, as the router sends it
                                 to the nodes; "" for none)
hash_block_tokens(parent, ids)   sha256(parent digest + the block's ids as int32 bytes)
block_hashes(ids, size, root)    one digest per full block of `ids`; digest i covers blocks 0..i
extend_block_hashes(hashes, ids, size, root)   the same, appending only the blocks not yet hashed
                                 (a request keeps its list: nothing is hashed twice)
```

sha256 (not Python's `hash()`): a digest is the same in every process, whatever PYTHONHASHSEED,
and nobody can craft two token sequences that share one (with `hash()` a crafted prompt could
collide with another's prefix and be served its KV; vLLM moved to sha256 for the same reason,
GHSA-rm76-4mrf-v9r8). A salt separates the caches of deployments that must not share prefixes,
a request salt those of tenants (the router derives it from the API key: two tenants' requests
never find each other's blocks, so a hit count or a TTFT tells nothing about another tenant's
prompts); router and nodes given the same salts compute identical digests. About a microsecond a block of
16 tokens on one core (2 ms for a 32K-token prompt; each request hashes each block once).
"""

from __future__ import annotations

import functools
import hashlib
from array import array
from collections.abc import Sequence

from pdserve import envs

BlockHash = bytes  # a 32-byte sha256 digest
_DOMAIN = b"pdserve.prefix-cache.v1\x00"
_SALTED_DOMAIN = b"pdserve.prefix-cache.request-salt.v1\x00"
MAX_REQUEST_SALT_CHARS = 256  # what a node takes in a request's cache_salt (the router's: 64)
_TOKEN_TYPECODE = "i"  # int32: every vocabulary fits; 4 bytes a token
_TOKEN_MAX = (1 << 31) - 1


def root_hash(salt: str | None = None, request_salt: str = "") -> BlockHash:
    """The parent digest of every first block, for the deployment's `salt` (None: the
    environment's, if any) and a request's `request_salt` ("": none, the deployment's root)."""
    if salt is None:
        salt = envs.prefix_cache_salt() or ""
    return _root_hash(salt, request_salt)


@functools.lru_cache(maxsize=4096)  # one entry per tenant (and client salt) seen lately
def _root_hash(salt: str, request_salt: str) -> BlockHash:
    if not request_salt:
        return hashlib.sha256(_DOMAIN + salt.encode()).digest()
    encoded = salt.encode()
    # Length-prefixed: no (salt, request salt) pair spells another's bytes.
    framed = len(encoded).to_bytes(4, "big") + encoded + request_salt.encode()
    return hashlib.sha256(_SALTED_DOMAIN + framed).digest()


ROOT_BLOCK_HASH: BlockHash = root_hash("")  # unsalted


def hash_block_tokens(parent_hash: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """The digest of one full block, chained to the digest of the block before it."""
    try:
        data = array(_TOKEN_TYPECODE, token_ids).tobytes()
    except OverflowError:
        raise ValueError(f"a token id outside 0..{_TOKEN_MAX} in {list(token_ids)}") from None
    return hashlib.sha256(parent_hash + data).digest()


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, root: BlockHash
) -> list[BlockHash]:
    """Append to `hashes` the digests of the full blocks of `token_ids` it lacks (it holds
    the first len(hashes) blocks' already); returns `hashes`."""
    parent = hashes[-1] if hashes else root
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


def block_hashes(
    token_ids: Sequence[int], block_size: int, root: BlockHash = ROOT_BLOCK_HASH
) -> list[BlockHash]:
    """One digest per full block of `token_ids`; digest i depends on blocks 0..i."""
    return extend_block_hashes([], token_ids, block_size, root)
