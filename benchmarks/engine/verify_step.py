"""pd-bench engine --num-speculative-tokens K: the speculative verify step beside a plain decode
step, same engine, batch and context.

A verify step runs K + 1 query tokens per request (the last token and K drafts) through the
target, samples every position and lands the accepted run. To time it at a fixed shape, the
engine's proposer is replaced by `FixedDraftProposer`: K drafts for every request every step,
none of which the target accepts (a token the synthetic weights never emit next is not
guaranteed, so acceptance is reported, not assumed): the step's cost does not depend on the
outcome beyond the tokens landed. The plain decode rows of the same engine opt out
(`SamplingParams.speculative=False`), so they run as without speculation.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from engine.engine_core import EngineCore
from engine.scheduler_output import ScheduledChunk
from engine.spec_decode import Proposer

DRAFT_TOKEN = 3  # drafted at every position (rarely what the target samples next)


class FixedDraftProposer(Proposer):
    """As many drafts as the chunk has slots, always `DRAFT_TOKEN`."""

    name = "fixed"

    def propose(self, chunks: Sequence[ScheduledChunk]) -> list[list[int]]:
        return [[DRAFT_TOKEN] * c.num_lookahead_tokens for c in chunks]


def use_fixed_drafts(core: EngineCore) -> None:
    if core.spec is None:
        raise ValueError("the engine was built without speculative decoding")
    core.spec.proposer = FixedDraftProposer()


def add_spec_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=0,
        help="K > 0: also a verify step of K + 1 tokens per request at each batch and context",
    )


def spec_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """The engine's speculative knobs for `--num-speculative-tokens` (n-gram; the proposer is
    then replaced by `use_fixed_drafts`)."""
    k = args.num_speculative_tokens
    return dict(speculative_method="ngram", num_speculative_tokens=k) if k > 0 else {}
