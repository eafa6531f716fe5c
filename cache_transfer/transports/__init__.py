"""KV transports: one message mover, three backends (see cache_transfer/README.md).

| module | backend |
| --- | --- |
| `base` | `KVTransport` (the interface), `TransportHandler`, the receive helpers |
| `local` | in-process, for tests |
| `tcp` | pyzmq over TCP, host memory |
| `ucx/` | UCXX: GPU memory GPU-to-GPU (cuda_ipc, NVLink, RDMA) or host memory over TCP |

`make_transport(name, ...)` is the one factory; it imports a backend only when asked for it, so
importing this package never loads ucxx or zmq.
"""

from __future__ import annotations

import functools
import logging

from cache_transfer.transports.base import (
    KVTransport,
    TransportBindError,
    TransportError,
    TransportHandler,
)

logger = logging.getLogger(__name__)

TRANSPORT_NAMES = ("auto", "ucx", "tcp", "local")

__all__ = [
    "TRANSPORT_NAMES",
    "KVTransport",
    "TransportBindError",
    "TransportError",
    "TransportHandler",
    "make_transport",
    "ucx_available",
]


def make_transport(
    name: str, host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None
) -> KVTransport:
    """Build a transport: "ucx" (UCXX; GPU memory goes GPU-to-GPU), "tcp" (pyzmq, host
    memory), "local" (in-process, tests), or "auto" (ucx when `ucxx` imports, else tcp).

    Listens on `host:port` (`port=0`: a free port) and tells peers `advertise_host` (default:
    `host`, or this machine's address when `host` is a wildcard such as 0.0.0.0). ucx and tcp
    must be built inside the running event loop that will use them."""
    if name == "auto":
        name = "ucx" if ucx_available() else "tcp"
    if name == "local":
        from cache_transfer.transports.local import LocalTransport

        return LocalTransport()
    if name == "tcp":
        from cache_transfer.transports.tcp import TcpTransport

        return TcpTransport(host=host, port=port, advertise_host=advertise_host)
    if name == "ucx":
        if not ucx_available():
            raise ValueError(
                "the ucx KV transport needs the `ucxx` package (pip install ucxx-cu12, or "
                "ucxx-cu13 for CUDA 13); choose --kv-transport tcp without it"
            )
        from cache_transfer.transports.ucx.transport import UcxTransport

        return UcxTransport(host=host, port=port, advertise_host=advertise_host)
    raise ValueError(f"unknown KV transport {name!r}; choose one of {', '.join(TRANSPORT_NAMES)}")


@functools.cache
def ucx_available() -> bool:
    """Whether `import ucxx` works here (its native libraries load)."""
    try:
        import cache_transfer.transports.ucx.transport  # noqa: F401  (imports ucxx with our defaults)
    except (ImportError, OSError) as error:
        logger.info("ucx KV transport unavailable: %s", error)
        return False
    return True
