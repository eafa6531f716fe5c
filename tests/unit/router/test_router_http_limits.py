"""Issue 39 item 4 (and 10's log line): the HTTP server under hostile load, over fake nodes.
Connections beyond the cap push out the oldest idle one (a new client, /health included, is
always served), slowloris headers and stalled bodies are closed, /v1 requests beyond the cap
get 503 with Retry-After while /health is never refused, and failed accepts (out of
descriptors) are one log line, not a traceback each."""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import subprocess
import sys
import time

import httpx
import pytest
from router_fakes import run
from router_http_fakes import TEXT, harness

from router.http.connection_limits import AcceptErrorLog, RequestLimit


@pytest.fixture(scope="module")
def output_ids(tokenizer) -> list[int]:
    return tokenizer.encode(TEXT, add_special_tokens=False)


def _open(url: str, first_bytes: bytes = b"") -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    if first_bytes:
        sock.sendall(first_bytes)
    return sock


def _closed_within(sock: socket.socket, timeout_s: float, trickle: bytes = b"") -> float:
    """Seconds until the server closed `sock` (sending `trickle` a byte every 0.2 s);
    AssertionError if it is still open after `timeout_s`."""
    started = time.monotonic()
    sock.settimeout(0.2)
    for i in range(int(timeout_s / 0.2)):
        try:
            if sock.recv(4096) == b"":
                return time.monotonic() - started
        except TimeoutError:
            pass
        except ConnectionError:
            return time.monotonic() - started
        if trickle:
            try:
                sock.sendall(trickle[i % len(trickle) : i % len(trickle) + 1])
            except ConnectionError:
                return time.monotonic() - started
    raise AssertionError(f"still open after {timeout_s} s")


def test_idle_connections_beyond_the_cap_never_lock_health_out(tokenizer_files, output_ids):
    async def body():
        async with harness(tokenizer_files, output_ids, http_max_connections=8) as h:
            idle = [await asyncio.to_thread(_open, h.router.http.url) for _ in range(20)]
            try:
                async with httpx.AsyncClient(timeout=5) as http:
                    health = [await http.get(h.router.http.url + "/health") for _ in range(3)]
                num_open = len(h.router.http._server.server_state.connections)
                closed = [await asyncio.to_thread(_closed_within, s, 2.0) for s in idle[:12]]
            finally:
                for sock in idle:
                    sock.close()
            return health, num_open, closed

    health, num_open, closed = run(body())
    assert [r.status_code for r in health] == [200, 200, 200]
    assert num_open <= 9  # the cap (+ the one being accepted)
    assert len(closed) == 12  # the oldest were pushed out


def test_slowloris_headers_and_stalled_bodies_are_closed(tokenizer_files, output_ids):
    post = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b"{" * 10

    async def body():
        async with harness(tokenizer_files, output_ids, http_header_timeout_s=1.0,
                           http_body_timeout_s=1.0) as h:  # fmt: skip
            url = h.router.http.url
            slowloris = await asyncio.to_thread(_open, url, b"G")
            header_s = await asyncio.to_thread(
                _closed_within, slowloris, 10.0, b"ET / HTTP/1.1\r\n"
            )
            silent = await asyncio.to_thread(_open, url)
            silent_s = await asyncio.to_thread(_closed_within, silent, 10.0)
            stalled = await asyncio.to_thread(_open, url, post)
            body_s = await asyncio.to_thread(_closed_within, stalled, 10.0)
            async with httpx.AsyncClient(timeout=5) as http:
                ok = await http.post(url + "/v1/completions", json={"model": "fake-model",
                                     "prompt": "x", "max_tokens": 2})  # fmt: skip
            return header_s, silent_s, body_s, ok

    header_s, silent_s, body_s, ok = run(body())
    assert 0.8 < header_s < 5 and 0.8 < silent_s < 5 and 0.8 < body_s < 5
    assert ok.status_code == 200


def test_requests_beyond_the_cap_get_503_with_retry_after():
    release = asyncio.Event()
    seen = []

    async def app(scope, receive, send):
        seen.append(scope["path"])
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def body():
        limit = RequestLimit(app, max_requests=2)
        sent = []

        async def send(message):
            sent.append(message)

        held = [asyncio.create_task(limit({"type": "http", "path": "/v1/completions"}, None,
                                          send)) for _ in range(2)]  # fmt: skip
        await asyncio.sleep(0)
        await limit({"type": "http", "path": "/v1/completions"}, None, send)
        refused = list(sent)
        health = asyncio.create_task(limit({"type": "http", "path": "/health"}, None, send))
        await asyncio.sleep(0)
        release.set()
        await asyncio.gather(*held, health)
        return refused, limit.in_flight

    refused, in_flight = run(body())
    start, payload = refused
    assert start["status"] == 503 and (b"retry-after", b"1") in start["headers"]
    assert b"--http-max-requests" in payload["body"]
    assert seen == ["/v1/completions", "/v1/completions", "/health"] and in_flight == 0


def test_failed_accepts_are_one_log_line(caplog):
    delegated = []
    handler = AcceptErrorLog(lambda loop, context: delegated.append(context))
    loop = asyncio.new_event_loop()
    try:
        with caplog.at_level(logging.WARNING, logger="router.http.connection_limits"):
            for _ in range(500):
                handler(loop, {"message": "socket.accept() out of system resource",
                               "exception": OSError(24, "Too many open files")})  # fmt: skip
            handler(loop, {"message": "something else"})
    finally:
        loop.close()
    lines = [r for r in caplog.records if r.name == "router.http.connection_limits"]
    assert len(lines) == 1 and "Too many open files" in lines[0].getMessage()
    assert not lines[0].exc_info and handler.num_failures == 500
    assert delegated == [{"message": "something else"}]


def test_launchers_raise_the_open_file_limit_to_the_hard_one():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(256, hard)
    code = (
        "import resource; from pdserve.lifecycle import raise_fd_limit; "
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({low}, {hard})); "
        "print(raise_fd_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == [str(hard), str(hard)], out


def test_accepted_connections_send_without_nagle(tokenizer_files, output_ids):
    """TCP_NODELAY on every HTTP connection: without it a keep-alive response's body waited for
    the client's delayed ACK of its headers (40 ms a request; pd-bench router)."""

    async def body():
        async with harness(tokenizer_files, output_ids) as h, httpx.AsyncClient(timeout=5) as http:
            for _ in range(2):  # one keep-alive connection, two requests
                assert (await http.get(h.router.http.url + "/health")).status_code == 200
            connections = list(h.router.http._server.server_state.connections)
            return [
                c.transport.get_extra_info("socket").getsockopt(
                    socket.IPPROTO_TCP, socket.TCP_NODELAY
                )
                for c in connections
            ]

    flags = run(body())
    assert flags and all(flags), flags
