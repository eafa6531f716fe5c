"""generation.proto: the client API's input oneof, optional sampling fields, and the service."""

from __future__ import annotations

import pytest

from pdserve.v1 import generation_pb2, generation_pb2_grpc

# Fields where 0 is a real value or unset means "engine default": proto3 `optional`.
OPTIONAL_SAMPLING_FIELDS = {
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "speculative",  # unset: true
}


def test_exactly_the_defaulted_sampling_fields_track_presence() -> None:
    fields = generation_pb2.SamplingParams.DESCRIPTOR.fields
    scalars = [f for f in fields if f.message_type is None]  # a message field always has one
    assert {f.name for f in scalars if f.has_presence} == OPTIONAL_SAMPLING_FIELDS


@pytest.mark.parametrize("name", sorted(OPTIONAL_SAMPLING_FIELDS))
def test_optional_sampling_field_distinguishes_unset_from_zero(name: str) -> None:
    unset = generation_pb2.SamplingParams.FromString(b"")
    zero = generation_pb2.SamplingParams(**{name: 0})

    parsed = generation_pb2.SamplingParams.FromString(zero.SerializeToString())

    assert not unset.HasField(name)
    assert parsed.HasField(name)
    assert getattr(parsed, name) == 0


def test_sampling_floats_keep_their_python_value() -> None:
    params = generation_pb2.SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05)

    parsed = generation_pb2.SamplingParams.FromString(params.SerializeToString())

    assert (parsed.temperature, parsed.top_p, parsed.min_p) == (0.7, 0.9, 0.05)


def test_input_is_one_of_prompt_token_ids_or_messages() -> None:
    request = generation_pb2.GenerateRequest(prompt="hello")
    request.prompt_token_ids.ids.extend([1, 2, 3])

    parsed = generation_pb2.GenerateRequest.FromString(request.SerializeToString())

    assert parsed.WhichOneof("input") == "prompt_token_ids"
    assert parsed.prompt == ""
    assert list(parsed.prompt_token_ids.ids) == [1, 2, 3]
    chat = generation_pb2.GenerateRequest(
        messages=generation_pb2.ChatMessages(
            messages=[generation_pb2.ChatMessage(role="user", content="hi")]
        )
    )
    assert chat.WhichOneof("input") == "messages"
    assert generation_pb2.GenerateRequest().WhichOneof("input") is None


def test_token_ids_reject_negative_values() -> None:
    with pytest.raises(ValueError):
        generation_pb2.TokenIds(ids=[-1])


class _FakeGeneration(generation_pb2_grpc.GenerationServicer):
    """Echoes the prompt's token ids back, one per chunk, then finishes."""

    def Generate(self, request, context):
        token_ids = list(request.prompt_token_ids.ids)
        for token_id in token_ids[:-1]:
            yield generation_pb2.GenerateResponse(
                request_id=request.request_id, token_ids=[token_id]
            )
        usage = generation_pb2.Usage(prompt_tokens=len(token_ids), completion_tokens=len(token_ids))
        yield generation_pb2.GenerateResponse(
            request_id=request.request_id,
            token_ids=token_ids[-1:],
            finish_reason="length",
            usage=usage,
        )

    def GetModelInfo(self, request, context):
        return generation_pb2.ModelInfo(
            model_name="tiny", max_model_len=512, vocab_size=1000, eos_token_ids=[2]
        )


def test_generate_streams_chunks_over_grpc(serve) -> None:
    channel = serve((generation_pb2_grpc.add_GenerationServicer_to_server, _FakeGeneration()))
    stub = generation_pb2_grpc.GenerationStub(channel)
    request = generation_pb2.GenerateRequest(
        request_id="r1", prompt_token_ids=generation_pb2.TokenIds(ids=[5, 6, 7])
    )

    chunks = list(stub.Generate(request, timeout=10))
    info = stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)

    assert [list(c.token_ids) for c in chunks] == [[5], [6], [7]]
    assert [c.finish_reason for c in chunks] == ["", "", "length"]
    assert [c.HasField("usage") for c in chunks] == [False, False, True]
    assert chunks[-1].usage.prompt_tokens == 3
    assert {c.request_id for c in chunks} == {"r1"}
    assert (info.model_name, list(info.eos_token_ids)) == ("tiny", [2])
