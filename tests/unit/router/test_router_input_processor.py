"""InputProcessor: validation messages, tokenization of the three input kinds, defaults, seeds."""

from __future__ import annotations

import grpc
import pytest
from router_fakes import CHATML_TEMPLATE, MAX_MODEL_LEN, VOCAB_SIZE, RouterHarness, run

from pdserve.sampling_params import InvalidRequestError, SamplingParams
from pdserve.v1 import generation_pb2, node_pb2
from router.client import build_request
from router.input_processor import INLINE_PROMPT_CHARS, InputProcessor, processes_inline

INFO = node_pb2.NodeInfo(max_model_len=MAX_MODEL_LEN, vocab_size=VOCAB_SIZE)


@pytest.fixture
def processor(tokenizer) -> InputProcessor:
    return InputProcessor(tokenizer, INFO)


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (generation_pb2.GenerateRequest(), "set one of prompt, prompt_token_ids or messages"),
        (build_request(""), "prompt is empty"),
        (build_request(prompt_token_ids=[]), "prompt_token_ids is empty"),
        (
            build_request(prompt_token_ids=[5, VOCAB_SIZE]),
            "prompt_token_ids[1] = 320 is not a token id",
        ),
        (build_request(messages=[]), "messages must be a non-empty list"),
        (build_request(messages=[{"role": "wizard", "content": "hi"}]), "has role 'wizard'"),
        (build_request("hi", max_tokens=MAX_MODEL_LEN), "exceeds the model's context length of 64"),
        (build_request("hi", max_tokens=0), "max_tokens must be an integer >= 1"),
        (build_request("hi", temperature=-1.0), "temperature must be >= 0"),
        (build_request("hi", top_p=0.0), "top_p must be in (0, 1]"),
        (build_request("hi", temperature=float("nan")), "temperature must be a finite number"),
        (build_request("hi", min_tokens=5, max_tokens=2), "min_tokens (5) must not exceed"),
        (build_request("hi", stop=[""]), "stop strings must be non-empty"),
        (build_request("hi", stop_token_ids=[999]), "stop_token_ids[0] = 999 is not a token id"),
        (build_request("hi", logprobs=21), "logprobs must be between 0 and 20"),
        (
            generation_pb2.GenerateRequest(request_id="abc\n2026 FAKE ERROR", prompt="hi"),
            "request_id must be at most 256 printable characters (no newlines",
        ),
        (generation_pb2.GenerateRequest(request_id="r" * 257, prompt="hi"), "got 257 characters"),
    ],
)
def test_invalid_requests_say_what_to_fix(processor, request_, message) -> None:
    with pytest.raises(InvalidRequestError) as error:
        processor.process(request_)

    assert message in str(error.value)


def test_unset_sampling_fields_take_the_engine_defaults(processor) -> None:
    processed = processor.process(build_request("hello"))

    defaults = SamplingParams()
    node = processed.node_sampling
    assert processed.sampling_params.max_tokens == node.max_tokens == defaults.max_tokens
    assert node.temperature == defaults.temperature and node.top_p == defaults.top_p
    assert node.top_k == defaults.top_k and node.repetition_penalty == defaults.repetition_penalty
    assert not node.HasField("logprobs")  # None: no logprobs


def test_unset_sampling_fields_take_the_models_defaults(tokenizer) -> None:
    """Issue 34: as vLLM's --generation-config auto: the model's defaults (NodeInfo's
    default_sampling) fill what the client left unset; what it set wins."""
    info = node_pb2.NodeInfo(max_model_len=MAX_MODEL_LEN, vocab_size=VOCAB_SIZE)
    info.default_sampling.CopyFrom(
        node_pb2.NodeSamplingParams(temperature=0.2, top_p=0.9, max_tokens=8)
    )
    processor = InputProcessor(tokenizer, info)

    unset = processor.process(build_request("hello")).sampling_params
    mine = processor.process(build_request("hello", temperature=0.0, max_tokens=3))

    assert (unset.temperature, unset.top_p, unset.max_tokens) == (0.2, 0.9, 8)
    assert unset.top_k == SamplingParams().top_k  # not the model's: the engine's
    assert (mine.sampling_params.temperature, mine.sampling_params.top_p) == (0.0, 0.9)
    assert mine.sampling_params.max_tokens == 3


@pytest.mark.parametrize("kind", ["prompt", "prompt_token_ids", "messages"])
def test_a_prompt_longer_than_the_context_blames_the_prompt(processor, kind) -> None:
    """Issue 34: not max_tokens, which the client may never have set."""
    long_text = " ".join(["word"] * (2 * MAX_MODEL_LEN))
    request = {
        "prompt": build_request(long_text),
        "prompt_token_ids": build_request(prompt_token_ids=[5] * MAX_MODEL_LEN),
        "messages": build_request(messages=[{"role": "user", "content": long_text}]),
    }[kind]
    with pytest.raises(InvalidRequestError) as error:
        processor.process(request)

    assert error.value.param == kind
    assert f"the {kind} is" in str(error.value) and "max_tokens" not in str(error.value)


