"""The node launchers' main, shared by pd-prefill and pd-decode.

```
run_node(PrefillServer | DecodeServer, argv), e.g.
    pd-prefill --model smollm2-135m --port 50061 --kv-transport tcp --kv-port 5600:
    flags (pdserve.cli.build_parser(role)) ──► EngineConfig + NodeConfig (bad: exit 2)
    EngineCore built off the event loop (signals stay handled while the model loads)
    ──► the role's server started ──► "pd-<role> listening on HOST:PORT (kv ADDRESS)"
    ──► served until SIGINT/SIGTERM (pdserve.lifecycle); exit 1 with a message when it
        cannot start (a taken port, an unknown model)
```
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Sequence

from engine.engine_core import EngineCore
from node_common.role_server import RoleServer
from pdserve.cli import build_parser, configure_logging, engine_config, node_config
from pdserve.lifecycle import run_server
from pdserve.security import load_cluster_auth, open_cluster_warning


def build_node_parser(server_cls: type[RoleServer]) -> argparse.ArgumentParser:
    """The flags of `server_cls`'s launcher (pd-prefill or pd-decode)."""
    role = _role(server_cls)
    description = (
        f"Serve one {role} node. Prints 'pd-{role} listening on HOST:PORT (kv ADDRESS)' once "
        "serving; SIGINT/SIGTERM stop it gracefully (exit 0)."
    )
    return build_parser(role, description=description)


def run_node(server_cls: type[RoleServer], argv: Sequence[str] | None = None) -> int:
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
    configure_logging(args.log_level, role)
    if auth is None:
        logging.getLogger(__name__).warning(open_cluster_warning(f"pd-{role}"))

    async def start() -> RoleServer:
        core = await asyncio.to_thread(EngineCore, engine)
        server = server_cls(core, node)
        try:
            await server.start()
        except BaseException:
            await server.stop(grace_s=0)
            raise
        return server

    name = f"pd-{role}"
    return run_server(name, start, lambda s: f"{name} listening on {s.address} (kv {s.kv_address})")


def _role(server_cls: type[RoleServer]) -> str:
    return "prefill" if server_cls.prefill_only else "decode"
