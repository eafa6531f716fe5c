"""Issue 39 item 4, as the adversary ran it: a pd-router process whose open-file soft limit is
1,024 (a common default) gets 1,100 idle HTTP connections, no key needed. Before, they filled
its descriptors: /health timed out, gRPC on an existing channel got DEADLINE_EXCEEDED, a new
channel UNAVAILABLE, and the log filled with `Too many open files` tracebacks. Now the router
raises its soft limit to the hard one and caps HTTP connections below it: /health and gRPC
answer within 1 s, and the log holds no such traceback. A slowloris connection (a header byte
every 2 s) is closed within 30 s (--http-header-timeout-s, 15 s)."""

from __future__ import annotations

import asyncio
import re
import resource
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from pdserve.v1 import generation_pb2, generation_pb2_grpc
from tests.ports import free_port, start_on_free_ports

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NUM_IDLE = 1100
ROUTER_SOFT_LIMIT = 1024
ANSWER_WITHIN_S = 1.0
_READY = re.compile(r"^pd-router listening on (\S+) \(http (\S+)\)$")


def _own_limit(wanted: int) -> int:
    """Raise this process's soft limit for `wanted` sockets; how many it may open."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(hard, max(soft, wanted + 200)) if hard != resource.RLIM_INFINITY else wanted + 200
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return target - 200


def _start_router(cluster, log_path) -> tuple[subprocess.Popen, str, str]:
    """pd-router with its HTTP API on a free port (another one if that was taken meanwhile)."""
    return start_on_free_ports(lambda: _start_router_once(cluster, free_port(), log_path))


def _start_router_once(cluster, http_port: int, log_path) -> tuple[subprocess.Popen, str, str]:
    def low_limit() -> None:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(ROUTER_SOFT_LIMIT, hard), hard))

    argv = [sys.executable, "-m", "router.cli", "--host", "127.0.0.1", "--port", "0",
            "--http-port", str(http_port), "--registry", cluster.redis.url,
            "--log-level", "info"]  # fmt: skip
    log = open(log_path, "w")  # noqa: SIM115 (closed with the process)
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True,
                               preexec_fn=low_limit)  # fmt: skip
    with ThreadPoolExecutor(1) as pool:
        line = pool.submit(process.stdout.readline).result(timeout=120)
    ready = _READY.match(line.strip())
    if ready is None:
        process.kill()
        process.wait(30)
        log.close()
        raise RuntimeError(f"pd-router printed {line!r}; its log: {log_path.read_text()[-2000:]}")
    return process, ready[1], ready[2]


async def _answers(grpc_address: str, http_url: str, existing: grpc.aio.Channel) -> dict:
    """Seconds each of /health (a new connection), GetModelInfo on `existing` and on a new
    channel took; a failure as its exception's text."""

    async def timed(call) -> float | str:
        started = time.monotonic()
        try:
            async with asyncio.timeout(10):
                await call()
        except Exception as error:  # noqa: BLE001 (reported, asserted on)
            return f"{type(error).__name__}: {error}"[:200]
        return time.monotonic() - started

    async def health() -> None:
        async with httpx.AsyncClient(timeout=10) as http:
            assert (await http.get(http_url + "/health")).status_code == 200

    async def info(channel: grpc.aio.Channel) -> None:
        stub = generation_pb2_grpc.GenerationStub(channel)
        await stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)

    async def fresh_channel() -> None:
        async with grpc.aio.insecure_channel(grpc_address) as channel:
            await info(channel)

    return {"health": await timed(health), "grpc existing channel": await timed(lambda: info(existing)),
            "grpc new channel": await timed(fresh_channel)}  # fmt: skip


async def _until_healthy(http_url: str, timeout_s: float = 60.0) -> None:
    """Until the router's /health says a decode node is ready."""
    async with httpx.AsyncClient(timeout=5) as http, asyncio.timeout(timeout_s):
        while (await http.get(http_url + "/health")).status_code != 200:
            await asyncio.sleep(0.2)


def _slowloris_closed_after(http_url: str, limit_s: float) -> float | None:
    host, port = http_url.removeprefix("http://").rsplit(":", 1)
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.settimeout(2.0)
        header = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-a: b\r\n" * 100
        for byte in header:
            if time.monotonic() - started > limit_s:
                return None
            try:
                sock.sendall(bytes([byte]))
                if sock.recv(1) == b"":
                    return time.monotonic() - started
            except TimeoutError:
                continue
            except ConnectionError:
                return time.monotonic() - started
    return None


def test_idle_http_connections_and_slowloris_leave_the_router_answering(fault_cluster, tmp_path):
    cluster = fault_cluster
    num_idle = min(NUM_IDLE, _own_limit(NUM_IDLE))  # the machine's hard limit may forbid it
    process, grpc_address, http_url = _start_router(cluster, tmp_path / "router.log")
    idle: list[socket.socket] = []

    async def main() -> tuple[dict, dict]:
        async with grpc.aio.insecure_channel(grpc_address) as channel:
            await _until_healthy(http_url)
            before = await _answers(grpc_address, http_url, channel)
            host, port = http_url.removeprefix("http://").rsplit(":", 1)
            for _ in range(num_idle):
                try:
                    idle.append(socket.create_connection((host, int(port)), timeout=5))
                except OSError:
                    break  # the router stopped accepting: what is asserted below
            await asyncio.sleep(1.0)  # the router accepted what it could
            during = await _answers(grpc_address, http_url, channel)
            return before, during

    try:
        before, during = asyncio.run(main())
        slowloris_s = _slowloris_closed_after(http_url, 40.0)
    finally:
        for sock in idle:
            sock.close()
        process.kill()
        process.wait(10)
    log = (tmp_path / "router.log").read_text()
    print(f"{num_idle} idle connections ({len(idle)} opened); before {before}; during {during};"
          f" slowloris closed after {slowloris_s} s")  # fmt: skip
    slow = {k: v for k, v in during.items() if not isinstance(v, float) or v > ANSWER_WITHIN_S}
    assert not slow, (during, before)
    assert log.count("Too many open files") <= 1, log[-2000:]
    assert slowloris_s is not None and slowloris_s <= 30.0, slowloris_s
