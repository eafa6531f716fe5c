"""The real default model (SmolLM2-135M, fp32 on CPU) with prompt lookup on an input-grounded
prompt: the greedy tokens of the engine without speculation, most of them from accepted
drafts; a stop string that completes inside an accepted run ends the output there; a
constrained request beside it is not speculated."""

from __future__ import annotations

import dataclasses
import re

import pytest

from engine import LLM, SamplingParams
from engine.outputs import StepOutput
from pdserve.structured_output import StructuredOutputParams

pytestmark = pytest.mark.slow

MESSAGES = [
    {
        "role": "user",
        "content": "Rewrite this function with type hints, keeping everything else as it is:\n\n"
        "def moving_average(values, window):\n"
        "    result = []\n"
        "    for i in range(len(values) - window + 1):\n"
        "        chunk = values[i : i + window]\n"
        "        result.append(sum(chunk) / window)\n"
        "    return result\n",
    }
]
GREEDY = dict(temperature=0.0, max_tokens=64)


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM("smollm2-135m", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def spec() -> LLM:
    return LLM("smollm2-135m", device="cpu", dtype="float32", speculative_method="ngram")


def recorded(llm: LLM) -> list[StepOutput]:
    """Every StepOutput the next generate() call sees."""
    seen: list[StepOutput] = []
    step = llm.engine.step
    llm.engine.step = lambda: [seen.append(o) or o for o in step()]  # type: ignore[method-assign]
    return seen


def test_prompt_lookup_gives_the_plain_tokens(plain: LLM, spec: LLM) -> None:
    expected = plain.chat(MESSAGES, SamplingParams(**GREEDY))[0]
    got = spec.chat(MESSAGES, SamplingParams(**GREEDY))[0]
    assert (got.token_ids, got.text) == (expected.token_ids, expected.text)
    stats = spec.engine.stats().spec_decode
    assert stats.num_accepted_tokens > len(got.token_ids) / 4  # the answer copies the prompt
    spec.engine.check_no_leaks()


def test_a_stop_string_inside_an_accepted_run(plain: LLM, spec: LLM) -> None:
    steps = recorded(spec)
    tokens = spec.chat(MESSAGES, SamplingParams(**GREEDY))[0].token_ids
    tokenizer = spec.tokenizer
    assert tokenizer is not None
    # A token in the middle of a multi-token step whose text first completes a new string.
    stop, index = None, 0
    for out in steps:
        for j in range(len(out.new_token_ids) - 1):
            i = index + j
            before, upto = tokenizer.decode(tokens[:i]), tokenizer.decode(tokens[: i + 1])
            piece = upto[len(before) :].strip()
            if stop is None and len(piece) >= 3 and piece not in before:
                stop = piece
        index += len(out.new_token_ids)
    assert stop is not None, "no accepted run to place a stop string in"
    params = SamplingParams(**GREEDY, stop=[stop])
    expected = plain.chat(MESSAGES, params)[0]
    steps.clear()
    got = spec.chat(MESSAGES, params)[0]
    assert (got.token_ids, got.text, got.finish_reason) == (
        expected.token_ids, expected.text, "stop"
    )  # fmt: skip
    assert sum(len(o.new_token_ids) for o in steps) > len(got.token_ids), (
        "the run that completed the stop string had tokens after it, dropped"
    )
    spec.engine.check_no_leaks()


def test_a_constrained_request_is_not_speculated(plain: LLM, spec: LLM) -> None:
    """Structured outputs and speculation in one batch: the constrained request decodes one
    token a step (no drafts: they are not checked against its grammar), with the plain
    engine's tokens, while the free one beside it still verifies drafts."""
    regex = r"def moving_average\(values: list\[float\], window: int\) -> list\[float\]:"
    constrained = SamplingParams(**GREEDY, structured_output=StructuredOutputParams.regex(regex))
    prompts = [MESSAGES, MESSAGES]
    params = [constrained, SamplingParams(**GREEDY)]
    expected = [o.token_ids for o in plain.chat(prompts, params)]
    steps = recorded(spec)
    before = dataclasses.replace(spec.engine.stats().spec_decode)
    got = spec.chat(prompts, params)
    assert [o.token_ids for o in got] == expected
    assert re.fullmatch(regex, got[0].text), got[0].text
    runs: dict[str, list[list[int]]] = {}
    for out in steps:
        runs.setdefault(out.request_id, []).append(out.new_token_ids)
    (constrained_runs,) = [r for r in runs.values() if sum(r, []) == got[0].token_ids]
    (free_runs,) = [r for r in runs.values() if sum(r, []) == got[1].token_ids]
    assert all(len(run) <= 1 for run in constrained_runs)
    assert any(len(run) > 1 for run in free_runs)
    after = spec.engine.stats().spec_decode
    assert after.num_verifies > before.num_verifies
    spec.engine.check_no_leaks()
