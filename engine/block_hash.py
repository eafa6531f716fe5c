"""A request's block hashes (the chain itself is `pdserve.block_hash`, shared with the
router's prefix-aware policy), and cheap slices of its token stream.

Block i's digest covers its own tokens and, through its parent (block i - 1's digest), every
token before it, so one dict lookup per block finds the longest cached prefix. A request keeps
the digests of its full blocks (`Request.block_hashes`): each block is hashed once, however often
the scheduler looks the request up (waiting for blocks, preempted and readmitted).
"""

from __future__ import annotations

from engine.request import Request
from pdserve.block_hash import BlockHash, hash_block_tokens


def request_block_hashes(
    request: Request, num_blocks: int, block_size: int, root: BlockHash
) -> list[BlockHash]:
    """`request.block_hashes`, grown to hold at least its first `num_blocks` full blocks'
    digests (only the missing ones are computed; it may hold more). The tokens of a full block
    never change, so the list stays valid for the request's life."""
    hashes = request.block_hashes
    if len(hashes) < num_blocks:
        start = len(hashes)
        token_ids = request_token_ids(request, start * block_size, num_blocks * block_size)
        parent = hashes[-1] if hashes else root
        for i in range(num_blocks - start):
            parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size])
            hashes.append(parent)
    return hashes


def request_token_ids(request: Request, start: int, end: int) -> list[int]:
    """`request.all_token_ids[start:end]` without concatenating the whole prompt and output."""
    prompt_len = request.prompt_len
    if start >= prompt_len:
        return request.output_token_ids[start - prompt_len : end - prompt_len]
    if end <= prompt_len:
        return request.prompt_token_ids[start:end]
    return request.prompt_token_ids[start:] + request.output_token_ids[: end - prompt_len]
