"""The verify step's rule: each position is sampled as a plain decode samples it, a draft is
accepted while it equals that token. Checked on fixed logits against the exact target
distribution (chi-square over many seeds), and through the engine on a small-vocabulary model:
with speculation, sampled outputs keep their distribution (unseeded draws) and their exact
tokens (seeded draws)."""

from __future__ import annotations

import collections

import pytest
import torch

from engine import LLM, SamplingParams
from engine.request import Request
from engine.sampler import Sampler
from engine.scheduler_output import ScheduledChunk
from engine.spec_decode.verification import num_accepted, sampling_rows


def chi_square_p_value(counts: dict[int, int], probs: torch.Tensor) -> float:
    """Pearson's test of `counts` against the distribution `probs` (cells with an expected
    count under 5 pooled)."""
    total = sum(counts.values())
    observed = torch.tensor([counts.get(i, 0) for i in range(probs.numel())], dtype=torch.float64)
    expected = probs.double() * total
    impossible = expected == 0
    assert observed[impossible].sum() == 0, "a token of probability 0 was emitted"
    observed, expected = observed[~impossible], expected[~impossible]
    small = expected < 5
    if small.any():
        observed = torch.cat([observed[~small], observed[small].sum().view(1)])
        expected = torch.cat([expected[~small], expected[small].sum().view(1)])
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(observed.numel() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, statistic / 2))


def two_sample_p_value(a: collections.Counter, b: collections.Counter) -> float:
    """Chi-square test that two samples come from one distribution (homogeneity)."""
    cells = sorted(set(a) | set(b))
    table = torch.tensor([[a[c] for c in cells], [b[c] for c in cells]], dtype=torch.float64)
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    statistic = ((table - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(len(cells) - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, statistic / 2))


def verify_chunk(request: Request, drafts: list[int]) -> ScheduledChunk:
    start = request.num_tokens - 1
    tokens = [request.all_token_ids[-1], *drafts]
    return ScheduledChunk(request, tokens, start, [], True, len(drafts), len(drafts))


def test_row_views_see_the_drafts_before_them() -> None:
    params = SamplingParams(temperature=1.0, seed=3, presence_penalty=0.5, max_tokens=9)
    request = Request("r", [5, 6], params, output_token_ids=[7, 8])
    rows = sampling_rows([verify_chunk(request, [9, 10])])
    assert [r.output_token_ids for r in rows] == [[7, 8], [7, 8, 9], [7, 8, 9, 10]]
    assert [r.num_sampled_tokens for r in rows] == [2, 3, 4]
    plain = Request("q", [5, 6], SamplingParams(temperature=0.0), output_token_ids=[7])
    rows = sampling_rows([verify_chunk(plain, [1, 2, 3])])
    assert all(r.output_token_ids is plain.output_token_ids for r in rows)  # no copy
    assert [r.num_sampled_tokens for r in rows] == [1, 2, 3, 4]
    assert num_accepted([4, 5, 6], [4, 5, 9, 1]) == 2 and num_accepted([4], [4, 3]) == 1
    assert num_accepted([4, 5], [3, 5, 1]) == 0


@pytest.mark.parametrize("draft", [0, 3], ids=["likely-draft", "unlikely-draft"])
def test_the_rule_keeps_the_target_distribution(draft: int) -> None:
    """Fixed logits (temperature 0.8, top-p 0.95) and a one-hot draft, 4000 seeds: the first
    emitted token follows the target's p, the draft is accepted with probability p(draft),
    and a rejection yields p without the draft, renormalised (the residual)."""
    logits = torch.tensor([2.0, 1.2, 0.7, 0.1, -0.3, -1.0])
    params = {"temperature": 0.8, "top_p": 0.95, "max_tokens": 5}
    scaled = (logits / 0.8).softmax(-1)
    keep = (
        scaled.sort(descending=True).values.cumsum(0) - scaled.sort(descending=True).values < 0.95
    )
    probs = torch.zeros(6)
    order = scaled.argsort(descending=True)
    probs[order[keep]] = scaled[order[keep]]
    probs /= probs.sum()
    sampler, emitted, residual, accepted = (
        Sampler(),
        collections.Counter(),
        collections.Counter(),
        0,
    )
    for seed in range(4000):
        request = Request("r", [1], SamplingParams(seed=seed, **params), output_token_ids=[4])
        rows = sampling_rows([verify_chunk(request, [draft])])
        first = sampler(logits.repeat(2, 1), rows).token_ids[0]
        emitted[first] += 1
        accepted += num_accepted([draft], [first])
        if first != draft:
            residual[first] += 1
    assert chi_square_p_value(emitted, probs) > 1e-3
    rate = accepted / 4000
    assert (
        abs(rate - float(probs[draft]))
        < 4 * (float(probs[draft]) * (1 - float(probs[draft])) / 4000) ** 0.5
    )
    rest = probs.clone()
    rest[draft] = 0
    assert chi_square_p_value(residual, rest / rest.sum()) > 1e-3


SMALL_MODEL = "synthetic:tiny-llama:vocab=8"


def sample_outputs(params: list[SamplingParams], **spec) -> list[list[int]]:
    llm = LLM(SMALL_MODEL, device="cpu", dtype="float32", num_blocks=512, max_num_seqs=256, **spec)
    outs = llm.generate([[3, 4, 5, 3, 4, 5, 3, 4]] * len(params), params)
    llm.engine.check_no_leaks()
    stats = llm.engine.stats().spec_decode
    if spec:
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both outcomes ran
    return [o.token_ids for o in outs]


SPEC = {
    "draft-self": dict(speculative_method="draft", speculative_model=SMALL_MODEL),
    "ngram": dict(speculative_method="ngram", num_speculative_tokens=3, ngram_prompt_lookup_min=1),
}


@pytest.mark.parametrize("proposer", list(SPEC))
def test_unseeded_sampling_keeps_its_distribution(proposer: str) -> None:
    """1200 unseeded requests at temperature 1, a vocabulary of 8: the tokens at each output
    index verify steps produced have the distribution they have without speculation
    (two-sample chi-square, p > 0.001; the engines' unseeded generators are seeded, so the
    test is deterministic)."""
    params = [SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)] * 1200
    plain = sample_outputs(params)
    spec = sample_outputs(params, **SPEC[proposer])
    assert plain != spec  # unseeded: other draws, same distribution
    for index in (1, 2, 3):
        a = collections.Counter(t[index] for t in plain)
        b = collections.Counter(t[index] for t in spec)
        assert two_sample_p_value(a, b) > 1e-3, (index, a, b)
    pairs_a = collections.Counter(tuple(t[1:3]) for t in plain)
    pairs_b = collections.Counter(tuple(t[1:3]) for t in spec)
    common = {k for k in pairs_a | pairs_b if pairs_a[k] + pairs_b[k] >= 10}
    assert (
        two_sample_p_value(
            collections.Counter({k: pairs_a[k] for k in common}),
            collections.Counter({k: pairs_b[k] for k in common}),
        )
        > 1e-3
    )


@pytest.mark.parametrize("proposer", list(SPEC))
def test_seeded_sampling_gives_the_same_tokens(proposer: str) -> None:
    """A seeded request draws position n's noise from (seed, n) whether or not a draft sits
    there, so its tokens are those it gets without speculation."""
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=6, ignore_eos=True, top_k=6)
        for seed in range(200)
    ]
    assert sample_outputs(params, **SPEC[proposer]) == sample_outputs(params)
