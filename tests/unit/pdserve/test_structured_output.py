"""The request vocabulary of structured outputs, logit_bias and prompt_logprobs: cheap checks
the router runs without the grammar engine, and the wire form."""

from __future__ import annotations

import json

import pytest

from pdserve.sampling_params import InvalidRequestError, SamplingParams
from pdserve.structured_output import (
    MAX_ENUM_VALUES,
    MAX_JSON_DEPTH,
    MAX_REPETITION_REACH,
    MAX_SPEC_BYTES,
    StructuredOutputKind,
    StructuredOutputParams,
    repetition_reach,
)
from pdserve.v1 import generation_pb2, node_pb2

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def nested_schema(depth: int) -> str:
    return '{"type":"object","properties":{"a":' * depth + '{"type":"integer"}' + "}}" * depth


@pytest.mark.parametrize(
    "params",
    [
        StructuredOutputParams.json_schema(SCHEMA),
        StructuredOutputParams.json_schema(True),
        StructuredOutputParams.json_object(),
        StructuredOutputParams.regex(r"\d{3}-\d{4}"),
        StructuredOutputParams.grammar('start: "a" | "b"\n'),
        StructuredOutputParams.choice(["yes", 'say "no"', "ünïcode"]),
    ],
    ids=lambda p: p.kind.value,
)
def test_round_trip_through_both_messages(params):
    sampling = SamplingParams(
        max_tokens=8,
        structured_output=params,
        prompt_logprobs=3,
        logit_bias={5: -100.0, 7: 2.5},
    )
    for message_type in (generation_pb2.SamplingParams, node_pb2.NodeSamplingParams):
        back = SamplingParams.from_proto(sampling.to_proto(message_type))
        assert back == sampling
        assert back.structured_output.digest == params.digest


def test_unset_fields_stay_unset_on_the_wire():
    message = SamplingParams().to_proto(node_pb2.NodeSamplingParams)
    assert not message.HasField("structured_output")
    assert not message.HasField("prompt_logprobs")
    assert not message.logit_bias
    params = SamplingParams.from_proto(message)
    assert (params.structured_output, params.prompt_logprobs, params.logit_bias) == (None, None, {})


def test_digest_tells_specs_apart():
    digests = {
        StructuredOutputParams.regex("a").digest,
        StructuredOutputParams.grammar("a").digest,
        StructuredOutputParams.choice(["a"]).digest,
        StructuredOutputParams.choice(["a", "b"]).digest,
        StructuredOutputParams.json_schema({"type": "string"}).digest,
    }
    assert len(digests) == 5
    assert StructuredOutputParams.regex("a").digest == StructuredOutputParams.regex("a").digest


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: StructuredOutputParams.json_schema(nested_schema(3000)), "deeper than"),
        (lambda: StructuredOutputParams.json_schema(nested_schema(MAX_JSON_DEPTH)), "deeper than"),
        (lambda: StructuredOutputParams.json_schema({"enum": list(range(5000))}), "enum/const"),
        (lambda: StructuredOutputParams.json_schema("x" * (MAX_SPEC_BYTES + 1)), "bytes"),
        (lambda: StructuredOutputParams.json_schema("{'type': 'object'"), "not valid JSON"),
        (lambda: StructuredOutputParams.json_schema("[1, 2]"), "object or a boolean"),
        (lambda: StructuredOutputParams.json_schema({"pattern": "(a{100}){101}"}), "pattern"),
        (lambda: StructuredOutputParams.regex("((x{1000}){1000}){1000}"), "repetitions"),
        (lambda: StructuredOutputParams.regex("  "), "empty"),
        (lambda: StructuredOutputParams.grammar("start: x{20000}\n"), "repetitions"),
        (lambda: StructuredOutputParams.choice([]), "at least one"),
        (lambda: StructuredOutputParams.choice(["ok", ""]), "non-empty"),
        (lambda: StructuredOutputParams.choice(["x"] * (MAX_ENUM_VALUES + 1)), "choices"),
        (lambda: StructuredOutputParams("json_object", "{}"), "no spec"),
        (lambda: StructuredOutputParams("regex", "a", ("b",)), "choices are for"),
        (lambda: StructuredOutputParams("xml", "<a/>"), "kind must be one of"),
    ],
)
def test_obviously_bad_specs_are_refused_without_the_grammar_engine(make, words):
    with pytest.raises(InvalidRequestError, match=words) as refused:
        make()
    assert refused.value.param == "structured_output"


def test_bounded_specs_pass():
    StructuredOutputParams.json_schema(nested_schema(MAX_JSON_DEPTH // 3 - 1))
    StructuredOutputParams.json_schema({"enum": list(range(MAX_ENUM_VALUES))})
    StructuredOutputParams.json_schema({"type": "string", "maxLength": 10**7})  # bounds: lazy
    StructuredOutputParams.regex("(a{100}){100}")
    StructuredOutputParams.regex(f"a{{{MAX_REPETITION_REACH}}}")


@pytest.mark.parametrize(
    ("pattern", "reach"),
    [
        ("abc", 1),
        ("a{5}", 5),
        ("a{2,7}b{3}", 7),
        ("(a{2}|b{3}){4}", 12),
        ("((x{10}){10}){10}", 1000),
        ("[{]{5}", 5),  # a class is one atom
        (r"\{3}", 1),  # an escape is one atom (then a literal "3}")
        ("a{3,}", 3),  # unbounded: a loop, counted at its lower bound
        ("[a-z]{1,8}(, [a-z]{1,8}){0,3}", 24),
    ],
)
def test_repetition_reach(pattern, reach):
    assert repetition_reach(pattern) == reach


def test_unset_kind_on_the_wire_is_refused():
    message = node_pb2.NodeSamplingParams(structured_output=generation_pb2.StructuredOutput())
    with pytest.raises(InvalidRequestError, match="kind is unset"):
        SamplingParams.from_proto(message)


def test_kinds_match_the_proto_enum():
    names = {
        v.name.removeprefix("STRUCTURED_OUTPUT_KIND_").lower()
        for v in generation_pb2.StructuredOutputKind.DESCRIPTOR.values
        if v.number
    }
    assert names == {k.value for k in StructuredOutputKind}


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"logit_bias": {1: 100.5}}, "logit_bias"),
        ({"logit_bias": {1: float("nan")}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {True: 1.0}}, "logit_bias"),
        ({"logit_bias": {i: 1.0 for i in range(1025)}}, "logit_bias"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"structured_output": json.dumps(SCHEMA)}, "structured_output"),
    ],
)
def test_bad_logit_bias_and_prompt_logprobs(kwargs, param):
    with pytest.raises(InvalidRequestError) as refused:
        SamplingParams(**kwargs)
    assert refused.value.param == param
