"""The node launchers' main, shared by pd-prefill and pd-decode.

```
run_node(PrefillServer | DecodeServer, argv), e.g.
    pd-prefill --model smollm2-135m --port 50061 --kv-transport tcp --kv-port 5600:
    flags (pdserve.cli.build_parser(role)) ──► EngineConfig + NodeConfig (bad: exit 2)
    "loading MODEL" logged; EngineCore built off the event loop (signals stay handled while
    the model loads; conversion and weight loading log their progress); with
    --tensor-parallel-size N its other ranks each run the role's rank agent (build_core)
    ──► the role's server started ──► "pd-<role> listening on HOST:PORT (kv ADDRESS)"
    ──► a port that cannot be bound (taken; a killed node's ucx port not released yet):
        retried every 0.5 s for --bind-retry-s, then exit 1 with the message
    ──► served until SIGINT/SIGTERM (pdserve.lifecycle); exit 1 with a message when it
        cannot start (a taken port, an unknown model) or cannot go on (a TP rank died)
```
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import time
from collections.abc import Callable, Sequence

from engine.engine_core import EngineCore
from node_common.node_base import NodeBase
from node_common.tp.rank_worker import start_rank
from pdserve.cli import build_parser, engine_config, node_config, setup_logging
from pdserve.config import EngineConfig, NodeConfig
from pdserve.lifecycle import run_server
from pdserve.security import OPEN_CLUSTER, load_cluster_auth

logger = logging.getLogger(__name__)

_BIND_RETRY_INTERVAL_S = 0.5


def build_node_parser(server_cls: type[NodeBase]) -> argparse.ArgumentParser:
    """The flags of `server_cls`'s launcher (pd-prefill or pd-decode)."""
    role = _role(server_cls)
    description = (
        f"Serve one {role} node. Prints 'pd-{role} listening on HOST:PORT (kv ADDRESS)' once "
        "serving; SIGINT/SIGTERM stop it gracefully (exit 0)."
    )
    return build_parser(role, description=description)


def run_node(server_cls: type[NodeBase], argv: Sequence[str] | None = None) -> int:
    """Parse the flags, then serve one node of `server_cls` until signalled; the exit code."""
    parser = build_node_parser(server_cls)
    args = parser.parse_args(argv)
    try:
        engine = engine_config(args, prefill_only=server_cls.prefill_only)
        node = node_config(args)
        auth = load_cluster_auth(node.security)
    except ValueError as error:
        parser.error(str(error))
    role = _role(server_cls)
    setup_logging(args, role)
    name = f"pd-{role}"

    async def start() -> NodeBase:
        logger.info("loading model %s on %s", engine.model.model, engine.model.device)
        core = await asyncio.to_thread(build_core, server_cls, engine, node)
        server = await start_with_bind_retry(lambda: server_cls(core, node), node.bind_retry_s)
        caveats = [OPEN_CLUSTER] if auth is None else []
        caveats += [server.manager.transport_caveat] if server.manager.transport_caveat else []
        if caveats:  # one line, however many
            logger.warning("%s: %s; README.md, 'Security', says how to close it", name,
                           "; ".join(caveats))  # fmt: skip
        return server

    return run_server(name, start, lambda s: _ready_line(name, s))


def build_core(server_cls: type[NodeBase], engine: EngineConfig, node: NodeConfig) -> EngineCore:
    """The node's EngineCore; with tensor parallelism each other rank also runs the role's
    part (its KV transport and hand-offs: node_common/tp/rank_worker.py)."""
    if engine.parallel.tensor_parallel_size == 1:
        return EngineCore(engine)
    worker_init = functools.partial(start_rank, config=node, agent_type=server_cls.rank_agent)
    return EngineCore(engine, worker_init=worker_init)


def _ready_line(name: str, server: NodeBase) -> str:
    metrics = f", metrics {server.metrics.url}" if server.metrics.url else ""
    return f"{name} listening on {server.address} (kv {server.kv_address}{metrics})"


async def start_with_bind_retry(make_server: Callable[[], NodeBase], retry_s: float) -> NodeBase:
    """Builds and starts a server (which binds its gRPC and KV ports), again every
    `_BIND_RETRY_INTERVAL_S` while a port cannot be bound, for up to `retry_s`; then raises
    the OSError (the launcher exits 1 with its message)."""
    deadline = time.monotonic() + retry_s
    while True:
        server = None
        try:
            server = make_server()
            await server.start()
            return server
        except OSError as error:
            if server is not None:
                await server.stop(grace_s=0)
            if time.monotonic() + _BIND_RETRY_INTERVAL_S > deadline:
                raise OSError(f"{error} (gave up after retrying for {retry_s} s)") from None
            logger.warning("%s; retrying in %s s", error, _BIND_RETRY_INTERVAL_S)
            await asyncio.sleep(_BIND_RETRY_INTERVAL_S)
        except BaseException:
            if server is not None:
                await server.stop(grace_s=0)
            raise


def _role(server_cls: type[NodeBase]) -> str:
    return "prefill" if server_cls.prefill_only else "decode"
