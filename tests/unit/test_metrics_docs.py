"""The metrics table of README.md names exactly the metrics the router and the nodes register,
with their types; every metric deploy/ refers to (the HPA, its README) exists."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from node_common.node_metrics import NodeMetrics
from pdserve.v1 import node_pb2
from router.metrics import RouterMetrics

REPO_ROOT = Path(__file__).resolve().parents[2]
_ROW = re.compile(r"^\| `(pdserve_\w+)` \| (\w+) \|")


def exported(registry: CollectorRegistry) -> dict[str, str]:
    """Exposed family name -> type (counters are exposed with `_total`)."""
    return {
        family.name + ("_total" if family.type == "counter" else ""): family.type
        for family in registry.collect()
    }


def registered() -> dict[str, str]:
    router = RouterMetrics()
    router.migration()  # registered on the first migration
    every_stat = {field.name: 1 for field in node_pb2.NodeStats.DESCRIPTOR.fields}
    every_stat["num_fallbacks"] = 1  # a decode node's own counter (role_metric_counters)
    node = NodeMetrics("decode", "m", lambda: every_stat)
    return {**exported(router.registry), **exported(node.registry)}


def documented() -> dict[str, str]:
    rows = {}
    for line in (REPO_ROOT / "README.md").read_text().splitlines():
        if match := _ROW.match(line):
            assert match.group(1) not in rows, f"{match.group(1)} is listed twice"
            rows[match.group(1)] = match.group(2)
    return rows


def test_readme_lists_every_registered_metric_with_its_type():
    assert documented() == registered()


def test_deploy_refers_only_to_registered_metrics():
    names = registered()
    files = [*(REPO_ROOT / "deploy").rglob("*.yaml"), REPO_ROOT / "deploy" / "README.md"]
    mentioned = {
        (path.relative_to(REPO_ROOT).as_posix(), name)
        for path in files
        for name in re.findall(r"\bpdserve_\w+", path.read_text())
    }
    assert mentioned, "deploy/ names no metric: the HPA should"
    assert {(path, name) for path, name in mentioned if name not in names} == set()


def test_speculative_decoding_ratios() -> None:
    """Acceptance ratio and mean accepted length from the node's counters; absent before the
    first verify (no division by zero, no made-up 0)."""

    def gauges(stats: dict[str, int]) -> dict[str, float]:
        node = NodeMetrics("decode", "m", lambda: stats)
        return {
            family.name: family.samples[0].value
            for family in node.registry.collect()
            if family.name.startswith("pdserve_node_spec_decode") and family.type == "gauge"
        }

    spec = dict(num_spec_verifies=4, num_spec_draft_tokens=16, num_spec_accepted_tokens=6)
    assert gauges(spec) == {
        "pdserve_node_spec_decode_acceptance_ratio": 6 / 16,
        "pdserve_node_spec_decode_mean_accepted_tokens": 6 / 4,
    }
    assert gauges({"num_spec_verifies": 0, "num_spec_draft_tokens": 0}) == {}
