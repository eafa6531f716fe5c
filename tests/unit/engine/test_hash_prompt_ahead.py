"""AsyncEngine.hash_prompt_ahead: a decode node hashes a prompt's full blocks while its KV is on
the way, so admitting the request computes no digest on the engine thread."""

from __future__ import annotations

import pytest

from engine.async_engine import AsyncEngine
from engine.engine_core import EngineCore
from engine.request import Request
from pdserve.block_hash import block_hashes
from pdserve.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.sampling_params import SamplingParams


def _engine(enable_prefix_caching: bool) -> AsyncEngine:
    cache = CacheConfig(block_size=4, num_blocks=32, enable_prefix_caching=enable_prefix_caching)
    model = ModelConfig(model="synthetic:tiny-llama", device="cpu", dtype="float32")
    return AsyncEngine(EngineCore(EngineConfig(model=model, cache=cache)))


def _request(num_tokens: int) -> Request:
    return Request("r", list(range(3, 3 + num_tokens)), SamplingParams(max_tokens=4))


@pytest.mark.parametrize("num_tokens, num_full_blocks", [(3, 0), (4, 1), (11, 2), (12, 3)])
def test_the_prompts_full_blocks_get_the_engines_digests(num_tokens, num_full_blocks) -> None:
    engine = _engine(enable_prefix_caching=True)
    request = _request(num_tokens)
    engine.hash_prompt_ahead(request)
    kv = engine.core.kv_cache_manager  # the prefix cache's chain, with its (salted) root
    assert request.block_hashes == block_hashes(request.prompt_token_ids, 4, kv.root_hash)
    assert len(request.block_hashes) == num_full_blocks


def test_nothing_is_hashed_without_prefix_caching() -> None:
    request = _request(12)
    _engine(enable_prefix_caching=False).hash_prompt_ahead(request)
    assert request.block_hashes == []
