"""pd-router: serve the Generation API in front of prefill and decode nodes.

    pd-router --prefill 10.0.0.5:50061 --decode 10.0.0.6:50071 [--decode ...] [--port 50051]
    pd-router --registry redis://10.0.0.2:6379/0 --policy prefix_aware

Without prefill nodes the decode nodes prefill locally (colocated mode). Prints
"pd-router listening on HOST:PORT" once serving and connected; SIGINT/SIGTERM stop it
gracefully (exit 0).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

from pdserve.cli import build_parser, router_config, setup_logging
from pdserve.lifecycle import EVENT_LOOPS, run_server
from pdserve.security import load_cluster_auth
from router.auth import ApiKeys
from router.server import RouterServer


def build_router_parser() -> argparse.ArgumentParser:
    parser = build_parser("router", description=__doc__.split("\n\n")[0])
    group = parser.add_argument_group("nodes (without --registry)")
    group.add_argument(
        "--prefill", action="append", default=[], metavar="ADDR",
        help="a prefill node's HOST:PORT (repeatable; none: colocated mode)",
    )  # fmt: skip
    group.add_argument(
        "--decode", action="append", default=[], metavar="ADDR",
        help="a decode node's HOST:PORT (repeatable; at least one, unless --registry)",
    )  # fmt: skip
    parser.add_argument(
        "--event-loop", choices=EVENT_LOOPS, default="asyncio",
        help="the event loop the router runs on (uvloop: pip install uvloop; "
        "benchmarks/results/2026-12-06-cpu-router.txt compares them) (default: %(default)s)",
    )  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_router_parser()
    args = parser.parse_args(argv)
    if not args.decode and args.registry is None:
        parser.error(
            "give at least one --decode ADDR (decode nodes also serve colocated mode), or a "
            "--registry URL where nodes register"
        )
    if args.event_loop == "uvloop" and importlib.util.find_spec("uvloop") is None:
        parser.error("--event-loop uvloop: uvloop is not installed (pip install uvloop)")
    try:
        config = router_config(
            args, prefill_addrs=tuple(args.prefill), decode_addrs=tuple(args.decode)
        )
        load_cluster_auth(config.security)  # an unreadable or short secret: exit 2 now
        if config.api_key_file:
            ApiKeys.from_file(config.api_key_file)
    except ValueError as error:
        parser.error(str(error))
    setup_logging(args, "router")

    async def start() -> RouterServer:
        """Serves, then waits for its nodes (a signal meanwhile stops it cleanly)."""
        server = RouterServer(config)
        try:
            await server.start()
        except BaseException:
            await server.stop()
            raise
        return server

    return run_server("pd-router", start, _ready_line, args.event_loop)


def _ready_line(server: RouterServer) -> str:
    line = f"pd-router listening on {server.address}"
    if server.http is not None:
        line += f" (http {server.http.url})"
    return line


if __name__ == "__main__":
    sys.exit(main())
