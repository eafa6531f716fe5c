"""Tools the fault tests share: a node's process by its gRPC port, RSS samples, client bursts
that record how every request ended (tokens, a clear status, or past its deadline)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
import psutil

from pdserve.config import RouterConfig
from router.client import GenerationClient, build_request
from router.server import RouterServer
from tests.e2e.cluster import Cluster
from tests.e2e.registry_cluster import eventually

# Statuses a client may get under faults: each says what happened and what to do.
CLEAR_CODES = frozenset(
    {
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.INVALID_ARGUMENT,
    }
)


@contextlib.asynccontextmanager
async def router_over(
    nodes, transfer_timeout_s: float
) -> AsyncIterator[tuple[RouterServer, GenerationClient]]:
    """A router in this process over one prefill and one decode node of node_harness's
    `running_nodes`, and a client of it; both closed on exit."""
    router = RouterServer(
        RouterConfig(
            port=0, http_port=0, grace_s=0.0, node_wait_s=10.0,
            prefill_addrs=(nodes.prefill.address,), decode_addrs=(nodes.decode.address,),
            transfer_timeout_s=transfer_timeout_s,
        )
    )  # fmt: skip
    await router.start()
    client = GenerationClient(router.address)
    try:
        yield router, client
    finally:
        await client.close()
        await router.stop()


async def wait_registered(router, num_prefill: int = 1, num_decode: int = 2) -> None:
    """Until the router's registry lists this many prefill and decode nodes (30 s at most)."""
    registry = router.registry
    await eventually(
        lambda: (
            len(registry.prefill_nodes) == num_prefill and len(registry.decode_nodes) == num_decode
        ),
        30,
    )


def node_process(cluster: Cluster, name: str) -> psutil.Process:
    """The process of node `name` (e.g. "decode-1"): the pd-serve child listening on its port."""
    port = int(cluster.nodes[name].rsplit(":", 1)[1])
    for child in psutil.Process(cluster.process.pid).children(recursive=True):
        try:
            connections = child.net_connections(kind="tcp")
        except psutil.Error:
            continue
        if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in connections):
            return child
    raise LookupError(f"no process listens on {cluster.nodes[name]}")


def rss_mib(process: psutil.Process) -> float:
    return process.memory_info().rss / 2**20


@dataclass
class Outcome:
    """How one client request ended."""

    num_tokens: int = 0
    finish_reason: str = ""
    code: grpc.StatusCode | None = None  # None: finished OK
    details: str = ""
    elapsed_s: float = 0.0
    token_ids: list[int] = field(default_factory=list)


async def run_one(
    client: GenerationClient,
    timeout_s: float,
    cancel_after_s: float | None = None,
    on_chunk: Callable[[Outcome], None] | None = None,
    **request_fields,
) -> Outcome:
    """One request; cancelled by the client after `cancel_after_s` when given; `on_chunk`
    sees the outcome so far after every chunk (a fault test strikes from there)."""
    outcome = Outcome()
    start = time.monotonic()

    async def consume() -> None:
        async for chunk in client.stream(build_request(**request_fields), timeout_s):
            outcome.token_ids.extend(chunk.token_ids)
            if chunk.finish_reason:
                outcome.finish_reason = chunk.finish_reason
            if on_chunk is not None:
                on_chunk(outcome)

    try:
        if cancel_after_s is None:
            await consume()
        else:
            try:
                await asyncio.wait_for(consume(), cancel_after_s)
            except TimeoutError:
                outcome.code = grpc.StatusCode.CANCELLED
                outcome.details = "cancelled by the client"
    except grpc.aio.AioRpcError as error:
        outcome.code, outcome.details = error.code(), error.details() or ""
    outcome.num_tokens = len(outcome.token_ids)
    outcome.elapsed_s = time.monotonic() - start
    return outcome


def summarize(outcomes: list[Outcome]) -> dict[str, int]:
    """Counts for the fault table: sent, completed, clear errors, other errors, hung."""
    codes = Counter(o.code for o in outcomes)
    return {
        "sent": len(outcomes),
        "completed": codes[None],
        "clear_errors": sum(n for c, n in codes.items() if c in CLEAR_CODES),
        "other_errors": sum(n for c, n in codes.items() if c is not None and c not in CLEAR_CODES),
        "hung": codes[grpc.StatusCode.DEADLINE_EXCEEDED],
    }


def free_blocks_settled(cluster, names: list[str], timeout_s: float = 30.0) -> dict:
    """Per node: (free, total) once every named node's pool is entirely free, or at timeout.
    `cluster`: a RegistryCluster (`stats`) or a Cluster (`node_stats`)."""
    get_stats = getattr(cluster, "node_stats", None) or cluster.stats
    deadline = time.monotonic() + timeout_s
    while True:
        stats = {name: get_stats(name) for name in names}
        if all(s.num_free_kv_blocks == s.num_kv_blocks for s in stats.values()):
            break
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return {n: (s.num_free_kv_blocks, s.num_kv_blocks) for n, s in stats.items()}


def prompts(num: int, seed: int, min_len: int = 8, max_len: int = 60) -> list[list[int]]:
    """`num` seeded random token-id prompts (ids in [3, 512): the tiny model's, no specials)."""
    rng = random.Random(seed)
    return [
        [rng.randrange(3, 512) for _ in range(rng.randint(min_len, max_len))] for _ in range(num)
    ]


async def burst(
    client: GenerationClient,
    prompt_ids: list[list[int]],
    timeout_s: float,
    max_tokens: int = 16,
    cancel_after_s: list[float | None] | None = None,
    on_chunk: Callable[[Outcome], None] | None = None,
) -> list[Outcome]:
    """Every prompt at once (greedy, ignore_eos); how each request ended."""
    cancels = cancel_after_s or [None] * len(prompt_ids)
    return await asyncio.gather(
        *(
            run_one(
                client,
                timeout_s,
                cancel,
                on_chunk,
                prompt_token_ids=ids,
                max_tokens=max_tokens,
                temperature=0.0,
                ignore_eos=True,
            )  # fmt: skip
            for ids, cancel in zip(prompt_ids, cancels, strict=True)
        )
    )
