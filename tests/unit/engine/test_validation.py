"""Invalid parameters raise errors whose message says what to fix."""

from __future__ import annotations

import pytest

from engine import LLM, InvalidRequestError, SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(temperature=-0.5), "temperature must be >= 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
        (dict(min_p=2.0), r"min_p must be in \[0, 1\]"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(temperature=float("nan")), "temperature must be a finite number"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return LLM(str(tiny_checkpoints["llama"]), device="cpu", dtype="float32", num_blocks=64)


def test_empty_prompt(llm):
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        llm.generate([[]], SamplingParams(max_tokens=4))
    llm.engine.check_no_leaks()


def test_prompt_plus_max_tokens_beyond_context(llm):
    with pytest.raises(InvalidRequestError, match="exceeds the context length 512"):
        llm.generate([[5] * 500], SamplingParams(max_tokens=20))
    llm.engine.check_no_leaks()


def test_token_id_out_of_vocab(llm):
    with pytest.raises(InvalidRequestError, match=r"must be in \[0, 512\)"):
        llm.generate([[5, 600]], SamplingParams(max_tokens=2))


def test_bad_prompt_in_batch_admits_nothing(llm):
    with pytest.raises(InvalidRequestError):
        llm.generate([[5, 6], []], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished()
    llm.engine.check_no_leaks()


def test_unknown_model_path():
    with pytest.raises((FileNotFoundError, ValueError), match="no-such-model"):
        LLM("/nonexistent/no-such-model", device="cpu")


def test_text_prompt_without_tokenizer():
    llm = LLM("synthetic:tiny-llama", device="cpu", dtype="float32", num_blocks=16)
    with pytest.raises(InvalidRequestError, match="token-id lists"):
        llm.generate(["hello"], SamplingParams(max_tokens=2))
