"""Replay conversations turn by turn against a router (`pd-bench serve --multi-turn`).

```
one task per conversation, started at the run's arrival times:
  turn k: messages = user 1, answer 1, ..., user k (the model's own answers, re-sent whole as
          a chat client does); prompt_len: the chat template rendered and tokenized here, as
          the router does; the conversation ends before a turn past --multi-turn-max-len
    wait for a --max-concurrency slot; with one request in flight at a time and the nodes'
    counters at hand (KVCounters): read them before and after (this turn's hand-off bytes;
    unknown when a node does not answer in time: the run goes on)
    send the messages; the answer's text comes back streamed
    --think-time-s, then the next turn; a failed turn ends its conversation
```
Each turn is a `TurnRecord` (a RequestRecord with its conversation, turn index, prompt growth
and, when exact, KV bytes moved and skipped). Torch-free.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from benchmarks.serve.conversations import Conversation
from benchmarks.serve.metrics import RequestRecord
from benchmarks.serve.runner import SendOptions, send
from pdserve.tokenizer import Tokenizer
from router.client import GenerationClient, build_request

# (KV bytes moved, KV bytes skipped) by successful hand-offs so far, summed over the nodes
KVCounters = Callable[[], Awaitable[tuple[int, int]]]


@dataclass
class TurnRecord(RequestRecord):
    conversation: int = 0
    turn: int = 1  # from 1
    growth_len: int = 0  # prompt tokens beyond the previous turn's prompt (all, for turn 1)
    kv_bytes: int | None = None  # this turn's hand-off: KV bytes moved (when exact)
    kv_skipped_bytes: int | None = None  # ... and not moved: the decode node held them


@dataclass(frozen=True)
class TurnOptions:
    think_time_s: float = 0.0  # between a turn's answer and the next turn
    max_len: int = 4096  # prompt + max_tokens of a turn at most (the conversation ends there)


class _Run:
    """One run's shared state: the client, the clock, the slots, the records."""

    def __init__(self, client: GenerationClient, options: SendOptions, turns: TurnOptions,
                 slots: Any, kv_counters: KVCounters | None, run_name: str) -> None:  # fmt: skip
        self.client, self.options, self.turns = client, options, turns
        self.slots, self.kv_counters, self.run_name = slots, kv_counters, run_name
        self.records: list[TurnRecord] = []
        self.clock_start = time.perf_counter()

    async def send_turn(self, record: TurnRecord, messages: list[dict[str, str]]) -> str:
        """Send one turn in a slot; its answer's text."""
        proto = build_request(
            messages=messages, request_id=f"{self.run_name}-{record.index}",
            max_tokens=record.max_tokens, temperature=self.options.temperature,
            ignore_eos=self.options.ignore_eos or None,
        )  # fmt: skip
        text: list[str] = []
        async with self.slots:
            before = await self._read_counters()
            await send(self.client, proto, record, self.options.timeout_s, self.clock_start, text)
            after = await self._read_counters() if before is not None and record.completed else None
            if before is not None and after is not None:
                record.kv_bytes, record.kv_skipped_bytes = (a - b for a, b in zip(after, before))
        return "".join(text)

    async def _read_counters(self) -> tuple[int, int] | None:
        """The nodes' KV counters; None when there are none, or a node did not answer."""
        if self.kv_counters is None:
            return None
        try:
            return await self.kv_counters()
        except grpc.aio.AioRpcError as error:  # this turn's bytes are unknown; the run goes on
            print(f"KV counters unread: {error.code().name}: {error.details()}", file=sys.stderr)
            return None


async def _conversation(
    run: _Run, tokenizer: Tokenizer, index: int, conversation: Conversation, start_s: float,
    progress: Any,
) -> None:  # fmt: skip
    delay_s = run.clock_start + start_s - time.perf_counter()
    if delay_s > 0:
        await asyncio.sleep(delay_s)
    history: list[dict[str, str]] = []
    prev_len = 0
    for number, turn in enumerate(conversation.turns, 1):
        messages = [*history, {"role": "user", "content": turn.user}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompt_len = len(tokenizer.encode(text, add_special_tokens=False))
        if prompt_len + turn.max_tokens > run.turns.max_len:
            break
        record = TurnRecord(len(run.records), prompt_len, turn.max_tokens, conversation=index,
                            turn=number, growth_len=prompt_len - prev_len)  # fmt: skip
        run.records.append(record)
        answer = await run.send_turn(record, messages)
        if progress is not None:
            progress.update(1)
        if not record.completed:
            break
        history = [*messages, {"role": "assistant", "content": answer}]
        prev_len = prompt_len
        if run.turns.think_time_s > 0:
            await asyncio.sleep(run.turns.think_time_s)


async def run_conversations(
    addr: str,
    conversations: list[Conversation],
    tokenizer: Tokenizer,
    offsets_s: list[float],
    options: SendOptions,
    turns: TurnOptions,
    max_concurrency: int | None = None,
    kv_counters: KVCounters | None = None,
    progress: Any = None,
    run_name: str = "chat",
) -> tuple[list[TurnRecord], float]:
    """Every turn's record, and the run's duration (first send to last end, seconds).
    `kv_counters` is read around each turn only with `max_concurrency` 1 (one request in
    flight at a time: the difference is that turn's)."""
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    exact = kv_counters if max_concurrency == 1 else None
    async with GenerationClient(addr) as client:
        run = _Run(client, options, turns, slots, exact, run_name)
        await asyncio.gather(*(
            _conversation(run, tokenizer, i, conversation, offsets_s[i], progress)
            for i, conversation in enumerate(conversations)
        ))  # fmt: skip
    records = sorted(run.records, key=lambda r: (r.conversation, r.turn))
    first_send = min((r.send_s for r in records), default=0.0)
    last_end = max((r.end_s for r in records), default=0.0)
    return records, max(last_end - first_send, 0.0)
