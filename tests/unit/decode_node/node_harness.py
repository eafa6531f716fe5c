"""In-process prefill and decode nodes on loopback, and a test client that plays the router.

Used by tests/unit/decode_node, tests/unit/prefill_node and tests/e2e (import it as
`tests.unit.decode_node.node_harness`). Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from decode_node.decode_server import DecodeServer
from engine.engine_core import EngineCore
from pdserve.config import CacheConfig, EngineConfig, ModelConfig, NodeConfig, SchedulerConfig
from pdserve.v1 import node_pb2, node_pb2_grpc
from prefill_node.prefill_server import PrefillServer
from tests.unit.decode_node.node_process import LAUNCH_TIMEOUT_S as LAUNCH_TIMEOUT_S
from tests.unit.decode_node.node_process import NodeProcess as NodeProcess
from tests.unit.decode_node.raw_peer import RawPeer as RawPeer  # re-exported for the tests
from tests.waiting import wait_until as wait_until  # re-exported for the tests

MODEL = "synthetic:tiny-llama"  # 2 layers, vocab 512, eos 2
BLOCK_SIZE = 4
NUM_BLOCKS = 64
TRANSPORTS = ("local", "tcp")
RPC_TIMEOUT_S = 10.0
FREE_WITHIN_S = 1.0  # after a request ends, its node's blocks are all free again within this

GREEDY = node_pb2.NodeSamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, seed=7)


def run(coro: Coroutine[Any, Any, Any], timeout_s: float = 60.0) -> Any:
    """Run a test coroutine on a fresh event loop, bounded by `timeout_s`."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def engine_config(
    prefill_only: bool,
    *,
    model: str = MODEL,
    num_blocks: int = NUM_BLOCKS,
    max_num_batched_tokens: int = 2048,
    dtype: str = "float32",
) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=model, device="cpu", dtype=dtype),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks),
        scheduler=SchedulerConfig(
            prefill_only=prefill_only, max_num_batched_tokens=max_num_batched_tokens
        ),
    )


