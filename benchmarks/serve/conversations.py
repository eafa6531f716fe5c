"""Multi-turn conversations for `pd-bench serve --multi-turn`: ShareGPT chats, turn by turn.

```
sharegpt_conversations(spec, tokenizer, min_turns, max_turns)
  each ShareGPT entry whose messages alternate human, gpt, human, gpt, ... (a system message
  first is dropped) with at least `min_turns` exchanges, cut at `max_turns`; each turn: the
  human message (sent), and the token length of the recorded gpt answer (its max_tokens,
  capped by --max-output-tokens); a human message or answer of fewer than MIN_LEN tokens, or a
  human message longer than MAX_PROMPT_LEN, ends the conversation there (before that turn)
```
The answers a run sends back are the model's own (what a chat client re-sends), not the
recorded ones: only their lengths are used. Seeded: the same flags pick the same chats.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from benchmarks.serve.datasets import MAX_PROMPT_LEN, MIN_LEN, DatasetSpec, iter_sharegpt
from pdserve.tokenizer import Tokenizer


@dataclass(frozen=True)
class ChatTurn:
    user: str  # the human message of this turn
    max_tokens: int  # the recorded answer's length (capped)


@dataclass(frozen=True)
class Conversation:
    turns: tuple[ChatTurn, ...]


def _exchanges(entry: dict) -> list[tuple[str, str]]:
    """(human, gpt) pairs while the messages alternate, from the first human message."""
    messages = [m for m in entry.get("conversations") or [] if m.get("from") != "system"]
    pairs = []
    for human, gpt in zip(messages[::2], messages[1::2]):
        if human.get("from") != "human" or gpt.get("from") != "gpt":
            break
        pairs.append((human.get("value") or "", gpt.get("value") or ""))
    return pairs


def _turns(
    pairs: list[tuple[str, str]], tokenizer: Tokenizer, max_turns: int, max_output: int | None
) -> list[ChatTurn]:
    turns = []
    for human, answer in pairs[:max_turns]:
        human_len = len(tokenizer.encode(human, add_special_tokens=False))
        answer_len = len(tokenizer.encode(answer, add_special_tokens=False))
        if not MIN_LEN <= human_len <= MAX_PROMPT_LEN or answer_len < MIN_LEN:
            break
        turns.append(ChatTurn(human, min(answer_len, max_output or answer_len)))
    return turns


def sharegpt_conversations(
    spec: DatasetSpec, tokenizer: Tokenizer | None, min_turns: int, max_turns: int
) -> list[Conversation]:
    """Up to `spec.num_prompts` conversations of `min_turns`..`max_turns` turns."""
    if tokenizer is None or not tokenizer.chat_template:
        raise ValueError(
            "--multi-turn sends chat messages: it needs a model with a tokenizer and a chat "
            "template (or --tokenizer DIR of one)"
        )
    if not 1 <= min_turns <= max_turns:
        raise ValueError(f"need 1 <= --min-turns <= --max-turns, got {min_turns}, {max_turns}")
    entries = [
        pairs for pairs in map(_exchanges, iter_sharegpt(spec.path)) if len(pairs) >= min_turns
    ]
    random.Random(spec.seed).shuffle(entries)
    conversations: list[Conversation] = []
    for pairs in entries:
        if len(conversations) == spec.num_prompts:
            break
        turns = _turns(pairs, tokenizer, max_turns, spec.max_output_tokens)
        if len(turns) >= min_turns:
            conversations.append(Conversation(tuple(turns)))
    return conversations
