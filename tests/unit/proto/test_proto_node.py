"""node.proto: node sampling params, the Decode/Prefill stream shapes, and the three services."""

from __future__ import annotations

import grpc
import pytest

from pdserve.v1 import generation_pb2, node_pb2, node_pb2_grpc

SERVER_STREAMING = {
    "Node": {"WatchKVEvents"},
    "PrefillNode": {"Prefill"},
    "DecodeNode": {"Decode"},
}


def test_node_sampling_params_are_sampling_params_without_stop_strings() -> None:
    client_fields = {
        f.name: (f.number, f.type, f.has_presence)
        for f in generation_pb2.SamplingParams.DESCRIPTOR.fields
    }
    node_fields = {
        f.name: (f.number, f.type, f.has_presence)
        for f in node_pb2.NodeSamplingParams.DESCRIPTOR.fields
    }

    assert node_fields == {name: v for name, v in client_fields.items() if name != "stop"}


def test_client_sampling_params_copy_to_node_params_over_the_wire(fill) -> None:
    client = fill(generation_pb2.SamplingParams)
    client.ClearField("stop")

    node = node_pb2.NodeSamplingParams.FromString(client.SerializeToString())

    assert [f.name for f, _ in node.ListFields()] == [f.name for f, _ in client.ListFields()]
    assert node.SerializeToString(deterministic=True) == client.SerializeToString(
        deterministic=True
    )


@pytest.mark.parametrize(
    ("response", "kind"),
    [
        (node_pb2.DecodeResponse(ticket=node_pb2.TransferTicket(transfer_id="t")), "ticket"),
        (node_pb2.DecodeResponse(tokens=node_pb2.TokenChunk(token_ids=[4])), "tokens"),
        (
            node_pb2.PrefillResponse(first_token=node_pb2.PrefillFirstToken(token_id=4)),
            "first_token",
        ),
        (
            node_pb2.PrefillResponse(transfer_result=node_pb2.PrefillTransferResult(ok=True)),
            "transfer_result",
        ),
    ],
)
def test_stream_messages_say_which_kind_they_are(response, kind: str) -> None:
    parsed = type(response).FromString(response.SerializeToString())

    assert parsed.WhichOneof("kind") == kind


def test_only_prefill_decode_and_kv_events_are_server_streams() -> None:
    services = node_pb2.DESCRIPTOR.services_by_name
    assert set(services) == set(SERVER_STREAMING)
    for name, streaming in SERVER_STREAMING.items():
        methods = services[name].methods
        assert {m.name for m in methods if m.server_streaming} == streaming
        assert not any(m.client_streaming for m in methods)


class _FakeNode(node_pb2_grpc.NodeServicer):
    def GetNodeInfo(self, request, context):
        return node_pb2.NodeInfo(role=node_pb2.NODE_ROLE_PREFILL, layout_hash="abc")


class _FakePrefillNode(node_pb2_grpc.PrefillNodeServicer):
    """Sends the first token, then reports the transfer to the ticket's address as done."""

    def Prefill(self, request, context):
        yield node_pb2.PrefillResponse(
            first_token=node_pb2.PrefillFirstToken(token_id=request.prompt_token_ids[-1] + 1)
        )
        yield node_pb2.PrefillResponse(
            transfer_result=node_pb2.PrefillTransferResult(ok=True, num_bytes=1024)
        )


def test_a_prefill_node_serves_node_and_prefill_but_not_decode(serve) -> None:
    channel = serve(
        (node_pb2_grpc.add_NodeServicer_to_server, _FakeNode()),
        (node_pb2_grpc.add_PrefillNodeServicer_to_server, _FakePrefillNode()),
    )
    ticket = node_pb2.TransferTicket(transfer_id="t1", dst_block_ids=[3, 9], num_tokens=20)
    request = node_pb2.PrefillRequest(request_id="r1", prompt_token_ids=[7, 8], ticket=ticket)

    info = node_pb2_grpc.NodeStub(channel).GetNodeInfo(node_pb2.GetNodeInfoRequest(), timeout=10)
    responses = list(node_pb2_grpc.PrefillNodeStub(channel).Prefill(request, timeout=10))
    with pytest.raises(grpc.RpcError) as error:
        list(node_pb2_grpc.DecodeNodeStub(channel).Decode(node_pb2.DecodeRequest(), timeout=10))

    assert info.role == node_pb2.NODE_ROLE_PREFILL
    assert [r.WhichOneof("kind") for r in responses] == ["first_token", "transfer_result"]
    assert responses[0].first_token.token_id == 9
    assert responses[1].transfer_result.num_bytes == 1024
    assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_int_field_range_reads_the_protobuf_type() -> None:
    from pdserve.sampling_params import int_field_range

    assert int_field_range(generation_pb2.SamplingParams, "max_tokens") == (0, 2**32 - 1)
    assert int_field_range(generation_pb2.SamplingParams, "top_k") == (-(2**31), 2**31 - 1)
    assert int_field_range(generation_pb2.SamplingParams, "seed") == (0, 2**64 - 1)
    assert int_field_range(node_pb2.NodeSamplingParams, "stop_token_ids") == (0, 2**32 - 1)
