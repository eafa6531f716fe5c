"""What the operator-facing e2e tests read off a running `tests.e2e.cluster.Cluster`: from
pd-serve's output (`cluster.log`, each child's lines prefixed with its name) the HTTP API's URL, each node's /metrics URL and a process's log lines."""

from __future__ import annotations

import re
import time

_HTTP = re.compile(r"pd-serve: OpenAI-compatible API on (\S+)/v1 ")
_METRICS = re.compile(r"^\[(prefill|decode)-(\d+)\] pd-\w+ listening on .*metrics (http://\S+?)\)")
POLL_S = 0.05


def wait_for_line(cluster, pattern: re.Pattern, timeout_s: float) -> re.Match:
    """The first match of `pattern` in pd-serve's output, waiting (bounded) for it."""
    deadline = time.monotonic() + timeout_s
    while True:
        for line in list(cluster.log):
            if match := pattern.search(line):
                return match
        if time.monotonic() > deadline:
            raise TimeoutError(f"pd-serve printed no line matching {pattern.pattern!r}")
        time.sleep(POLL_S)


def http_url(cluster, timeout_s: float = 10.0) -> str:
    """The router's HTTP API (pd-serve prints it just after the router's address)."""
    return wait_for_line(cluster, _HTTP, timeout_s).group(1)


def metrics_urls(cluster) -> dict[str, str]:
    """ "decode-0" -> that node's /metrics URL (from its listening line)."""
    found = {}
    for line in list(cluster.log):
        if match := _METRICS.search(line):
            found[f"{match.group(1)}-{match.group(2)}"] = match.group(3)
    return found


def process_lines(cluster, process: str, containing: str) -> list[str]:
    """pd-serve's output lines from `process` ("router", "decode-0", ...) containing
    `containing`."""
    tag = f"[{process}] "
    return [line for line in list(cluster.log) if line.startswith(tag) and containing in line]
