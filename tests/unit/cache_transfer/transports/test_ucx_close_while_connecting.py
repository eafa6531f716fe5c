"""A ucx transport closed while one of its connections is still in ucxx's peer handshake (here:
the connection to its own listener, closed at once) shuts UCX down cleanly. Cutting that connect
short crashed the process (SIGSEGV in ucxx.reset, or in the listener's close): the UCX endpoint
of the cancelled handshake, and the listener's half of it, outlived the context. The scenario
runs in a child process, so a crash fails this test instead of killing pytest."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cache_transfer.transports import ucx_available
from tests.child_env import child_env

pytestmark = pytest.mark.skipif(not ucx_available(), reason="ucxx does not import here")

SCENARIO = """
import asyncio
from cache_transfer import make_transport
from cache_transfer.transports.ucx import outbound

outbound._CLOSE_FLUSH_S = 0.0  # close() does not wait for the hello: the connect is under way

async def once():
    ucx = make_transport("ucx")
    try:
        await ucx.send(ucx.address, bytes(70_000))  # opens the connection; the send is refused
    except ValueError:
        pass
    await ucx.close()

async def main():
    for i in range(3):
        await asyncio.wait_for(once(), 30)
        print("closed", i, flush=True)

asyncio.run(main())
"""


def test_closing_while_a_connection_is_in_the_handshake_shuts_ucx_down_cleanly() -> None:
    child = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", SCENARIO],
        env=child_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert child.returncode == 0, f"exit code {child.returncode}:\n{child.stderr[-3000:]}"
    # UCX's own log lines ("[time] [host:pid] ... UCX WARN ...") may share the child's stdout
    closed = [line for line in child.stdout.splitlines() if line.startswith("closed")]
    assert closed == ["closed 0", "closed 1", "closed 2"], child.stdout[-3000:]
    assert "UCXPY  ERROR" not in child.stderr, child.stderr[-3000:]
