"""The hash chain over a request's full KV blocks, and cheap slices of its token stream.

Block i's hash covers its own tokens and, through its parent (block i - 1's hash), every token
before it, so one dict lookup per block finds the longest cached prefix. Only ints and tuples
of ints are hashed: CPython hashes those identically in every process (no PYTHONHASHSEED salt),
so every node computes the same hashes for the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.request import Request

BlockHash = int

# Parent of a request's first block. An int, not None: before Python 3.12 hash(None) depends
# on None's address and so differs between processes.
ROOT_BLOCK_HASH: BlockHash = 0


def hash_block_tokens(parent_hash: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block, chained to the hash of the block before it."""
    return hash((parent_hash, tuple(token_ids)))


def request_token_ids(request: Request, start: int, end: int) -> list[int]:
    """`request.all_token_ids[start:end]` without concatenating the whole prompt and output."""
    prompt_len = request.prompt_len
    if start >= prompt_len:
        return request.output_token_ids[start - prompt_len : end - prompt_len]
    if end <= prompt_len:
        return request.prompt_token_ids[start:end]
    return request.prompt_token_ids[start:] + request.output_token_ids[: end - prompt_len]
