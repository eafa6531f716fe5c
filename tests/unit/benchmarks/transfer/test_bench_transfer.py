"""pd-bench transfer: the real KV path between two processes prints its table beside the
ceilings and checks every byte; bad flags are clear errors."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from benchmarks.cli import main as pd_bench
from benchmarks.transfer.ceilings import _parse_perftest
from benchmarks.transfer.spec import TransferSpec, layout_for
from cache_transfer.transports import ucx_available

TRANSPORTS = [
    "tcp",
    pytest.param("ucx", marks=pytest.mark.skipif(not ucx_available(), reason="no ucxx")),
]
QUICK = ["--model", "llama3-8b:layers=4", "--prompt-tokens", "256", "--iters", "1"]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_transfer_prints_the_table_and_lands_byte_exact(transport: str) -> None:
    argv = [sys.executable, "-m", "benchmarks.cli", "transfer", "--transport", transport, *QUICK]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "4 layers x 8 kv heads x 128 (bfloat16, block 16), 256 tokens: 1.0 MiB/layer" in out
    assert re.search(r"plain TCP socket, 2 processes( \(ceiling\))?\s+\d+\.\d\d", out), out
    for mode in ("sequential", "pipelined", "batched"):
        assert re.search(rf"{transport}: pack\+send\+unpack, {mode}\s+\d+\.\d\d\s+\d+%", out), out
    assert "byte-exact: OK (3 requests x 4 layers, into other block ids)" in out
    assert re.search(r"pack_layer \(gather, torch\), per call\s+\d+\.\d\d", out), out
    if transport == "ucx":
        assert "ucx_perftest tag_bw over tcp, 2 processes (ceiling)" in out
        assert re.search(r"raw ucxx sends, same 2 processes\s+\d+\.\d\d", out), out
        assert re.search(r"ucx pipelined / raw ucxx: \d+%", out), out


def test_in_process_local_transport_runs_without_a_child() -> None:
    assert pd_bench(["transfer", "--transport", "local", *QUICK]) == 0


def test_unknown_command_and_bad_flags_are_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert pd_bench(["nope"]) == 2
    assert "unknown command 'nope'; choose one of transfer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pd_bench(["transfer", "--model", "gpt-17"])
    assert "unknown synthetic shape 'gpt-17'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pd_bench(["transfer", "--prompt-tokens", "0"])
    assert "--prompt-tokens and --iters must be > 0" in capsys.readouterr().err


def test_spec_rebuilds_the_same_kv_and_layers_differ() -> None:
    spec = TransferSpec(layout_for("llama3-8b:layers=2"), num_tokens=40, transport="tcp")
    assert spec.num_blocks == 3 and spec.layer_bytes == 3 * 64 * 1024
    first, again = spec.src_caches("cpu"), spec.src_caches("cpu")

    def raw(cache: torch.Tensor) -> torch.Tensor:  # bytes: random bf16 bits include NaNs
        return cache.view(torch.uint8)

    assert all(raw(a).equal(raw(b)) for (a, _), (b, _) in zip(first, again))
    assert not raw(first[0][0]).equal(raw(first[1][0]))  # layers differ
    assert not raw(first[0][0]).equal(raw(first[0][1]))  # K and V differ


def test_perftest_output_is_parsed_in_gigabytes() -> None:
    output = "+---+\nFinal:   64   5.668  1518.309  1518.309   5269.02   5000.00   659   659\n"
    assert _parse_perftest(output) == pytest.approx(5000 * 2**20 / 1e9)
    assert _parse_perftest("connection refused") is None
