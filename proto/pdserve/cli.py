"""The one CLI builder every launcher shares (pd-router, pd-prefill, pd-decode, pd-serve).

Torch-free, so the router starts fast. Each launcher calls `build_parser(role)` and gets the
flags common to all roles (listen address, logging, the registry) plus those of its own;
`node_engine_kwargs` turns node flags into the keyword arguments the engine config takes and
`registry_config` the registry flags into a `RegistryConfig`.
"""

from __future__ import annotations

import argparse
import logging

from pdserve.registry import RegistryConfig

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_ROUTER_PORT = 50051
DEFAULT_HOST = "127.0.0.1"
KV_TRANSPORTS = ("auto", "ucx", "tcp", "local")
ROLES = ("router", "prefill", "decode", "serve")
POLICIES = ("round_robin", "least_loaded", "prefix_aware")
DEFAULT_PREFILL_SATURATION_TOKENS = 16384


def parse_size(text: str) -> int:
    """'2GiB', '512MiB', '1G', '1073741824' -> bytes."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    cleaned = text.strip().lower().removesuffix("b").removesuffix("i")
    try:
        if cleaned and cleaned[-1] in units:
            return int(float(cleaned[:-1]) * units[cleaned[-1]])
        return int(cleaned)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a size: {text!r} (use bytes or a suffix, e.g. 512MiB, 2GiB)"
        ) from None


def build_parser(role: str, description: str | None = None) -> argparse.ArgumentParser:
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; expected one of {ROLES}")
    parser = argparse.ArgumentParser(prog=f"pd-{role}", description=description)
    default_port = DEFAULT_ROUTER_PORT if role in ("router", "serve") else 0
    parser.add_argument("--host", default=DEFAULT_HOST, help="address to listen on")
    parser.add_argument(
        "--port", type=int, default=default_port,
        help=f"gRPC port (default {default_port}{'' if default_port else ': pick a free one'})",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    _add_registry_flags(parser)
    if role in ("router", "serve"):
        _add_routing_flags(parser)
    if role in ("prefill", "decode", "serve"):
        _add_node_flags(parser)
    return parser


def _add_registry_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("service discovery")
    group.add_argument(
        "--registry", default=None, metavar="URL",
        help="Redis registry, e.g. redis://127.0.0.1:6379/0: nodes register there (with a TTL "
        "heartbeat) and routers discover them (default: none; give the router node addresses)",
    )
    group.add_argument(
        "--registry-heartbeat-s", type=float, default=RegistryConfig.heartbeat_s,
        help="how often nodes refresh their record and routers resync their view",
    )
    group.add_argument(
        "--registry-ttl-s", type=float, default=RegistryConfig.ttl_s,
        help="a node record not refreshed for this long expires (about 3 heartbeats)",
    )


def _add_routing_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("routing")
    group.add_argument(
        "--policy", default="round_robin", choices=POLICIES,
        help="round_robin: each node in turn; least_loaded: fewest outstanding tokens, free KV "
        "blocks; prefix_aware: a shared prompt prefix goes to the prefill node that holds it",
    )
    group.add_argument(
        "--local-prefill-max-tokens", type=int, default=0, metavar="N",
        help="prompts of at most N tokens prefill on their decode node (0: off)",
    )
    group.add_argument(
        "--prefill-saturation-tokens", type=int, default=DEFAULT_PREFILL_SATURATION_TOKENS,
        metavar="N",
        help="a prefill node with N queued prompt tokens is saturated; when all are, prompts "
        "prefill on their decode node (0: off)",
    )


def registry_config(args: argparse.Namespace) -> RegistryConfig | None:
    """The registry flags as a RegistryConfig (None without --registry); ValueError when bad."""
    if args.registry is None:
        return None
    return RegistryConfig(
        url=args.registry, heartbeat_s=args.registry_heartbeat_s, ttl_s=args.registry_ttl_s
    )


def _add_node_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=DEFAULT_MODEL, help="alias, HF folder, .gguf, synthetic:<shape>")
    group.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    group.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--block-size", type=int, default=16)
    group.add_argument(
        "--kv-cache-memory", type=parse_size, default=None,
        help="KV cache size, e.g. 2GiB (default: 1 GiB on CPU, a fraction of free GPU memory)",
    )
    group.add_argument("--num-kv-blocks", type=int, default=None, help="exact KV pool size in blocks")
    group.add_argument(
        "--gpu-memory-utilization", type=float, default=0.85,
        help="on CUDA without --kv-cache-memory: the fraction of free GPU memory the KV cache takes",
    )
    group.add_argument("--max-num-seqs", type=int, default=128)
    group.add_argument("--max-num-batched-tokens", type=int, default=2048)
    group.add_argument("--no-prefix-caching", action="store_true")
    group.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton", "flash_attn"])
    group.add_argument("--seed", type=int, default=0)
    transfer = parser.add_argument_group("KV transfer")
    transfer.add_argument("--kv-transport", default="auto", choices=KV_TRANSPORTS)
    transfer.add_argument("--kv-port", type=int, default=0, help="KV transport port (0: a free one)")
    transfer.add_argument(
        "--advertise-host", default=None,
        help="host other nodes use to reach this one's KV transport (default: --host; set it "
        "to the pod IP when listening on 0.0.0.0)",
    )


def node_engine_kwargs(args: argparse.Namespace) -> dict:
    """Node flags -> keyword arguments of engine.config's ModelConfig/CacheConfig/SchedulerConfig."""
    return {
        "model": dict(
            model=args.model, device=args.device, dtype=args.dtype,
            max_model_len=args.max_model_len, seed=args.seed,
            attention_backend=args.attention_backend,
        ),
        "cache": dict(
            block_size=args.block_size, num_blocks=args.num_kv_blocks,
            kv_cache_memory=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enable_prefix_caching=not args.no_prefix_caching,
        ),
        "scheduler": dict(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        ),
    }


def advertise_host(args: argparse.Namespace) -> str:
    """The host peers should dial: --advertise-host, else --host unless that is a wildcard."""
    if args.advertise_host:
        return args.advertise_host
    if args.host in ("0.0.0.0", "::", ""):
        import socket

        return socket.gethostbyname(socket.gethostname())
    return args.host


def configure_logging(level: str, role: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format=f"%(asctime)s %(levelname)s [{role}] %(name)s: %(message)s",
    )
