"""Issue 15: the prefix cache's block hashes are sha256 (pdserve.block_hash), not Python's
hash(): the same in every process whatever PYTHONHASHSEED, changed by a salt, and computed
identically by the engine's KVCacheManager and the router's prefix-aware policy."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from pdserve.block_hash import ROOT_BLOCK_HASH, block_hashes, hash_block_tokens, root_hash
from pdserve.sampling_params import SamplingParams
from router.policies import make_policy
from tests.child_env import child_env

BLOCK_SIZE = 4
PROMPT = [5, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]  # 3 full blocks + 2 tokens
_PRINT_HASHES = (
    "from pdserve.block_hash import block_hashes, root_hash;"
    f"print(','.join(h.hex() for h in block_hashes({PROMPT}, {BLOCK_SIZE}, root_hash())))"
)


def _hashes_in_a_process(hash_seed: str, salt: str | None = None) -> list[bytes]:
    env = child_env(PYTHONHASHSEED=hash_seed)
    env.pop("PDSERVE_PREFIX_CACHE_SALT", None)
    if salt is not None:
        env["PDSERVE_PREFIX_CACHE_SALT"] = salt
    out = subprocess.run(
        [sys.executable, "-c", _PRINT_HASHES], env=env, capture_output=True, text=True,
        timeout=60, check=True,
    ).stdout  # fmt: skip
    return [bytes.fromhex(h) for h in out.strip().split(",")]


def test_hashes_are_sha256_and_the_same_in_every_process():
    a = _hashes_in_a_process("1")
    b = _hashes_in_a_process("2")
    assert a == b == block_hashes(PROMPT, BLOCK_SIZE)
    assert len(a) == 3 and all(len(h) == 32 for h in a)  # sha256 digests, not ints
    assert _hashes_in_a_process("1", salt="tenant-a") == _hashes_in_a_process("2", "tenant-a")


def test_a_salt_changes_every_hash_and_the_chain_covers_the_prefix():
    plain = block_hashes(PROMPT, BLOCK_SIZE)
    salted = block_hashes(PROMPT, BLOCK_SIZE, root_hash("tenant-a"))
    assert not set(plain) & set(salted)
    assert block_hashes(PROMPT, BLOCK_SIZE, root_hash("tenant-a")) == salted
    assert root_hash("") == ROOT_BLOCK_HASH
    other_head = block_hashes([9] + PROMPT[1:], BLOCK_SIZE)
    assert other_head[1] != plain[1]  # block 1's digest depends on block 0
    assert hash_block_tokens(ROOT_BLOCK_HASH, [1, 2, 3, 4]) != hash_block_tokens(
        ROOT_BLOCK_HASH, [1, 2, 3, 5]
    )
    with pytest.raises(ValueError, match="token id"):
        hash_block_tokens(ROOT_BLOCK_HASH, [1 << 40])


def test_the_environment_salt_applies_when_no_knob_is_given(monkeypatch):
    monkeypatch.setenv("PDSERVE_PREFIX_CACHE_SALT", "from-env")
    assert root_hash() == root_hash("from-env") != ROOT_BLOCK_HASH
    assert root_hash("knob") != root_hash()  # the knob wins


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_engine_and_router_compute_identical_hashes(salt, monkeypatch):
    monkeypatch.delenv("PDSERVE_PREFIX_CACHE_SALT", raising=False)
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, prefix_cache_salt=salt)
    request = Request("r", list(PROMPT), SamplingParams(max_tokens=4))
    assert manager.allocate_slots(request, len(PROMPT))
    request.num_computed_tokens = len(PROMPT)
    manager.cache_full_blocks(request)
    engine_hashes = [manager._block_hashes[block_id] for block_id in request.block_ids[:3]]

    policy = make_policy("prefix_aware", prefix_cache_salt=salt)
    router_hashes = block_hashes(PROMPT, BLOCK_SIZE, policy.root_hash)
    assert engine_hashes == router_hashes == request.block_hashes
    assert (engine_hashes == block_hashes(PROMPT, BLOCK_SIZE)) == (salt is None)

    # The same prompt in another request hits every full block (computed once per request).
    again = Request("s", list(PROMPT), SamplingParams(max_tokens=4))
    block_ids, hit_tokens = manager.get_computed_blocks(again)
    assert block_ids == request.block_ids[:3] and hit_tokens == 12
    assert again.block_hashes == engine_hashes
    manager.free(request)


def test_pd_serve_gives_the_salt_to_the_router_and_the_nodes():
    from pdserve.cli import build_parser, engine_config, router_config

    parser = build_parser("serve")
    assert parser.targets["--prefix-cache-salt"] == {"router", "node"}
    args = parser.parse_args(["--prefix-cache-salt", "tenant-a"])
    assert router_config(args).prefix_cache_salt == "tenant-a"
    assert engine_config(args).cache.prefix_cache_salt == "tenant-a"
