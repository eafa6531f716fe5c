"""pd-bench fp8-kv's metrics: the teacher-forced tally on made-up distributions (KL of equal
ones is 0, of different ones > 0; the leading-match counts), and the whole bench on a tiny
synthetic model: FP8 KV close to float32 KV, and the `auto` self-check exactly equal."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.engine.forced_scores import Tally
from tests.unit.benchmarks.bench_run import help_text, run_with_json

TINY = ["--model", "synthetic:tiny-llama", "--device", "cpu", "--dtype", "float32",
        "--num-prompts", "5", "--max-tokens", "6", "--prefix-tokens", "3", "--batch", "3"]  # fmt: skip


def _logprobs(top: list[int], vocab: int = 10, seed: int = 0) -> torch.Tensor:
    """[len(top), vocab] log-probs whose argmax at row i is top[i]."""
    logits = torch.randn(len(top), vocab, generator=torch.Generator().manual_seed(seed))
    logits[torch.arange(len(top)), torch.tensor(top)] = 10.0
    return torch.log_softmax(logits, dim=-1)


def test_tally_of_equal_distributions_is_zero_kl_and_full_agreement() -> None:
    tally = Tally(prefix_tokens=2)
    p = _logprobs([1, 2, 3, 4])
    tally.add(p, p.clone(), [1, 2, 3, 4])
    rows = dict(tally.rows())
    assert rows["mean KL(baseline || test) (nats)"] == 0.0
    assert rows["top-1 agreement (positions)"] == 1.0
    assert rows["identical first 2 greedy tokens"] == rows["identical whole greedy output"] == 1.0


def test_tally_counts_leading_matches_and_a_positive_kl() -> None:
    tally = Tally(prefix_tokens=2)
    greedy = [1, 2, 3, 4]
    tally.add(_logprobs(greedy), _logprobs([1, 2, 7, 4], seed=1), greedy)  # diverges at 2
    tally.add(_logprobs(greedy), _logprobs([5, 2, 3, 4], seed=2), greedy)  # at 0
    rows = dict(tally.rows())
    assert tally.num_prompts == 2 and tally.num_positions == 8
    assert rows["top-1 agreement (positions)"] == 6 / 8
    assert rows["identical first 2 greedy tokens"] == 1 / 2
    assert rows["identical whole greedy output"] == 0.0
    assert rows["mean KL(baseline || test) (nats)"] > 0
    assert rows["max KL (nats)"] >= rows["mean KL(baseline || test) (nats)"]


def test_fp8_kv_against_float32_kv_on_a_tiny_model(tmp_path, capsys) -> None:
    table, result = run_with_json("fp8-kv", TINY, tmp_path, capsys)
    q = result["quality"]
    assert "fp8_e4m3 KV (unit scales) vs float32 KV" in table and "30 positions" in table
    assert 0 < q["mean KL(baseline || test) (nats)"] < 0.5
    assert q["top-1 agreement (positions)"] > 0.6  # (random weights: near-ties are common)
    assert q["baseline prefill argmax = its greedy"] > 0.9
    assert math.isfinite(q["baseline cache max |K|"]) and q["baseline cache max |K|"] > 0


def test_auto_kv_self_check_is_exact(tmp_path, capsys) -> None:
    _, result = run_with_json("fp8-kv", [*TINY, "--kv-cache-dtype", "auto"], tmp_path, capsys)
    q = result["quality"]
    assert q["mean KL(baseline || test) (nats)"] == 0.0 and q["max KL (nats)"] == 0.0
    assert q["top-1 agreement (positions)"] == 1.0
    assert q["identical whole greedy output"] == 1.0


@pytest.mark.parametrize("flag", ["--num-prompts", "--batch", "--max-tokens"])
def test_bad_counts_are_refused(flag, capsys) -> None:
    from benchmarks.cli import main as pd_bench

    with pytest.raises(SystemExit) as exit_info:
        pd_bench(["fp8-kv", flag, "0"])
    assert exit_info.value.code == 2
    assert f"{flag} must be >= 1" in capsys.readouterr().err


def test_help_documents_every_option(capsys) -> None:
    text = help_text("fp8-kv", capsys)
    for flag in ("--kv-cache-dtype", "--num-prompts", "--max-prompt-tokens", "--max-tokens",
                 "--prefix-tokens", "--batch", "--free-running", "--json"):  # fmt: skip
        assert flag in text