def prompt(length: int, seed: int = 0) -> list[int]:
    """Token ids in [3, 512): no special ids, so EOS never shows up in a prompt."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (length,), generator=gen).tolist()


@dataclass
class Nodes:
    """A started prefill node and decode node, and stubs for both."""

    prefill: PrefillServer
    decode: DecodeServer
    channels: list[grpc.aio.Channel] = field(default_factory=list)

    def __post_init__(self) -> None:
        prefill_channel = grpc.aio.insecure_channel(self.prefill.address)
        decode_channel = grpc.aio.insecure_channel(self.decode.address)
        self.channels = [prefill_channel, decode_channel]
        self.prefill_stub = node_pb2_grpc.PrefillNodeStub(prefill_channel)
        self.prefill_node_stub = node_pb2_grpc.NodeStub(prefill_channel)
        self.decode_stub = node_pb2_grpc.DecodeNodeStub(decode_channel)
        self.decode_node_stub = node_pb2_grpc.NodeStub(decode_channel)

    async def stats(self) -> tuple[node_pb2.NodeStats, node_pb2.NodeStats]:
        """(prefill, decode) NodeStats."""
        request = node_pb2.GetStatsRequest()
        return (
            await self.prefill_node_stub.GetStats(request, timeout=RPC_TIMEOUT_S),
            await self.decode_node_stub.GetStats(request, timeout=RPC_TIMEOUT_S),
        )

    async def assert_all_free(self, within_s: float = FREE_WITHIN_S) -> None:
        """Within `within_s`, both pools are whole again and no transfer is pending."""

        def whole(stats: node_pb2.NodeStats) -> bool:
            return (
                stats.num_free_kv_blocks == stats.num_kv_blocks
                and stats.num_pending_transfers == 0
                and stats.num_running_requests == 0
                and stats.num_waiting_requests == 0
            )

        async with asyncio.timeout(within_s):
            while not all(whole(s) for s in await self.stats()):
                await asyncio.sleep(0.01)
        for server in (self.prefill, self.decode):
            await server.engine.check_no_leaks()


@contextlib.asynccontextmanager
async def running_nodes(
    transport: str = "local",
    *,
    prefill_engine: EngineConfig | None = None,
    decode_engine: EngineConfig | None = None,
    transfer_timeout_s: float = 10.0,
    check_free: bool = True,
    **node_config: Any,
) -> AsyncIterator[Nodes]:
    """Start a prefill node and a decode node on 127.0.0.1 (free ports) sharing `transport`;
    on a clean exit assert both pools are whole again; always stop both."""
    config = NodeConfig(
        kv_transport=transport, transfer_timeout_s=transfer_timeout_s, **node_config
    )
    prefill_core = EngineCore(prefill_engine or engine_config(prefill_only=True))
    decode_core = EngineCore(decode_engine or engine_config(prefill_only=False))
    prefill = PrefillServer(prefill_core, config)
    decode = DecodeServer(decode_core, config)
    nodes: Nodes | None = None
    try:
        await prefill.start()
        await decode.start()
        nodes = Nodes(prefill, decode)
        yield nodes
        if check_free:
            await nodes.assert_all_free()
    finally:
        for channel in nodes.channels if nodes else ():
            await channel.close()
        await prefill.stop(grace_s=0)
        await decode.stop(grace_s=0)


def decode_request(
    request_id: str,
    prompt_token_ids: list[int],
    sampling: node_pb2.NodeSamplingParams = GREEDY,
    *,
    disaggregated: bool = True,
    transfer_timeout_s: float = 0.0,
) -> node_pb2.DecodeRequest:
    mode = (
        node_pb2.DECODE_MODE_DISAGGREGATED if disaggregated else node_pb2.DECODE_MODE_LOCAL_PREFILL
    )
    return node_pb2.DecodeRequest(
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        sampling=sampling,
        mode=mode,
        transfer_timeout_s=transfer_timeout_s,
    )


async def read_ticket(
    call: grpc.aio.UnaryStreamCall, timeout_s: float = RPC_TIMEOUT_S
) -> node_pb2.TransferTicket:
    message = await asyncio.wait_for(call.read(), timeout_s)
    assert message.WhichOneof("kind") == "ticket", message
    return message.ticket


async def read_chunks(
    call: grpc.aio.UnaryStreamCall, timeout_s: float = RPC_TIMEOUT_S
) -> list[node_pb2.TokenChunk]:
    """Every TokenChunk of a Decode stream up to the one with a finish_reason (each waited for
    at most `timeout_s`)."""
    chunks = []
    while True:
        message = await asyncio.wait_for(call.read(), timeout_s)
        assert message is not grpc.aio.EOF, f"the stream ended after {chunks}"
        assert message.WhichOneof("kind") == "tokens", message
        chunks.append(message.tokens)
        if message.tokens.finish_reason:
            return chunks


def tokens_of(chunks: list[node_pb2.TokenChunk]) -> list[int]:
    """The output token ids of a chunk list, checking the chunks cover indices 0, 1, ..."""
    token_ids: list[int] = []
    for chunk in chunks:
        assert chunk.output_index == len(token_ids), [c.output_index for c in chunks]
        token_ids.extend(chunk.token_ids)
    return token_ids


async def read_prefill(
    call: grpc.aio.UnaryStreamCall, timeout_s: float = RPC_TIMEOUT_S
) -> list[node_pb2.PrefillResponse]:
    """Both messages of a Prefill stream (first token, transfer result), then its end."""
    messages = [await asyncio.wait_for(call.read(), timeout_s) for _ in range(2)]
    assert [m.WhichOneof("kind") for m in messages] == ["first_token", "transfer_result"]
    assert await asyncio.wait_for(call.read(), timeout_s) is grpc.aio.EOF
    return messages


@dataclass
class Handoff:
    """What a router sees of one disaggregated request."""

    ticket: node_pb2.TransferTicket
    first_token: node_pb2.PrefillFirstToken
    transfer_result: node_pb2.PrefillTransferResult
    chunks: list[node_pb2.TokenChunk]

    @property
    def token_ids(self) -> list[int]:
        return tokens_of(self.chunks)


async def run_disaggregated(
    nodes: Nodes,
    request_id: str,
    prompt_token_ids: list[int],
    sampling: node_pb2.NodeSamplingParams = GREEDY,
    timeout_s: float = RPC_TIMEOUT_S,
) -> Handoff:
    """Play the router: Decode -> ticket -> Prefill -> first token; then D's stream. Both
    calls' deadline: `timeout_s` (a whole prefill and decode of the request must fit it)."""
    decode_call = nodes.decode_stub.Decode(
        decode_request(request_id, prompt_token_ids, sampling), timeout=timeout_s
    )
    ticket = await read_ticket(decode_call, timeout_s)
    prefill_call = nodes.prefill_stub.Prefill(
        node_pb2.PrefillRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling=sampling,
            ticket=ticket,
        ),
        timeout=timeout_s,
    )
    first, result = await read_prefill(prefill_call, timeout_s)
    chunks = await read_chunks(decode_call, timeout_s)
    return Handoff(ticket, first.first_token, result.transfer_result, chunks)


async def run_local(
    nodes: Nodes,
    request_id: str,
    prompt_token_ids: list[int],
    sampling: node_pb2.NodeSamplingParams = GREEDY,
    timeout_s: float = RPC_TIMEOUT_S,
) -> list[int]:
    """A LOCAL_PREFILL request on the decode node (deadline `timeout_s`); its output ids."""
    call = nodes.decode_stub.Decode(
        decode_request(request_id, prompt_token_ids, sampling, disaggregated=False),
        timeout=timeout_s,
    )
    return tokens_of(await read_chunks(call, timeout_s))


@dataclass
class SecondTurn:
    """A conversation's second turn opened on the decode node (`open_second_turn`)."""

    answer: list[int]  # turn 1's output
    prompt: list[int]  # turn 1 + its answer + the new tokens
    call: grpc.aio.UnaryStreamCall  # turn 2's Decode, its ticket read
    ticket: node_pb2.TransferTicket


async def open_second_turn(
    nodes: Nodes, turn_1: list[int], new_tokens: list[int], request_id: str = "turn-2"
) -> SecondTurn:
    """Turn 1 prefilled and decoded on the decode node, then turn 2's DISAGGREGATED Decode
    opened there and its ticket read: the ticket says how many leading blocks D holds."""
    answer = await run_local(nodes, "turn-1", turn_1)
    turn_2 = turn_1 + answer + new_tokens
    call = nodes.decode_stub.Decode(
        decode_request(request_id, turn_2, transfer_timeout_s=60.0), timeout=RPC_TIMEOUT_S
    )
    return SecondTurn(answer, turn_2, call, await read_ticket(call))
