"""Prompt logprobs equal transformers' scoring of the same tokens (fp32, CPU), whole or in
prefill chunks, in memory-bounded slices, with a prefix-cache hit or a preemption in the way;
logit_bias moves the sampled tokens."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine import prompt_logprobs as prompt_logprobs_module
from pdserve.sampling_params import InvalidRequestError
from tests.unit.engine.conftest import random_prompts

TOP_N = 3


def hf_scores(checkpoint, prompt: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every prompt position: [len, vocab]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def check_against(reference: torch.Tensor, prompt: list[int], got) -> None:
    assert len(got) == len(prompt) and got[0] is None
    for position, entry in enumerate(got[1:]):
        row = reference[position]  # position p predicts prompt token p + 1
        assert entry.token_id == prompt[position + 1]
        assert entry.logprob == pytest.approx(row[entry.token_id].item(), abs=1e-4)
        assert entry.rank == int((row > row[entry.token_id]).sum()) + 1
        top_ids = row.topk(TOP_N).indices.tolist()
        assert [t for t, _ in entry.top] == top_ids
        for (_, lp), expected in zip(entry.top, row.topk(TOP_N).values.tolist()):
            assert lp == pytest.approx(expected, abs=1e-4)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints):
    return tiny_checkpoints["llama"]


@pytest.mark.parametrize(
    ("budget", "ahead"),
    [(2048, "off"), (7, "off"), (7, "on")],
    ids=["whole", "chunks-of-7", "chunks-of-7-async"],
)
def test_prompt_logprobs_equal_transformers(checkpoint, budget, ahead, monkeypatch):
    # slices of 5 rows: the memory bound cuts a chunk's positions several times
    monkeypatch.setattr(prompt_logprobs_module, "SLICE_BYTES", 12 * 512 * 5)
    prompts = random_prompts(3, vocab_size=512, seed=3, min_len=1, max_len=40)
    prompts[0] = prompts[0][:1]  # a one-token prompt: nothing to score
    llm = LLM(str(checkpoint), device="cpu", dtype="float32", num_blocks=128,
              max_num_batched_tokens=budget, async_scheduling=ahead)  # fmt: skip
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=TOP_N)
    outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs):
        check_against(hf_scores(checkpoint, prompt), prompt, output.prompt_logprobs)
    llm.engine.check_no_leaks()


def test_a_prefix_cache_hit_does_not_skip_them(checkpoint):
    prompt = random_prompts(1, vocab_size=512, seed=5, min_len=48, max_len=48)[0]
    llm = LLM(str(checkpoint), device="cpu", dtype="float32", num_blocks=64)
    llm.generate([prompt], SamplingParams(max_tokens=2))  # fills the prefix cache
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=TOP_N)
    (output,) = llm.generate([prompt], params)
    check_against(hf_scores(checkpoint, prompt), prompt, output.prompt_logprobs)
    (again,) = llm.generate([prompt], SamplingParams(max_tokens=2))
    assert again.num_cached_tokens > 0 and again.prompt_logprobs is None


def test_a_preempted_request_sends_them_once(checkpoint):
    prompts = random_prompts(4, vocab_size=512, seed=9, min_len=30, max_len=30)
    # 12 blocks of 16: four 30-token prompts decoding 40 tokens cannot all fit
    llm = LLM(str(checkpoint), device="cpu", dtype="float32", num_blocks=12, block_size=16)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    outputs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, output in zip(prompts, outputs):
        assert len(output.prompt_logprobs) == len(prompt)
        assert [e.token_id for e in output.prompt_logprobs[1:]] == prompt[1:]
    llm.engine.check_no_leaks()


def test_logit_bias_moves_the_greedy_token(checkpoint):
    prompt = random_prompts(1, vocab_size=512, seed=2)[0]
    llm = LLM(str(checkpoint), device="cpu", dtype="float32", num_blocks=64)
    (plain,) = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0))
    first = plain.token_ids[0]
    favoured = (first + 1) % 512
    (forced,) = llm.generate(
        [prompt], SamplingParams(max_tokens=6, temperature=0.0, logit_bias={favoured: 100.0})
    )
    assert forced.token_ids == [favoured] * 6
    (banned,) = llm.generate(
        [prompt], SamplingParams(max_tokens=1, temperature=0.0, logit_bias={first: -100.0})
    )
    assert banned.token_ids[0] != first
    (seeded,) = llm.generate(  # sampled rows take the bias too
        [prompt],
        SamplingParams(max_tokens=6, temperature=1.0, seed=7, logit_bias={favoured: 100.0}),
    )
    assert seeded.token_ids == [favoured] * 6
    with pytest.raises(InvalidRequestError, match="logit_bias token ids"):
        llm.generate([prompt], SamplingParams(logit_bias={512: 1.0}))
    llm.engine.check_no_leaks()


def test_a_request_prefilled_elsewhere_gets_none_from_here(checkpoint):
    """Its prompt KV came from a peer (add_prefilled): the prefill node sends them."""
    llm = LLM(str(checkpoint), device="cpu", dtype="float32", num_blocks=64)
    engine = llm.engine
    prompt = random_prompts(1, vocab_size=512, seed=4, min_len=20, max_len=20)[0]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    block_ids = engine.reserve("p", len(prompt) + 1)
    engine.add_prefilled(engine.make_request("p", prompt, params), block_ids, first_token=7)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert outputs and all(o.prompt_logprobs is None for o in outputs)
    engine.check_no_leaks()
