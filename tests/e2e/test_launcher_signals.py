"""pd-serve stops on Ctrl-C even when it was started with SIGINT ignored, as every process is
that a non-interactive shell starts in the background (`cmd &` in a script, CI runners): it
must take SIGINT itself, not rely on Python's default KeyboardInterrupt."""

from __future__ import annotations

import signal

import pytest

from tests.e2e.cluster import Cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "synthetic:smollm2-135m:layers=1"
STOP_LIMIT_S = 60.0


def test_pd_serve_started_with_sigint_ignored_still_stops_on_sigint() -> None:
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited by pd-serve at exec
    try:
        cluster = Cluster(["--model", MODEL, "--device", "cpu", "--prefill", "1"]).start()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert set(cluster.nodes) == {"prefill-0", "decode-0"}
    leftover = cluster.stop(signal.SIGINT, timeout_s=STOP_LIMIT_S)
    assert cluster.process.returncode == 0, "pd-serve was killed, it did not stop on SIGINT"
    assert not leftover, f"processes left behind after SIGINT: {leftover}"
