"""pd-bench serve end to end on the default model (CPU): a short ShareGPT run on a cluster it
starts itself, and a run against a running router where one request fails."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.e2e.conftest import MODEL, REAL_MODEL_CLUSTERS

pytestmark = [pytest.mark.slow, REAL_MODEL_CLUSTERS]

SERVE_TIMEOUT_S = 600


def _bench(*argv: str, progress: bool = False) -> subprocess.CompletedProcess:
    quiet = [] if progress else ["--no-progress"]
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.cli", "serve", *quiet, *argv],
        capture_output=True, text=True, timeout=SERVE_TIMEOUT_S, check=False,
    )  # fmt: skip


def _check_consistent(run: dict) -> None:
    summary, requests = run["summary"], run["requests"]
    assert summary["num_completed"] + summary["num_failed"] == summary["num_sent"] == len(requests)
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        d = summary[metric]
        if d["count"]:
            assert d["median"] <= d["p90"] <= d["p99"], (metric, d)
    for request in requests:
        if request["status"] == "OK":
            assert request["ttft_s"] is not None and 0 < request["ttft_s"] <= request["e2e_s"]
            assert 1 <= request["output_len"] <= request["max_tokens"]
            times = request["chunk_times_s"]
            assert times == sorted(times) and request["send_s"] < times[0] <= request["end_s"]
    assert summary["ttft_ms"]["p99"] <= summary["e2e_ms"]["p99"]
    assert summary["num_good"] <= summary["num_completed"]


def test_sharegpt_run_on_its_own_cpu_cluster(tmp_path):
    """Its files land in a fresh folder under --results-dir (relative names there), and it
    shows pd-serve's start-up lines while the cluster starts."""
    result = _bench(
        "--prefill", "1", "--decode", "1", "--model", MODEL, "--device", "cpu",
        "--dtype", "float32", "--dataset", "sharegpt", "--num-prompts", "6",
        "--max-output-tokens", "8", "--request-rate", "8", "--slo-ttft-ms", "60000",
        "--results-dir", str(tmp_path / "results"), "--json", "serve.json", "--plot", "serve.png",
        progress=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "TTFT" in result.stdout and "goodput" in result.stdout
    assert "pd-serve: router listening" in result.stderr  # its start, shown as it goes
    (folder,) = (tmp_path / "results").iterdir()
    assert folder.name.endswith("-serve")
    out, plot = folder / "serve.json", folder / "serve.png"
    assert "pd-decode listening" in (folder / "pd-serve.log").read_text()
    payload = json.loads(out.read_text())
    assert payload["dataset"]["name"] == "sharegpt" and payload["dataset"]["num_requests"] == 6
    (run,) = payload["runs"]
    assert run["config"] == "1P1D" and run["request_rate"] == 8
    _check_consistent(run)
    assert run["summary"]["num_completed"] == 6  # a healthy cluster serves every prompt
    assert all(r["max_tokens"] <= 8 for r in run["requests"])
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_failed_requests_count_as_failed_against_a_running_router(cluster_colocated, tmp_path):
    requests = tmp_path / "requests.jsonl"
    rows = [{"prompt": "The capital of France is", "max_tokens": 4},
            {"prompt_token_ids": [1, 2, 3, 10**8], "max_tokens": 4},  # not a token id
            {"prompt_token_ids": [1, 2, 3, 4, 5], "max_tokens": 3}]  # fmt: skip
    requests.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "serve.json"
    result = _bench(
        "--addr", cluster_colocated.router, "--dataset", "jsonl", "--dataset-path",
        str(requests), "--request-rate", "inf,20", "--num-warmups", "0", "--json", str(out),
        "--results-dir", str(tmp_path / "results"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    payload = json.loads(out.read_text())
    assert payload["dataset"]["model"] == MODEL
    assert [r["request_rate"] for r in payload["runs"]] == [float("inf"), 20]
    for run in payload["runs"]:
        _check_consistent(run)
        assert run["summary"]["failures_by_status"] == {"INVALID_ARGUMENT": 1}
        assert run["summary"]["num_completed"] == 2
        failed = run["requests"][1]
        assert failed["status"] == "INVALID_ARGUMENT" and "not a token id" in failed["error"]
    assert "INVALID_ARGUMENT" in result.stdout
