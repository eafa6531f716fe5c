"""Issue 15: one 1.5 GiB frame to a decode node's tcp KV port grew its RSS by 1.5 GiB before it
was refused. The receiver now caps frames (zmq MAXMSGSIZE: one layer of its whole pool), so
libzmq drops the connection on the frame's header: RSS stays flat and the node serves on."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import zmq

from tests.child_env import child_env

pytestmark = pytest.mark.timeout(120)

FRAME_BYTES = 3 << 29  # 1.5 GiB
MAX_RSS_GROWTH = 64 << 20


def test_a_huge_frame_is_refused_before_it_is_buffered():
    child = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("frame_receiver.py"))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        cwd=Path(__file__).parent, env=child_env(),
    )  # fmt: skip
    ctx = zmq.Context()
    try:
        address, pid, cap = child.stdout.readline().split()
        assert int(cap) <= 1 << 20  # one layer of 64 blocks of the test layout, or 1 MiB
        process = psutil.Process(int(pid))
        rss_before = process.memory_info().rss
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        payload = np.zeros(FRAME_BYTES, dtype=np.uint8)  # calloc'd: costs this process nothing
        sock.send_multipart([b"header", memoryview(payload)], copy=False)
        peak = rss_before
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the whole frame would have arrived by now
            peak = max(peak, process.memory_info().rss)
            time.sleep(0.05)
        sock.close()
        child.stdin.write("check\n")
        child.stdin.flush()
        alive = child.stdout.readline().strip()
    finally:
        ctx.term()
        child.stdin.close()
        child.wait(20)
    assert peak - rss_before < MAX_RSS_GROWTH, f"RSS grew {(peak - rss_before) >> 20} MiB"
    assert alive == "alive"
