"""pd-bench serve --multi-turn: ShareGPT conversations (alternating turns, cut where a turn is
unusable, seeded), the turn-by-turn replay against a stand-in router (each turn re-sends the
whole chat with the model's own answers, think time between turns, a failed turn ends its
conversation, KV bytes read around each turn when requests run one at a time) and the
per-turn table."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from benchmarks.serve import bench_serve
from benchmarks.serve.conversations import sharegpt_conversations
from benchmarks.serve.datasets import DatasetSpec
from benchmarks.serve.multi_turn import TurnOptions, run_conversations
from benchmarks.serve.runner import SendOptions
from benchmarks.serve.turn_report import turn_summary, turn_table
from pdserve.config import SecurityConfig
from pdserve.v1 import generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.timeout(60)


class ChatTokenizer:
    """One token per word; a chat template that writes "role: content" lines."""

    chat_template = "role: content"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(word) for word in text.split()]

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        lines = [f"{m['role']}: {m['content']}" for m in messages]
        return "\n".join([*lines, "assistant:"] if add_generation_prompt else lines)


def words(n: int, word: str = "w") -> str:
    return " ".join([word] * n)


def chat(*pairs: tuple[str, str], system: bool = False) -> dict:
    messages = [{"from": "system", "value": "be nice"}] if system else []
    for human, gpt in pairs:
        messages += [{"from": "human", "value": human}, {"from": "gpt", "value": gpt}]
    return {"id": "x", "conversations": messages}


def test_conversations_alternate_and_stop_at_an_unusable_turn(tmp_path) -> None:
    entries = [
        chat((words(5), words(6)), (words(7), words(8)), (words(5), words(9)), system=True),
        chat((words(5), words(6)), (words(2), words(8)), (words(5), words(9))),  # turn 2 short
        chat((words(5), words(6)), (words(7), words(8))),  # too few turns
        {"conversations": [{"from": "gpt", "value": "hi"}, {"from": "human", "value": "x"}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(entries))
    spec = DatasetSpec(path=str(path), num_prompts=10, max_output_tokens=7)
    (kept,) = sharegpt_conversations(spec, ChatTokenizer(), min_turns=3, max_turns=5)
    assert [(t.user, t.max_tokens) for t in kept.turns] == [
        (words(5), 6), (words(7), 7), (words(5), 7)]  # fmt: skip
    two = sharegpt_conversations(spec, ChatTokenizer(), min_turns=2, max_turns=2)
    assert sorted(len(c.turns) for c in two) == [2, 2]  # the first cut at 2; the third
    assert all(c.turns[1].user != words(2) for c in two)  # the second: 1 usable turn
    with pytest.raises(ValueError, match="chat template"):
        sharegpt_conversations(spec, None, 2, 2)


class FakeRouter(generation_pb2_grpc.GenerationServicer):
    """Answers each chat with max_tokens words "a", in two chunks; records what it got. A
    message containing "fail" is refused."""

    def __init__(self) -> None:
        self.received: list[list[tuple[str, str]]] = []

    async def Generate(self, request, context):
        messages = [(m.role, m.content) for m in request.messages.messages]
        self.received.append(messages)
        if "fail" in messages[-1][1]:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")
        n = request.sampling.max_tokens
        yield generation_pb2.GenerateResponse(token_ids=[1], text="a")
        yield generation_pb2.GenerateResponse(
            token_ids=[1] * (n - 1), text=" a" * (n - 1), finish_reason="length"
        )


async def serve(fake: FakeRouter) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    generation_pb2_grpc.add_GenerationServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def conversations(tmp_path, *entries):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(list(entries)))
    spec = DatasetSpec(path=str(path), num_prompts=10)
    return sharegpt_conversations(spec, ChatTokenizer(), min_turns=1, max_turns=5)


def test_turns_resend_the_chat_with_the_models_answers(tmp_path) -> None:
    convs = conversations(
        tmp_path,
        chat((words(4, "u"), words(5)), (words(6, "v"), words(4)), (words(4, "x"), words(5))),
        chat((words(4, "p"), words(4)), (words(4, "fail"), words(4)), (words(4, "q"), words(4))),
    )
    moved = iter(range(0, 10**6, 1000))

    async def counters():  # grows 1000 bytes moved and 10 skipped per read
        value = next(moved)
        return value, value // 100

    async def main():
        fake = FakeRouter()
        server, addr = await serve(fake)
        try:
            records, duration_s = await run_conversations(
                addr, convs, ChatTokenizer(), [0.0, 0.0], SendOptions(),
                TurnOptions(think_time_s=0.01, max_len=33), max_concurrency=1,
                kv_counters=counters,
            )  # fmt: skip
        finally:
            await server.stop(None)
        return fake, records, duration_s

    fake, records, duration_s = asyncio.run(main())
    chat_u = next(i for i, c in enumerate(convs) if c.turns[0].user == words(4, "u"))
    first = [r for r in records if r.conversation == chat_u]
    # turn 3 would be 29 prompt tokens + 5 > max_len 33: the conversation ended after 2
    assert [r.turn for r in first] == [1, 2] and all(r.completed for r in first)
    turn_2 = next(m for m in fake.received if len(m) == 3 and m[0][1] == words(4, "u"))
    assert turn_2 == [("user", words(4, "u")), ("assistant", "a a a a a"), ("user", words(6, "v"))]
    assert [(r.prompt_len, r.growth_len) for r in first] == [(6, 6), (19, 13)]
    second = [r for r in records if r.conversation != chat_u]
    assert [(r.turn, r.completed) for r in second] == [(1, True), (2, False)]  # then it ended
    assert all(r.kv_bytes == 1000 and r.kv_skipped_bytes == 10 for r in records if r.completed)
    rows = turn_summary(records)
    assert [(row["turn"], row["num_completed"]) for row in rows] == [(1, 2), (2, 1), ("2+", 1)]
    assert rows[1]["kv_bytes_per_growth_token"] == pytest.approx(1000 / 13)
    assert rows[2]["kv_bytes_per_growth_token"] == pytest.approx(1000 / 13)  # turn 2 alone
    text = turn_table("1P1D", rows)
    assert text.splitlines()[0].split()[:3] == ["config", "turn", "n"] and duration_s > 0


def test_multi_turn_flags(capsys) -> None:
    parser = bench_serve.build_parser()
    args, _ = parser.parse_known_args(["--multi-turn", "--think-time-s", "0.5"])
    assert args.multi_turn and args.think_time_s == 0.5 and args.min_turns == 3
    for bad in (["--multi-turn", "--dataset", "random"], ["--multi-turn", "--min-turns", "0"],
                ["--multi-turn", "--think-time-s", "-1"]):  # fmt: skip
        with pytest.raises(SystemExit) as exit_info:
            bench_serve.main(bad)
        assert exit_info.value.code == 2


class IdRouter(generation_pb2_grpc.GenerationServicer):
    """Token-id prompts: answers max_tokens tokens; records the prompts."""

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []

    async def GetModelInfo(self, request, context):
        return generation_pb2.ModelInfo(max_model_len=4096, vocab_size=100, eos_token_ids=[2])

    async def Generate(self, request, context):
        self.prompts.append(list(request.prompt_token_ids.ids))
        n = request.sampling.max_tokens
        yield generation_pb2.GenerateResponse(token_ids=[7] * n, finish_reason="length")


def test_turn_ttft_sends_turn_then_fresh_prompts(capsys) -> None:
    from benchmarks.serve import bench_turn_ttft

    args = bench_turn_ttft.build_parser().parse_args(
        ["--context", "40", "--new-tokens", "8", "--answer-tokens", "3", "--repeats", "2",
         "--warmup", "0", "--target-ratio", "1000"]
    )  # fmt: skip

    async def main():
        fake = IdRouter()
        server, addr = await serve_router(fake)
        try:
            samples = await bench_turn_ttft.measure(addr, args, [], SecurityConfig())
        finally:
            await server.stop(None)
        return fake, samples

    fake, samples = asyncio.run(main())
    assert [len(p) for p in fake.prompts] == [40, 51, 8] * 2  # context, turn, fresh
    context, turn, fresh = fake.prompts[:3]
    assert turn[:40] == context and turn[40:43] == [7, 7, 7]  # its answer, then new tokens
    assert not set(fresh) & {2} and len(samples.turn_ms) == len(samples.fresh_ms) == 2
    assert bench_turn_ttft.report(samples, args)
    assert "turn / fresh TTFT" in capsys.readouterr().out


async def serve_router(servicer) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def test_an_unread_counter_leaves_that_turns_bytes_unknown(tmp_path, capsys) -> None:
    """A node too busy to answer GetStats in time: that turn's KV bytes are unknown (not
    counted as exact), the run goes on."""
    convs = conversations(tmp_path, chat((words(4, "u"), words(5)), (words(6, "v"), words(4))))
    reads = iter(range(100))

    async def counters():  # the third read (turn 2's before) fails
        read = next(reads)
        if read == 2:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(), "slow"
            )
        return read * 1000, 0

    async def main():
        server, addr = await serve(FakeRouter())
        try:
            records, _ = await run_conversations(
                addr, convs, ChatTokenizer(), [0.0], SendOptions(),
                TurnOptions(think_time_s=0.0, max_len=100), max_concurrency=1,
                kv_counters=counters,
            )  # fmt: skip
        finally:
            await server.stop(None)
        return records

    records = asyncio.run(main())
    assert [(r.turn, r.completed, r.kv_bytes) for r in records] == [
        (1, True, 1000),
        (2, True, None),
    ]
    assert turn_summary(records)[1]["num_exact_kv"] == 0
    assert "KV counters unread: DEADLINE_EXCEEDED: slow" in capsys.readouterr().err
