"""Served nodes with speculative decoding (prompt lookup): a colocated cluster (the decode node
prefills locally, then verifies drafts) and a 1P1D one over tcp (the prefill node proposes the
first drafts after the first token and sends them with it; the decode node's first step verifies
them) give the offline engine's greedy tokens and free every block."""

from __future__ import annotations

import re

import pytest

from tests.e2e.conftest import _cluster
from tests.e2e.test_serving import (  # noqa: F401 (offline_reference: a fixture)
    MAX_TOKENS,
    PROMPTS,
    generate_many,
    offline_reference,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
SPEC = ("--speculative-method", "ngram", "--num-speculative-tokens", "4")
# Its answer copies the prompt: the prefill node finds drafts right after the first token.
GROUNDED = (
    "def moving_average(values, window):\n    result = []\n"
    "    for i in range(len(values) - window + 1):\n        chunk = values[i : i + window]\n"
    "        result.append(sum(chunk) / window)\n    return result\n\n"
    "# The same function, unchanged:\ndef moving_average("
)


@pytest.fixture(scope="module")
def cluster_1p1d_spec():
    yield from _cluster("--prefill", "1", "--decode", "1", "--kv-transport", "tcp", *SPEC)


@pytest.fixture(scope="module")
def cluster_colocated_spec():
    yield from _cluster("--prefill", "0", "--decode", "1", *SPEC)


@pytest.fixture(scope="module")
def grounded_reference() -> list[int]:
    from engine import LLM, SamplingParams

    llm = LLM("smollm2-135m", device="cpu", dtype="float32")
    (out,) = llm.generate([GROUNDED], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return out.token_ids


def test_speculating_nodes_equal_offline(
    cluster_1p1d_spec,
    cluster_colocated_spec,
    offline_reference,  # noqa: F811
    grounded_reference,
):
    expected = [*offline_reference[0], grounded_reference]
    for cluster in (cluster_colocated_spec, cluster_1p1d_spec):
        assert any("speculative=ngram K=4" in line for line in cluster.log)
        got = generate_many(
            cluster.router, [*PROMPTS, GROUNDED], temperature=0.0, max_tokens=MAX_TOKENS
        )
        assert [r.token_ids for r in got] == expected
        stats = cluster.wait_all_blocks_free(timeout_s=5)
        assert all(s.num_free_kv_blocks == s.num_kv_blocks for s in stats.values()), stats
    # 1P1D: the grounded prompt's drafts went with its first token
    sent = [int(m) for line in cluster_1p1d_spec.log for m in re.findall(r"(\d+) drafts", line)]
    assert any(n > 0 for n in sent), sent