def test_set_sampling_fields_reach_the_nodes_exactly(processor) -> None:
    processed = processor.process(
        build_request(
            "hello", temperature=0.0, top_k=-1, seed=7, logprobs=0, stop=["x"], stop_token_ids=[3]
        )
    )

    node = processed.node_sampling
    assert node.HasField("temperature") and node.temperature == 0.0
    assert (node.top_k, node.seed, node.logprobs) == (-1, 7, 0)
    assert list(node.stop_token_ids) == [3]
    assert processed.sampling_params.stop == ["x"]


def test_every_request_gets_a_seed_and_a_request_id(processor) -> None:
    first, second = (processor.process(build_request("hello")) for _ in range(2))

    assert first.node_sampling.HasField("seed") and second.node_sampling.HasField("seed")
    assert first.node_sampling.seed != second.node_sampling.seed
    assert first.request_id != second.request_id and len(first.request_id) == 32
    mine = [processor.process(build_request("hello", request_id="mine")) for _ in range(2)]
    assert [p.client_request_id for p in mine] == ["mine", "mine"]  # echoed to the client
    assert mine[0].request_id != mine[1].request_id != "mine"  # nodes see unique ids


def test_prompt_and_token_ids_and_chat_messages_tokenize(processor, tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo"}]
    rendered = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhéllo<|im_end|>\n"
        "<|im_start|>assistant\n"
    )

    chat = processor.process(build_request(messages=messages))
    prompt = processor.process(build_request("héllo wörld"))
    ids = processor.process(build_request(prompt_token_ids=[1, 2, 3]))

    assert tokenizer.chat_template == CHATML_TEMPLATE
    assert chat.prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False)
    assert tokenizer.decode(chat.prompt_token_ids, skip_special_tokens=False) == rendered
    assert prompt.prompt_token_ids == tokenizer.encode("héllo wörld")
    assert ids.prompt_token_ids == [1, 2, 3] and ids.prompt_len == 3


def test_prompt_filling_the_context_exactly_is_accepted(processor) -> None:
    processed = processor.process(build_request(prompt_token_ids=[5] * 60, max_tokens=4))

    assert processed.prompt_len + processed.sampling_params.max_tokens == MAX_MODEL_LEN


def test_invalid_request_over_grpc_is_invalid_argument_and_reaches_no_node(
    tokenizer_files,
) -> None:
    async def body():
        async with RouterHarness(tokenizer_files, [5, 6]) as h:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await h.client.generate_all("hello", top_p=2.0)
            return error.value, h

    error, h = run(body())

    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "top_p must be in (0, 1], got 2.0" in error.details()
    assert h.decode[0].requests == [] and h.prefill[0].requests == []
    assert h.router.stats.errors == {"INVALID_ARGUMENT": 1}


def test_a_huge_prompt_is_refused_before_tokenizing(tokenizer):
    processor = InputProcessor(tokenizer, INFO, max_prompt_chars=1000)
    calls = []
    original = tokenizer.encode
    tokenizer.encode = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        with pytest.raises(InvalidRequestError, match="refuses more than 1000"):
            processor.process(build_request("x" * 1001))
        assert calls == []  # never tokenized
        assert processor.process(build_request("x" * 10)).prompt_len > 0
    finally:
        tokenizer.encode = original


def test_a_rejected_request_id_reaches_the_log_escaped() -> None:
    from router.input_processor import loggable_request_id

    assert loggable_request_id("client-7") == "client-7"
    assert loggable_request_id("abc\nFAKE") == "'abc\\nFAKE'"
    assert len(loggable_request_id("r" * 10_000)) == 42  # cut to 40, quoted


def test_seeded_choices_wrap_at_the_seed_fields_width() -> None:
    """n choices take seed, seed + 1, ...: past 2^64 - 1 they wrap instead of overflowing."""
    from router.http.openai_protocol import parse_completion

    parsed = parse_completion({"model": "m", "prompt": "hi", "seed": 2**64 - 1, "n": 3})
    assert [c.request.sampling.seed for c in parsed.choices] == [2**64 - 1, 0, 1]


def test_large_structured_output_specs_are_processed_off_the_event_loop() -> None:
    small = build_request("hi")
    assert processes_inline(small)
    schema = '{"type": "object", "description": "%s"}' % ("x" * INLINE_PROMPT_CHARS)
    large = build_request("hi")
    large.sampling.structured_output.kind = generation_pb2.STRUCTURED_OUTPUT_KIND_JSON_SCHEMA
    large.sampling.structured_output.spec = schema
    assert not processes_inline(large)
    choices = build_request("hi")
    choices.sampling.structured_output.kind = generation_pb2.STRUCTURED_OUTPUT_KIND_CHOICE
    choices.sampling.structured_output.choices.extend(["y" * 100] * (INLINE_PROMPT_CHARS // 50))
    assert not processes_inline(choices)
