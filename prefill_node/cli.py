"""pd-prefill: serve one prefill node.

    pd-prefill --model smollm2-135m --port 50061 --kv-transport tcp --kv-port 5600

Prints "pd-prefill listening on HOST:PORT (kv tcp://HOST:KVPORT)" once serving (the local
cluster launcher reads it); SIGINT/SIGTERM stop it gracefully (exit 0).
"""

from __future__ import annotations

import argparse
import sys

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine_core import EngineCore
from pdserve.cli import build_parser, configure_logging, node_engine_kwargs, registry_config
from pdserve.node_server import NodeServerConfig, run_node
from prefill_node.prefill_server import PrefillServer


def build_prefill_parser() -> argparse.ArgumentParser:
    return build_parser("prefill", description=__doc__.split("\n\n")[0])


def main(argv: list[str] | None = None) -> int:
    parser = build_prefill_parser()
    args = parser.parse_args(argv)
    kwargs = node_engine_kwargs(args)
    try:
        engine_config = EngineConfig(
            model=ModelConfig(**kwargs["model"]),
            cache=CacheConfig(**kwargs["cache"]),
            scheduler=SchedulerConfig(**kwargs["scheduler"], prefill_only=True),
        )
        node_config = NodeServerConfig(
            host=args.host,
            port=args.port,
            kv_transport=args.kv_transport,
            kv_port=args.kv_port,
            advertise_host=args.advertise_host,
            registry=registry_config(args),
        )
    except ValueError as error:
        parser.error(str(error))
    configure_logging(args.log_level, "prefill")

    return run_node(
        "pd-prefill",
        lambda: EngineCore(engine_config),
        lambda core: PrefillServer(core, node_config),
    )


if __name__ == "__main__":
    sys.exit(main())
