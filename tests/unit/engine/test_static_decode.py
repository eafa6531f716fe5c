"""The CUDA-graph decode path's inputs, run eagerly on CPU: decode batches padded to a graph
size, written through the static buffers with `static_shapes` metadata (torch backend), padded
rows in the scratch block. Tokens must equal the plain CPU path's; no block may leak."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.cuda_graphs import DecodeGraphs, graph_batch_sizes
from tests.unit.engine.conftest import random_prompts


def test_graph_batch_sizes() -> None:
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(128)[:6] == [1, 2, 4, 8, 16, 24] and graph_batch_sizes(128)[-1] == 128


def with_static_decode(llm: LLM) -> DecodeGraphs:
    core = llm.engine
    graphs = DecodeGraphs(
        core.loaded.model, core.pool.kv_caches, core.config.scheduler.max_num_seqs,
        -(-core.max_model_len // core.pool.block_size), core.pool.block_size,
        core.pool.scratch_block, core.device,
    )  # fmt: skip
    core.runner.decode_graphs = graphs
    return graphs


@pytest.mark.parametrize("num_blocks", [256, 24], ids=["roomy", "preempting"])
def test_static_decode_matches_plain_path(tiny_checkpoints, num_blocks: int) -> None:
    checkpoint = str(tiny_checkpoints["llama"])
    prompts = random_prompts(11, 512, seed=3, min_len=3, max_len=70)
    prompts += [prompts[0][:40] + [5, 6, 7]]  # a prefix hit
    params = [  # different lengths: the decode batch shrinks through sizes that pad
        SamplingParams(temperature=0.0, max_tokens=4 + 3 * (i % 5), ignore_eos=True, logprobs=2)
        for i in range(len(prompts))
    ]
    kwargs = dict(device="cpu", dtype="float32", num_blocks=num_blocks, max_num_seqs=6)
    plain = LLM(checkpoint, **kwargs)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    llm = LLM(checkpoint, **kwargs)
    graphs = with_static_decode(llm)
    assert graphs.sizes == [1, 2, 4, 6]
    padded_sizes = []
    run = graphs.run
    graphs.run = lambda batch: padded_sizes.append(batch.num_rows) or run(batch)
    outs = llm.generate(prompts, params)
    assert {4, 6} <= set(padded_sizes), "decode steps should have run padded, static"
    assert [o.token_ids for o in outs] == expected
    llm.engine.check_no_leaks()
