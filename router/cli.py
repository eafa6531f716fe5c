"""pd-router: serve the Generation API in front of prefill and decode nodes.

    pd-router --prefill 10.0.0.5:50061 --decode 10.0.0.6:50071 [--decode ...] [--port 50051]
    pd-router --registry redis://10.0.0.2:6379/0 --policy prefix_aware

Without prefill nodes the decode nodes prefill locally (colocated mode). Prints
"pd-router listening on HOST:PORT" once serving and connected; SIGINT/SIGTERM stop it
gracefully (exit 0).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys

from pdserve.cli import build_parser, configure_logging, registry_config
from router.config import RouterConfig
from router.server import RouterServer


def build_router_parser() -> argparse.ArgumentParser:
    parser = build_parser("router", description=__doc__.split("\n\n")[0])
    defaults = RouterConfig()
    parser.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="ADDR",
        help="a prefill node's HOST:PORT (repeatable; none: colocated mode)",
    )
    parser.add_argument(
        "--decode",
        action="append",
        default=[],
        metavar="ADDR",
        help="a decode node's HOST:PORT (repeatable; at least one, unless --registry)",
    )
    parser.add_argument(
        "--node-wait-s",
        type=float,
        default=defaults.node_wait_s,
        help="how long to wait at start for nodes that are not up yet",
    )
    parser.add_argument(
        "--transfer-timeout-s",
        type=float,
        default=defaults.transfer_timeout_s,
        help="how long a decode node waits for a prompt's KV before prefilling it itself",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_router_parser()
    args = parser.parse_args(argv)
    if not args.decode and args.registry is None:
        parser.error(
            "give at least one --decode ADDR (decode nodes also serve colocated mode), or a "
            "--registry URL where nodes register"
        )
    try:
        config = RouterConfig(
            host=args.host,
            port=args.port,
            prefill_addrs=tuple(args.prefill),
            decode_addrs=tuple(args.decode),
            registry=registry_config(args),
            policy=args.policy,
            local_prefill_max_tokens=args.local_prefill_max_tokens,
            prefill_saturation_tokens=args.prefill_saturation_tokens,
            node_wait_s=args.node_wait_s,
            transfer_timeout_s=args.transfer_timeout_s,
        )
    except ValueError as error:
        parser.error(str(error))
    configure_logging(args.log_level, "router")
    try:
        asyncio.run(_serve(config))
    except OSError as error:
        print(f"pd-router: {error}", file=sys.stderr)
        return 1
    return 0


async def _serve(config: RouterConfig) -> None:
    """Runs until SIGINT/SIGTERM (also while still waiting for nodes), then stops gracefully."""
    server = RouterServer(config)
    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop_requested.set)
    starting = asyncio.create_task(server.start())
    stopping = asyncio.create_task(stop_requested.wait())
    try:
        await asyncio.wait((starting, stopping), return_when=asyncio.FIRST_COMPLETED)
        if starting.done():
            starting.result()  # raises what start() raised
            print(f"pd-router listening on {server.address}", flush=True)
            await stopping
    finally:
        for task in (starting, stopping):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        await server.stop()


if __name__ == "__main__":
    sys.exit(main())
