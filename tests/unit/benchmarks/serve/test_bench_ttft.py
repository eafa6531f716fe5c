"""pd-bench ttft on CPU: starts a colocated and a 1P1D pd-serve with a tiny model, prints the
TTFT table for each prompt length, each length's last 1P1D request's milestones, the last
request's per-layer timeline and (--breakdown) where each length's TTFT went."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from benchmarks.cli import main as pd_bench
from benchmarks.serve.bench_ttft import Samples


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ttft_prints_both_clusters_ratio_and_timeline() -> None:
    argv = [sys.executable, "-m", "benchmarks.cli", "ttft", "--model", "synthetic:tiny-llama"]
    argv += ["--device", "cpu", "--transport", "tcp", "--prompt-tokens", "48", "160"]
    argv += ["--requests", "2", "--breakdown"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=360)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    out = done.stdout
    number = r"\d+\.\d"
    for n in (48, 160):
        row = rf"^\s+{n} \|\s+{number} /\s+{number} ms \|\s+{number} /\s+{number} ms \|\s+\d+\.\d\d \|"
        assert re.search(row, out, re.M), out
    assert "per-layer timeline of the last 1P1D request (160 tokens):" in out
    layers = re.findall(rf"^\s+(\d) +({number}\d) +({number}\d) +({number}\d)$", out, re.M)
    assert [int(i) for i, *_ in layers] == [0, 1], out  # tiny-llama has 2 layers
    for _, computed, sent, landed in layers:
        assert 0 < float(computed) <= float(sent)  # the same host clock as the client's
        assert float(landed) > 0
    assert re.search(r"last layer landed -?\d+\.\d\d ms after it was computed", out), out
    for n in (48, 160):  # each length's last 1P1D request, its milestones in time order
        block = out.split(f"milestones of the last 1P1D request ({n} tokens)", 1)[1]
        block = block.split("\n\n", 1)[0]
        names = re.findall(rf"^\s+{number}\d  (.+)$", block, re.M)
        # the router calls P and D at once: P's side and D's side each in order
        for causal in (["decode rpc", "decode ticket"],
                       ["prefill rpc", "prefill computing", "prefill first_token", "client token 0"]):  # fmt: skip
            assert [m for m in names if m in causal] == causal, block
        later = ["decode kv_done", "decode decoding", "client token 1"]
        assert [m for m in names if m in later] == later, block
    for n in (48, 160):  # --breakdown: each length's rows, router and node marks both in
        block = out.split(f"where the TTFT went, {n} prompt tokens", 1)[1].split("\n\n", 1)[0]
        for row in ("router: validate, tokenize", "  P: prefill", "TTFT (client)",
                    "  router -> P: AttachTicket"):  # fmt: skip
            line = next(x for x in block.splitlines() if x.startswith(row))
            cells = line[len(row) :].split()
            colocated_ok = row.startswith("  ") or re.fullmatch(r"-?\d+\.\d{3}", cells[0])
            assert colocated_ok and re.fullmatch(r"-?\d+\.\d{3}", cells[1]), block


def test_percentiles_and_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    samples = Samples(ttft_ms=[5.0, 1.0, 3.0, 2.0, 4.0])
    assert samples.median() == 3.0 and samples.p90() == 5.0
    with pytest.raises(SystemExit):
        pd_bench(["ttft", "--requests", "0"])
    assert "--requests and --prompt-tokens must be >= 1" in capsys.readouterr().err
