"""Phase B's hooks on worker ranks: node code's worker_init runs in each worker process with that
rank's EngineCore, and what it returns reaches rank 0; the layer hook it installs gets the same
prefill chunks, layer by layer, as rank 0's hook; each rank's TPShard, KV pool (its kv heads,
rank 0's number of blocks) and layer_ready are reachable there."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from engine import SamplingParams
from engine.engine_core import EngineCore
from pdserve.config import EngineConfig
from tests.unit.engine.distributed.tp_models import chunk_keys, recording_init


def test_every_rank_hook_sees_rank_0s_prefill_chunks(tmp_path: Path) -> None:
    path = tmp_path / "rank1.jsonl"
    config = EngineConfig.from_kwargs(
        model="synthetic:tiny-llama:kv_heads=1", device="cpu", dtype="float32", num_blocks=48,
        max_num_batched_tokens=16, tensor_parallel_size=2,
    )  # fmt: skip
    rank0_calls: list[tuple[int, list[list[object]]]] = []
    core = EngineCore(
        config,
        on_layer_done=lambda layer, chunks: rank0_calls.append((layer, chunk_keys(chunks))),
        worker_init=functools.partial(recording_init, str(path)),
    )
    try:
        (pid,) = core.tp.workers.pids
        assert core.tp.worker_results == {1: {"rank": 1, "pid": pid}}  # worker_init's return
        params = SamplingParams(max_tokens=3, temperature=0.0)
        for i, prompt in enumerate([list(range(3, 40)), [5, 6, 7]]):  # 37 tokens: 3 chunks
            core.add_request(core.make_request(f"r{i}", prompt, params))
        while core.has_unfinished():
            core.step()
    finally:
        core.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(line["layer"], line["chunks"]) for line in lines] == rank0_calls
    assert len(rank0_calls) == 2 * 3  # 2 layers x 3 prefill steps
    # kv_heads=1 over 2 ranks: both hold kv head 0 (replicated), a pool of one head
    assert {tuple(line["shard"]) for line in lines} == {(1, 0, 1, True)}
    assert {line["pool_heads"] for line in lines} == {1}
    assert {line["num_blocks"] for line in lines} == {core.pool.num_blocks}
