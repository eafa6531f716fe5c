"""echo, logprobs, prompt_logprobs and logit_bias on the OpenAI API: what the body asks of the
nodes, and the response shapes (OpenAI's echo logprobs with the first prompt token's null,
vLLM's prompt_logprobs), whole and streamed."""

from __future__ import annotations

from pdserve.v1 import generation_pb2
from router.http.openai_protocol import parse_chat, parse_completion
from router.http.openai_responses import ChoiceState, ResponseBuilder


def lp(token_id: int, logprob: float, *top: tuple[int, float]) -> generation_pb2.TokenLogprob:
    entry = generation_pb2.TokenLogprob(token_id=token_id, logprob=logprob)
    for t, value in top:
        entry.top.add(token_id=t, logprob=value)
    return entry


def test_echo_with_logprobs_asks_for_prompt_logprobs() -> None:
    parsed = parse_completion({"model": "m", "prompt": "hi", "echo": True, "logprobs": 2,
                               "max_tokens": 1, "temperature": 0})  # fmt: skip
    sampling = parsed.choices[0].request.sampling
    assert parsed.echo and sampling.prompt_logprobs == 2 and sampling.logprobs == 2
    plain = parse_completion({"model": "m", "prompt": "hi", "echo": True})
    assert not plain.choices[0].request.sampling.HasField("prompt_logprobs")


def test_logit_bias_and_prompt_logprobs_reach_the_sampling() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}],
            "logit_bias": {"5": -100, "7": 2.5}, "prompt_logprobs": 3}  # fmt: skip
    sampling = parse_chat(body).choices[0].request.sampling
    assert dict(sampling.logit_bias) == {5: -100.0, 7: 2.5} and sampling.prompt_logprobs == 3


def response(tokenizer, prompt_ids, out_ids, first: bool, finish: str = ""):
    message = generation_pb2.GenerateResponse(token_ids=out_ids, finish_reason=finish,
                                              text=tokenizer.decode(out_ids))  # fmt: skip
    message.logprobs.extend(lp(t, -0.5, (t, -0.5)) for t in out_ids)
    if first:
        message.prompt_logprobs.extend(lp(t, -1.0 - i, (t, -1.0 - i)) for i, t in
                                       enumerate(prompt_ids[1:]))  # fmt: skip
    return message


def test_echo_logprobs_shape_whole_and_streamed(tokenizer) -> None:
    prompt = "hello world"
    prompt_ids = tokenizer.encode(prompt)
    out_ids = tokenizer.encode(" again", add_special_tokens=False)
    parsed = parse_completion({"model": "m", "prompt": prompt, "echo": True, "logprobs": 1,
                               "prompt_logprobs": 1, "max_tokens": 5})  # fmt: skip
    state = ChoiceState()
    state.add(response(tokenizer, prompt_ids, out_ids, True, "length"))
    body = ResponseBuilder(parsed, "cmpl-1", [prompt_ids], tokenizer).full_response([state])
    choice = body["choices"][0]
    assert choice["text"] == prompt + tokenizer.decode(out_ids)
    logprobs = choice["logprobs"]
    num = len(prompt_ids) + len(out_ids)
    assert len(logprobs["tokens"]) == len(logprobs["text_offset"]) == num
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:len(prompt_ids)] == [-1.0 - i for i in
                                                            range(len(prompt_ids) - 1)]  # fmt: skip
    assert "".join(logprobs["tokens"]) == choice["text"]
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    vllm = choice["prompt_logprobs"]
    assert vllm[0] is None and len(vllm) == len(prompt_ids)
    assert vllm[1][str(prompt_ids[1])]["logprob"] == -1.0
    assert vllm[1][str(prompt_ids[1])]["rank"] == 1
    # streamed: the prompt and its logprobs come with the first chunk only
    builder = ResponseBuilder(parsed, "cmpl-1", [prompt_ids], tokenizer)
    first = builder.chunk(0, response(tokenizer, prompt_ids, out_ids[:1], True))
    rest = builder.chunk(0, response(tokenizer, prompt_ids, out_ids[1:], False, "length"))
    assert first["choices"][0]["text"].startswith(prompt)
    assert first["choices"][0]["logprobs"]["token_logprobs"][0] is None
    assert not rest["choices"][0]["text"].startswith(prompt)
    assert "prompt_logprobs" not in rest["choices"][0]
