"""Prompt lookup: the longest suffix n-gram found earlier proposes what followed it."""

from __future__ import annotations

import numpy as np

from engine.request import Request
from engine.scheduler_output import ScheduledChunk
from engine.spec_decode.ngram_proposer import NgramProposer, ngram_lookup
from pdserve.sampling_params import SamplingParams


def lookup(tokens: list[int], k: int = 4, min_n: int = 1, max_n: int = 4) -> list[int]:
    return ngram_lookup(np.array(tokens, np.int64), min_n, max_n, k).tolist()


def test_the_longest_match_wins_and_proposes_what_followed() -> None:
    #        0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 9, 9, 2, 3, 4, 5, 6, 1, 2, 3]  # suffix [1, 2, 3] occurs at 0..2
    assert lookup(tokens) == [9, 9, 2, 3]  # not the 2-gram [2, 3] at 5..6
    assert lookup(tokens, k=2) == [9, 9]


def test_among_equal_matches_the_latest() -> None:
    tokens = [7, 1, 8, 7, 1, 9, 5, 7, 1]  # [7, 1] at 0 and 3: the latest, 3, proposes 9, 5
    assert lookup(tokens, k=2) == [9, 5]


def test_min_n_and_max_n() -> None:
    tokens = [4, 5, 6, 0, 6]  # only the 1-gram [6] matches
    assert lookup(tokens, min_n=1) == [0, 6]
    assert lookup(tokens, min_n=2) == []
    tokens = [1, 2, 3, 4, 8, 2, 3, 4, 9, 1, 2, 3, 4]  # 4-gram at 0, 3-gram [2, 3, 4] at 5
    assert lookup(tokens, max_n=4) == [8, 2, 3, 4]
    assert lookup(tokens, max_n=3) == [9, 1, 2, 3]  # lengths capped at 3: the latest 3-gram


def test_no_match_no_draft_and_a_periodic_tail() -> None:
    assert lookup([1, 2, 3, 4]) == [] and lookup([5]) == []
    assert lookup([3, 3, 3, 3], k=4) == [3]  # the longest match overlaps the suffix
    # a repeating tail: of the longest matches (max_n), one followed by k tokens
    assert lookup([5, 3, 3, 3, 3, 3, 3, 3, 3], k=4) == [3, 3, 3, 3]
    assert lookup([5, 1, 2, 1, 2, 1, 2, 1, 2], k=3, max_n=2) == [1, 2, 1]


def test_the_proposer_follows_growing_requests() -> None:
    proposer = NgramProposer(min_n=2, max_n=3)
    request = Request("r", [1, 2, 3, 4, 1, 2], SamplingParams())
    chunk = ScheduledChunk(request, [2], 5, [], True, num_lookahead_tokens=3)
    assert proposer.propose([chunk]) == [[3, 4, 1]]
    request.output_token_ids += [3, 4] + list(range(100, 300))  # the buffer grows
    request.output_token_ids += [150, 151]
    assert proposer.propose([chunk]) == [[152, 153, 154]]
