"""Speculative decoding's numbers for `pd-bench serve`'s summary, read from the nodes of the
cluster it started (their NodeStats counters, before and after each run; a cluster given by
--addr has no node this tool can reach, so its runs have none).

    spec_acceptance_rate         draft tokens accepted / verified during the run
    spec_mean_accepted_tokens    draft tokens accepted per verify chunk (request and step)
    spec_draft_tokens            draft tokens verified
"""

from __future__ import annotations

from typing import Any

from benchmarks.serve.cluster import BenchCluster

_FIELDS = ("num_spec_verifies", "num_spec_draft_tokens", "num_spec_accepted_tokens")


def read_counters(cluster: BenchCluster | None) -> tuple[int, ...] | None:
    """The spec counters summed over the cluster's nodes; None without a cluster."""
    if cluster is None:
        return None
    stats = [cluster.node_stats(name) for name in cluster.nodes]
    return tuple(sum(getattr(s, field) for s in stats) for field in _FIELDS)


def summary(before: tuple[int, ...] | None, after: tuple[int, ...] | None) -> dict[str, Any]:
    """The summary's spec fields for the run between the two reads ({} when unknown or none
    verified: speculation off, or no decoding request drafted)."""
    if before is None or after is None:
        return {}
    verifies, drafts, accepted = (b - a for a, b in zip(before, after))
    if not (verifies and drafts):
        return {}
    return {
        "spec_acceptance_rate": accepted / drafts,
        "spec_mean_accepted_tokens": accepted / verifies,
        "spec_draft_tokens": drafts,
    }


def text(runs: list[dict[str, Any]]) -> str:
    """One line per run that speculated ("" when none did)."""
    lines = [
        f"{run['config']} @ {run['request_rate']} req/s: speculative decoding accepted "
        f"{s['spec_acceptance_rate']:.1%} of {s['spec_draft_tokens']} draft tokens, "
        f"{s['spec_mean_accepted_tokens']:.2f} per verify"
        for run in runs
        if "spec_acceptance_rate" in (s := run["summary"])
    ]
    return "\n".join(lines)
