"""Greedy tokens of the engine equal Hugging Face transformers' (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.unit.engine.conftest import ARCHS, random_prompts

MAX_TOKENS = 12


def hf_greedy(checkpoint, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """One prompt at a time (no padding), stopping at EOS like the engine does."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32).eval()
    eos = model.config.eos_token_id
    outputs = []
    for prompt in prompts:
        with torch.inference_mode():
            ids = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos,
            )
        outputs.append(ids[0, len(prompt) :].tolist())
    return outputs


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_greedy_batch_matches_transformers(arch, tiny_checkpoints):
    prompts = random_prompts(8, vocab_size=512, seed=1)
    assert len({len(p) for p in prompts}) > 1, "prompts should differ in length"
    expected = hf_greedy(tiny_checkpoints[arch], prompts, MAX_TOKENS)

    llm = LLM(str(tiny_checkpoints[arch]), device="cpu", dtype="float32", num_blocks=256)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))

    for out, want in zip(outputs, expected):
        assert out.token_ids == want
        assert out.finish_reason == ("stop" if want and want[-1] == 2 else "length")
    llm.engine.check_no_leaks()
