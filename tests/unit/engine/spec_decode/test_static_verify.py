"""The CUDA-graph verify path's inputs, run eagerly on CPU: verify steps padded to a graph's
batch size, every request verifying K drafts (padded with repeats), through static buffers with
`static_shapes` metadata of K + 1 queries per row (torch backend); the draft model's decode
and verify steps the same way. Tokens equal the plain engine's; no block leaks."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.cuda_graphs import make_decode_graphs
from tests.unit.engine.conftest import random_prompts


def with_static_graphs(llm: LLM) -> list[int]:
    """Every graph slot of the engine (and of its draft model) filled with uncaptured static
    buffers; returns the list each verify replay appends its padded batch size to."""
    core = llm.engine
    args = (core.config.scheduler.max_num_seqs, core.max_model_len, core.pool.scratch_block,
            core.device, False)  # fmt: skip
    k = core.config.speculative.num_speculative_tokens
    model, caches = core.loaded.model, core.pool.kv_caches
    core.runner.decode_graphs = make_decode_graphs(model, caches, *args)
    core.runner.verify_graphs = verify = make_decode_graphs(model, caches, *args, k + 1)
    assert core.spec is not None
    core.spec.pad_drafts = True
    proposer = core.spec.proposer
    if proposer.name == "draft":
        draft, draft_caches = proposer.model, proposer.kv_caches
        proposer.graphs = make_decode_graphs(draft, draft_caches, *args)
        proposer.verify_graphs = make_decode_graphs(draft, draft_caches, *args, k + 1)
    sizes: list[int] = []
    run = verify.run
    verify.run = lambda batch: sizes.append(batch.num_rows) or run(batch)
    return sizes


@pytest.mark.parametrize("proposer", ["ngram", "draft-self"])
def test_static_verify_matches_plain_path(tiny_checkpoints, proposer: str) -> None:
    checkpoint = str(tiny_checkpoints["llama"])
    prompts = random_prompts(7, 512, seed=5, min_len=3, max_len=40)
    prompts = [p * 2 for p in prompts]  # repeats: prompt lookup finds drafts
    params = [
        SamplingParams(temperature=0.0, max_tokens=6 + 4 * (i % 4), ignore_eos=True, logprobs=1)
        for i in range(len(prompts))
    ]
    kwargs = dict(device="cpu", dtype="float32", num_blocks=256, max_num_seqs=6)
    expected = [o.token_ids for o in LLM(checkpoint, **kwargs).generate(prompts, params)]
    spec = (
        dict(speculative_method="ngram", ngram_prompt_lookup_min=1)
        if proposer == "ngram"
        else dict(speculative_method="draft", speculative_model=checkpoint)
    )
    llm = LLM(checkpoint, num_speculative_tokens=3, **kwargs, **spec)
    padded_sizes = with_static_graphs(llm)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    assert {4, 6} & set(padded_sizes), "verify steps should have run padded, static"
    llm.engine.check_no_leaks()
