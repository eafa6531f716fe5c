"""Issue 39, item 1 (regression): in a secured cluster (tcp), an observer of the prefill ->
decode KV wire captures the hand-off's opening messages (the handshake, its proof inside) and
replays them byte for byte from a connection of its own, followed by layers of zeros and a first
token of its choosing; the observer is also on the path, so the honest sender's later messages
reach the decode node only after the replay. Zero bytes of it land (the decode node hands the
attacker's connection no buffer), and the request's tokens equal those of the undisturbed run.

Real prefill and decode nodes and a real router in this process, tcp KV transport."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from cache_transfer import make_transport, protocol
from pdserve.config import RouterConfig, SecurityConfig
from pdserve.v1 import transfer_pb2
from router.client import GenerationClient
from router.server import RouterServer
from tests.unit.decode_node.node_harness import prompt, run, running_nodes, wait_until

pytestmark = pytest.mark.timeout(180)

PROMPT = prompt(23, seed=5)
MAX_TOKENS = 6


class Tap:
    """On the prefill node's KV path: records its messages up to the handshake, then holds
    every later one until `release()`."""

    def __init__(self, manager) -> None:
        transport = getattr(manager._transport, "inner", manager._transport)
        self.opening: list[bytes] = []  # the headers sent up to the handshake, as sent
        self.handshake = asyncio.Event()
        self._gate = asyncio.Event()
        real = transport.send_many

        async def send_many(peer_address: str, messages) -> None:
            if self.handshake.is_set():
                await self._gate.wait()
            await real(peer_address, messages)
            for header, _ in messages:
                if not self.handshake.is_set():
                    self.opening.append(bytes(header))
                    if protocol.kind_of(protocol.decode(bytes(header))) == "handshake":
                        self.handshake.set()

        transport.send_many = send_many

    def release(self) -> None:
        self._gate.set()


class Recorder:
    def prepare(self, peer_id: str, header: bytes, payload_bytes: int) -> torch.Tensor:
        return torch.empty(payload_bytes, dtype=torch.uint8)

    def complete(self, peer_id: str, header: bytes, payload: torch.Tensor | None) -> None:
        pass

    def abandon(self, peer_id: str, header: bytes, payload: torch.Tensor) -> None:
        pass


async def replay_and_forge(attacker, dst_address: str, opening: list[bytes], layout,
                           first_token: int) -> int:  # fmt: skip
    """The captured opening byte for byte, then zero layers and `first_token`, numbered as
    the handshake's successors; returns how many messages went out."""
    handshake = protocol.decode(opening[-1])
    num_tokens, num_blocks = handshake.handshake.num_tokens, handshake.handshake.num_blocks
    for header in opening:
        await attacker.send(dst_address, header)
    seq = 1
    for layer_idx in range(layout.num_layers):
        manifest = transfer_pb2.LayerManifest(
            layer_idx=layer_idx, block_offset=0, num_blocks=num_blocks,
            num_bytes=layout.layer_bytes(num_blocks), token_end=num_tokens,
        )  # fmt: skip
        zeros = torch.zeros(layout.layer_bytes(num_blocks), dtype=torch.uint8)
        header = protocol.encode(handshake.transfer_id, seq, layer_manifest=manifest)
        await attacker.send(dst_address, header, zeros)
        seq += 1
    token = transfer_pb2.FirstToken(token_id=first_token)
    await attacker.send(dst_address, protocol.encode(handshake.transfer_id, seq, first_token=token))
    return len(opening) + layout.num_layers + 1


class DecodeWatch:
    """What the decode node's transfer manager did with each peer's messages."""

    def __init__(self, manager) -> None:
        self.landed: list[str] = []  # peers given a buffer for a payload
        self.handled: list[str] = []  # peers whose message it handled
        real_prepare, real_complete = manager.prepare, manager.complete

        def prepare(peer_id: str, header: bytes, payload_bytes: int):
            buffer = real_prepare(peer_id, header, payload_bytes)
            self.handled.append(peer_id)
            if buffer is not None:
                self.landed.append(peer_id)
            return buffer

        def complete(peer_id: str, header: bytes, payload) -> None:
            real_complete(peer_id, header, payload)
            if payload is None:
                self.handled.append(peer_id)

        manager.prepare, manager.complete = prepare, complete


@contextlib.asynccontextmanager
async def routed(nodes, security: SecurityConfig) -> AsyncIterator[GenerationClient]:
    router = RouterServer(RouterConfig(
        host="127.0.0.1", port=0, http_port=0, node_wait_s=20, security=security,
        prefill_addrs=(nodes.prefill.address,), decode_addrs=(nodes.decode.address,),
    ))  # fmt: skip
    await router.start()
    try:
        async with GenerationClient(router.address) as client:
            yield client
    finally:
        await router.stop()


async def generate(client: GenerationClient) -> list[int]:
    result = await client.generate_all(prompt_token_ids=PROMPT, temperature=0.0,
                                       max_tokens=MAX_TOKENS, ignore_eos=True, timeout_s=60)  # fmt: skip
    return list(result.token_ids)


async def attacked_run(nodes, client: GenerationClient, attacker, watch: DecodeWatch,
                       forged: int) -> list[int]:  # fmt: skip
    """A request whose hand-off the attacker replays and forges while the tap holds the
    honest sender's layers back; its tokens."""
    tap = Tap(nodes.prefill.manager)
    attacked = asyncio.ensure_future(generate(client))
    await asyncio.wait_for(tap.handshake.wait(), 30)
    sent = await replay_and_forge(attacker, nodes.decode.manager.address, tap.opening,
                                  nodes.decode.layout, forged)  # fmt: skip
    me = attacker._routing_id.decode()  # the peer id the decode node sees
    await wait_until(lambda: watch.handled.count(me) >= sent, 20.0)
    tap.release()
    return await attacked


def test_a_replayed_handshake_with_forged_layers_lands_nothing(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("a-cluster-secret-0123456789abcdef\n")
    security = SecurityConfig(cluster_secret_file=str(secret))

    async def main() -> tuple[list[int], list[int], list[str], str]:
        async with running_nodes("tcp", security=security, check_free=False) as nodes:
            attacker = make_transport("tcp")
            attacker.start(Recorder())
            watch = DecodeWatch(nodes.decode.manager)
            try:
                async with routed(nodes, security) as client:
                    undisturbed = await generate(client)
                    forged = (undisturbed[0] + 1 - 3) % 500 + 3  # a first token of its choosing
                    tokens = await attacked_run(nodes, client, attacker, watch, forged)
                return undisturbed, tokens, watch.landed, attacker._routing_id.decode()
            finally:
                await attacker.close()
                for server in (nodes.prefill, nodes.decode):
                    await server.engine.check_no_leaks()

    undisturbed, tokens, landed, attacker_id = run(main(), timeout_s=150)
    assert attacker_id not in landed, "the decode node took forged KV bytes"
    assert tokens == undisturbed, (tokens, undisturbed)
