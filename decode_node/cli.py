"""pd-decode: serve one decode node.

    pd-decode --model smollm2-135m --port 50071 --kv-transport tcp --kv-port 5700

Prints "pd-decode listening on HOST:PORT (kv tcp://HOST:KVPORT)" once serving (the local
cluster launcher reads it); SIGINT/SIGTERM stop it gracefully (exit 0).
"""

from __future__ import annotations

import argparse
import sys

from decode_node.decode_server import DecodeServer
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine_core import EngineCore
from pdserve.cli import build_parser, configure_logging, node_engine_kwargs, registry_config
from pdserve.node_server import NodeServerConfig, run_node


def build_decode_parser() -> argparse.ArgumentParser:
    parser = build_parser("decode", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--transfer-timeout-s",
        type=float,
        default=NodeServerConfig.transfer_timeout_s,
        help="how long a disaggregated request waits for its KV before this node prefills it "
        "itself (when the router sends no timeout)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_decode_parser()
    args = parser.parse_args(argv)
    kwargs = node_engine_kwargs(args)
    try:
        engine_config = EngineConfig(
            model=ModelConfig(**kwargs["model"]),
            cache=CacheConfig(**kwargs["cache"]),
            scheduler=SchedulerConfig(**kwargs["scheduler"]),
        )
        node_config = NodeServerConfig(
            host=args.host,
            port=args.port,
            kv_transport=args.kv_transport,
            kv_port=args.kv_port,
            advertise_host=args.advertise_host,
            registry=registry_config(args),
            transfer_timeout_s=args.transfer_timeout_s,
        )
    except ValueError as error:
        parser.error(str(error))
    configure_logging(args.log_level, "decode")

    return run_node(
        "pd-decode", lambda: EngineCore(engine_config), lambda core: DecodeServer(core, node_config)
    )


if __name__ == "__main__":
    sys.exit(main())
