"""`EngineStats`: what `EngineCore.stats()` reports (the nodes' /metrics and load reports)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.kv_offload import KVOffloadStats
from engine.spec_decode import SpecDecodeStats


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_prefilled_held: int
    num_reserved: int
    num_total_blocks: int
    num_free_blocks: int
    prefix_cache_hit_tokens: int
    prefix_cache_query_tokens: int
    # speculative decoding since start (all 0 when off): engine/spec_decode/stats.py
    spec_decode: SpecDecodeStats = dataclasses.field(default_factory=SpecDecodeStats)
    # the host tier (all 0 when --kv-offload-memory is 0): engine/kv_offload
    kv_offload: KVOffloadStats = dataclasses.field(default_factory=KVOffloadStats)
    prompt_tokens_computed: int = 0  # prompt tokens run through the model (recomputes too)
