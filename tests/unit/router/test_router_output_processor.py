"""OutputProcessor: each output index once, text via the detokenizer, stop strings, usage."""

from __future__ import annotations

import grpc
import pytest
from router_fakes import MAX_MODEL_LEN, VOCAB_SIZE

from pdserve.v1 import node_pb2
from router.client import build_request
from router.errors import RouterError
from router.input_processor import InputProcessor
from router.output_processor import NodeTokens, OutputProcessor


@pytest.fixture
def make_output(tokenizer):
    processor = InputProcessor(
        tokenizer, node_pb2.NodeInfo(max_model_len=MAX_MODEL_LEN, vocab_size=VOCAB_SIZE)
    )

    def make(**sampling) -> OutputProcessor:
        request = processor.process(build_request("hello", request_id="r1", **sampling))
        return OutputProcessor(request, tokenizer)

    return make


def test_each_output_index_is_emitted_once(make_output, tokenizer) -> None:
    ids = tokenizer.encode("the quick brown fox", add_special_tokens=False)
    output = make_output(max_tokens=len(ids))

    first = output.process(NodeTokens(0, ids[:1]))
    overlap = output.process(NodeTokens(0, ids[:3]))  # D's chunk repeats index 0
    duplicate = output.process(NodeTokens(1, ids[1:3]))  # nothing new
    last = output.process(NodeTokens(3, ids[3:], finish_reason="length", num_cached_tokens=2))

    assert list(first.token_ids) == ids[:1] and list(overlap.token_ids) == ids[1:3]
    assert duplicate is None
    assert list(last.token_ids) == ids[3:] and last.finish_reason == "length"
    assert first.text + overlap.text + last.text == "the quick brown fox"
    assert (last.usage.completion_tokens, last.usage.cached_tokens) == (len(ids), 2)
    assert output.process(NodeTokens(0, ids)) is None  # finished: ignored


def test_a_gap_in_output_indices_is_an_internal_error(make_output) -> None:
    output = make_output()
    output.process(NodeTokens(0, [5]))

    with pytest.raises(RouterError) as error:
        output.process(NodeTokens(2, [6]))

    assert error.value.code == grpc.StatusCode.INTERNAL
    assert "output index 2 before index 1" in error.value.message


def test_multibyte_characters_are_held_until_complete(make_output, tokenizer) -> None:
    ids = tokenizer.encode("日本語 🙂", add_special_tokens=False)
    output = make_output(max_tokens=len(ids))

    texts = [output.process(NodeTokens(i, [t])).text for i, t in enumerate(ids[:-1])]
    texts.append(output.process(NodeTokens(len(ids) - 1, ids[-1:], finish_reason="length")).text)

    assert "\ufffd" not in "".join(texts) and "".join(texts) == "日本語 🙂"
    assert "" in texts  # some token completed no character


def test_stop_string_inside_a_chunk_drops_the_later_tokens(make_output, tokenizer) -> None:
    ids = tokenizer.encode("hello world, hello there! the end", add_special_tokens=False)
    output = make_output(max_tokens=len(ids), stop=["there"])

    response = output.process(NodeTokens(0, ids))

    assert response.finish_reason == "stop" and response.text == "hello world, hello "
    num_kept = len(response.token_ids)
    assert "there" in tokenizer.decode(ids[:num_kept])
    assert "there" not in tokenizer.decode(ids[: num_kept - 1])
    assert response.usage.completion_tokens == num_kept


def test_text_held_as_a_possible_stop_start_is_flushed_at_the_finish(
    make_output, tokenizer
) -> None:
    ids = tokenizer.encode("hello the", add_special_tokens=False)
    output = make_output(max_tokens=len(ids), stop=["the end"])

    texts = [output.process(NodeTokens(i, [t])).text for i, t in enumerate(ids[:-1])]
    last = output.process(NodeTokens(len(ids) - 1, ids[-1:], finish_reason="length"))

    assert "".join(texts) + last.text == "hello the"
    assert last.finish_reason == "length"


def test_logprobs_only_when_requested(make_output) -> None:
    logprobs = [node_pb2.TokenChunk(logprobs=[{"token_id": 5, "logprob": -1.0}]).logprobs[0]]
    without = make_output().process(NodeTokens(0, [5], logprobs))
    with_ = make_output(logprobs=0).process(NodeTokens(0, [5], logprobs))

    assert list(without.logprobs) == []
    assert [(lp.token_id, lp.logprob) for lp in with_.logprobs] == [(5, -1.0)]
