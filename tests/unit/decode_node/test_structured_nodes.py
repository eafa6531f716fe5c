"""Structured outputs through both node servers (the default model, its real tokenizer, CPU):
a prefill -> decode hand-off, a local prefill and a migration give the same constrained
tokens, greedy and seeded; a refused spec ends either role's call INVALID_ARGUMENT, too many
compiles RESOURCE_EXHAUSTED; prompt logprobs travel with the first token."""

from __future__ import annotations

import asyncio
import json

import grpc
import jsonschema
import pytest

from engine.structured import StructuredOutputBusyError
from pdserve.structured_output import StructuredOutputParams
from pdserve.tokenizer import Tokenizer
from pdserve.v1 import node_pb2
from tests.unit.decode_node.node_harness import (
    RPC_TIMEOUT_S,
    decode_request,
    engine_config,
    read_chunks,
    run,
    run_disaggregated,
    running_nodes,
    tokens_of,
)
from tests.unit.engine.structured.conftest import corpus

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "smollm2-135m"
SCHEMAS = ("person", "enum_color")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    from engine.model.sources import resolve_model_source

    tokenizer_dir = resolve_model_source(MODEL).tokenizer_dir
    assert tokenizer_dir is not None
    return Tokenizer.from_dir(tokenizer_dir)


def config(prefill_only: bool):
    return engine_config(prefill_only, model=MODEL, num_blocks=256)


def sampling(spec: StructuredOutputParams, greedy: bool, **extra) -> node_pb2.NodeSamplingParams:
    message = node_pb2.NodeSamplingParams(
        max_tokens=80, temperature=0.0 if greedy else 0.8, seed=1234, **extra
    )
    message.structured_output.CopyFrom(spec.to_proto())
    return message


def prompt_ids(tokenizer: Tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Reply with JSON."}])
    return tokenizer.encode(text, add_special_tokens=False)


async def local(nodes, request_id, prompt, params, migrated=()) -> list[node_pb2.TokenChunk]:
    request = decode_request(request_id, prompt, params, disaggregated=False)
    request.output_token_ids.extend(migrated)
    call = nodes.decode_stub.Decode(request, timeout=RPC_TIMEOUT_S * 3)
    return await read_chunks(call)


def test_handoff_local_and_migration_agree(tokenizer) -> None:
    prompt = prompt_ids(tokenizer)

    async def main() -> None:
        async with running_nodes(prefill_engine=config(True), decode_engine=config(False)) as nodes:
            for name in SCHEMAS:
                schema = corpus()["json_schemas"][name]
                for greedy in (True, False):
                    params = sampling(StructuredOutputParams.json_schema(schema), greedy)
                    rid = f"{name}-{greedy}"
                    handoff = await run_disaggregated(nodes, f"pd-{rid}", prompt, params)
                    chunks = await local(nodes, f"local-{rid}", prompt, params)
                    assert handoff.transfer_result.ok
                    assert handoff.token_ids == tokens_of(chunks), rid
                    assert chunks[-1].finish_reason == "stop", rid
                    text = tokenizer.decode(tokens_of(chunks), skip_special_tokens=True)
                    jsonschema.validate(json.loads(text), schema)
                    # a migration: the matcher is rebuilt from the tokens streamed so far
                    done = tokens_of(chunks)[: min(5, len(tokens_of(chunks)) - 1)]
                    rest = await local(nodes, f"mig-{rid}", prompt, params, done)
                    assert rest[0].output_index == len(done)
                    assert done + [t for c in rest for t in c.token_ids] == tokens_of(chunks)

    run(main(), timeout_s=280)


def refused_spec() -> node_pb2.NodeSamplingParams:
    """Passes the cheap checks; the grammar library refuses it (an unknown $ref)."""
    return sampling(StructuredOutputParams.json_schema({"$ref": "#/$defs/nothing"}), True)


def test_refused_spec_is_invalid_argument_on_both_roles(tokenizer) -> None:
    prompt = prompt_ids(tokenizer)

    async def main() -> None:
        async with running_nodes(prefill_engine=config(True), decode_engine=config(False)) as nodes:
            for disaggregated in (True, False):
                call = nodes.decode_stub.Decode(
                    decode_request(f"d{disaggregated}", prompt, refused_spec(),
                                   disaggregated=disaggregated),
                    timeout=RPC_TIMEOUT_S,
                )  # fmt: skip
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    async for _ in call:
                        pass
                assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "$ref" in error.value.details() or "nothing" in error.value.details()
            call = nodes.prefill_stub.Prefill(
                node_pb2.PrefillRequest(request_id="p", prompt_token_ids=prompt,
                                        sampling=refused_spec()),
                timeout=RPC_TIMEOUT_S,
            )  # fmt: skip
            with pytest.raises(grpc.aio.AioRpcError) as error:
                async for _ in call:
                    pass
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            await nodes.assert_all_free()

    run(main(), timeout_s=120)


def test_busy_compiler_is_resource_exhausted(tokenizer, monkeypatch) -> None:
    prompt = prompt_ids(tokenizer)

    async def busy(*args, **kwargs):
        raise StructuredOutputBusyError("64 grammars are compiling; retry later")

    async def main() -> None:
        async with running_nodes(prefill_engine=config(True), decode_engine=config(False)) as nodes:
            for server in (nodes.decode, nodes.prefill):
                monkeypatch.setattr(server.engine, "prepare_structured", busy)
            params = sampling(StructuredOutputParams.json_object(), True)
            calls = [
                nodes.decode_stub.Decode(
                    decode_request("d", prompt, params), timeout=RPC_TIMEOUT_S
                ),
                nodes.prefill_stub.Prefill(
                    node_pb2.PrefillRequest(
                        request_id="p", prompt_token_ids=prompt, sampling=params
                    ),
                    timeout=RPC_TIMEOUT_S,
                ),  # fmt: skip
            ]
            for call in calls:
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    async for _ in call:
                        pass
                assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "retry later" in error.value.details()
            await nodes.assert_all_free()

    run(main(), timeout_s=120)


def test_prompt_logprobs_travel_with_the_first_token(tokenizer) -> None:
    prompt = prompt_ids(tokenizer)
    params = node_pb2.NodeSamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2)

    async def main() -> None:
        async with running_nodes(prefill_engine=config(True), decode_engine=config(False)) as nodes:
            handoff = await run_disaggregated(nodes, "pd", prompt, params)
            chunks = await local(nodes, "local", prompt, params)
            remote = handoff.first_token.prompt_logprobs
            assert [lp.token_id for lp in remote] == prompt[1:]
            assert [lp.token_id for lp in chunks[0].prompt_logprobs] == prompt[1:]
            for a, b in zip(remote, chunks[0].prompt_logprobs):
                assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
                assert len(a.top) == 2
            assert all(not c.prompt_logprobs for c in handoff.chunks + chunks[1:])
            await asyncio.sleep(0)

    run(main(), timeout_s=120)
