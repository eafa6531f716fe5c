"""`python -m pdserve.health_check HOST:PORT [--service NAME] [--timeout-s S]`: one call to the
standard grpc.health.v1 service of a router or node; exit 0 when it answers SERVING, 1 otherwise
(with the reason on stderr). The image's Docker HEALTHCHECK; Kubernetes uses its own gRPC
probes instead (deploy/k8s/). Torch-free and quick to start.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout_s: float = 3.0) -> str | None:
    """None when `address` reports `service` SERVING; else why not."""
    request = health_pb2.HealthCheckRequest(service=service)
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=timeout_s)
    except grpc.RpcError as error:
        return f"{address}: {error.code().name}: {error.details()}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        return f"{address}: {status}"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.health_check", description=__doc__)
    parser.add_argument("address", help="HOST:PORT of a router or node")
    parser.add_argument("--service", default="", help="service name ('': the whole server)")
    parser.add_argument("--timeout-s", type=float, default=3.0)
    args = parser.parse_args(argv)
    problem = check(args.address, args.service, args.timeout_s)
    if problem is not None:
        print(f"not serving: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
