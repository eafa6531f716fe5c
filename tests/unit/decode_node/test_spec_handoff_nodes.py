"""Speculative decoding under PD through both node servers over tcp: the prefill node sends
n-gram drafts with the first token, the decode node's first step verifies them, and the tokens
are those of local prefill on the same decode node (colocated) and of the offline engine."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest

from engine import LLM, SamplingParams
from engine.scheduler_output import ScheduledChunk
from engine.spec_decode import Proposer
from pdserve.config import EngineConfig, SpeculativeConfig
from tests.unit.decode_node.node_harness import (
    BLOCK_SIZE,
    MODEL,
    engine_config,
    run,
    run_disaggregated,
    run_local,
    running_nodes,
)

pytestmark = pytest.mark.timeout(300)
NUM_BLOCKS = 512
# Every id of the vocabulary (512): a 1-token lookup finds any first token in the prompt, so
# the prefill node has drafts to send whatever the random weights sample.
PROMPT = [(7 * i) % 512 for i in range(512)][::-1]
SPEC = SpeculativeConfig(speculative_method="ngram", ngram_prompt_lookup_min=1)


class NoDrafts(Proposer):
    name = "none"

    def propose(self, chunks: Sequence[ScheduledChunk]) -> list[list[int]]:
        return [[] for _ in chunks]


def spec_engine(prefill_only: bool) -> EngineConfig:
    config = engine_config(prefill_only, num_blocks=NUM_BLOCKS)
    return dataclasses.replace(config, speculative=SPEC)


def test_drafts_sent_with_the_first_token_are_verified_first() -> None:
    (expected,) = [
        out.token_ids
        for out in LLM(
            MODEL, device="cpu", dtype="float32", block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS
        ).generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    ]

    async def main() -> None:
        async with running_nodes(
            "tcp", prefill_engine=spec_engine(True), decode_engine=spec_engine(False)
        ) as nodes:
            spec = nodes.decode.core.spec
            assert spec is not None
            own_proposer, spec.proposer = spec.proposer, NoDrafts()  # only handed-in drafts
            handoff = await run_disaggregated(nodes, "disagg", PROMPT)
            drafts = list(handoff.first_token.draft_token_ids)
            assert 1 <= len(drafts) <= SPEC.num_speculative_tokens, drafts
            assert handoff.transfer_result.ok
            stats = (await nodes.decode.engine.stats()).spec_decode
            assert (stats.num_verifies, stats.num_draft_tokens) == (1, len(drafts))
            assert handoff.token_ids == expected
            spec.proposer = own_proposer
            local = await run_local(nodes, "local", PROMPT)
            assert local == expected
            node_stats = await nodes.decode.stats()
            assert node_stats.num_spec_draft_tokens >= stats.num_draft_tokens

    run(main(), timeout_s=240)
