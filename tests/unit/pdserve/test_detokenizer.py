import random

import pytest

from pdserve.detokenizer import IncrementalDetokenizer, StopStringMatcher
from pdserve.tokenizer import Tokenizer
from tests.unit.pdserve.text_fixtures import (
    build_byte_level_tokenizer,
    build_metaspace_tokenizer,
    default_model_tokenizer_dir,
)

ALPHABET = list("abcdefghijklmnop  ,.!\n") + list("éöïß日本語中文") + ["🙂", "🙃", "👍🏽"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(build_byte_level_tokenizer(tmp_path_factory.mktemp("tok")))


def _stream(detokenizer: IncrementalDetokenizer, token_ids: list[int], chunk_sizes) -> list[str]:
    chunks, start = [], 0
    for size in chunk_sizes:
        chunks.append(detokenizer.update(token_ids[start : start + size]))
        start += size
    assert start >= len(token_ids)
    return chunks


def test_streaming_reproduces_decode_without_broken_characters(tokenizer: Tokenizer) -> None:
    rng = random.Random(0)
    prompt_ids = tokenizer.encode("hello world ")
    for _ in range(60):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 40)))
        output_ids = tokenizer.encode(text)
        detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
        chunks = _stream(detokenizer, output_ids, [1] * len(output_ids))
        assert all("\ufffd" not in chunk for chunk in chunks), chunks
        assert detokenizer.flush() == ""
        assert "".join(chunks) == detokenizer.text == tokenizer.decode(output_ids) == text


def test_split_character_is_held_until_complete(tokenizer: Tokenizer) -> None:
    emoji_ids = tokenizer.encode("🙂")
    assert len(emoji_ids) >= 2  # the fixture's tokenizer spells it over several tokens
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    assert [detokenizer.update([i]) for i in emoji_ids[:-1]] == [""] * (len(emoji_ids) - 1)
    assert detokenizer.update(emoji_ids[-1:]) == "🙂"


def test_flush_releases_an_incomplete_character(tokenizer: Tokenizer) -> None:
    emoji_ids = tokenizer.encode("a🙂")
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    assert detokenizer.update(emoji_ids[:-1]) == "a"
    held = tokenizer.decode(emoji_ids[:-1])[1:]
    assert held.endswith("\ufffd") and detokenizer.flush() == held
    assert detokenizer.text == tokenizer.decode(emoji_ids[:-1])


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_in_random_chunks_match_full_decode(
    tokenizer: Tokenizer, skip_special_tokens: bool
) -> None:
    """Any id sequence (special tokens, stray bytes) streams to exactly its full decode."""
    rng = random.Random(1)
    for _ in range(60):
        output_ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 30))]
        sizes = [rng.randint(1, 4) for _ in output_ids]
        detokenizer = IncrementalDetokenizer(tokenizer, [5, 6, 7], skip_special_tokens)
        text = "".join(_stream(detokenizer, output_ids, sizes)) + detokenizer.flush()
        assert text == tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)


def test_prefix_context_keeps_spacing(tmp_path) -> None:
    tokenizer = Tokenizer.from_dir(build_metaspace_tokenizer(tmp_path))
    prompt_ids = tokenizer.encode("the quick")
    output_ids = tokenizer.encode("brown fox jumps")
    standalone = "".join(tokenizer.decode([i]) for i in output_ids)
    assert standalone == "brownfoxjumps"  # why decoding token by token is wrong
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    streamed = "".join(detokenizer.update([i]) for i in output_ids) + detokenizer.flush()
    assert streamed == " brown fox jumps"


def test_each_update_decodes_a_bounded_window(tokenizer: Tokenizer) -> None:
    """The work per token does not grow with the output: only a short window is decoded."""
    decoded_lens: list[int] = []
    decode = tokenizer.decode

    class CountingTokenizer:
        def decode(self, token_ids, skip_special_tokens=True):
            decoded_lens.append(len(token_ids))
            return decode(token_ids, skip_special_tokens=skip_special_tokens)

    output_ids = tokenizer.encode(" ".join(["héllo wörld 日本語 🙂"] * 40))
    detokenizer = IncrementalDetokenizer(CountingTokenizer(), tokenizer.encode("hi there"))
    for token_id in output_ids:
        detokenizer.update([token_id])
    assert len(output_ids) > 200
    assert max(decoded_lens) <= 8
    assert detokenizer.text == tokenizer.decode(output_ids)


@pytest.mark.slow
def test_default_model_streaming() -> None:
    tokenizer = Tokenizer.from_dir(default_model_tokenizer_dir())
    prompt_ids = tokenizer.encode(
        tokenizer.apply_chat_template([{"role": "user", "content": "Say something."}])
    )
    rng = random.Random(3)
    for _ in range(20):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 60)))
        output_ids = tokenizer.encode(text) + list(tokenizer.eos_token_ids)
        detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
        chunks = _stream(detokenizer, output_ids, [1] * len(output_ids))
        assert all("\ufffd" not in chunk for chunk in chunks), chunks
        assert "".join(chunks) + detokenizer.flush() == text


def _feed_all(matcher: StopStringMatcher, chunks: list[str]) -> tuple[str, bool]:
    emitted = []
    for chunk in chunks:
        text, matched = matcher.feed(chunk)
        emitted.append(text)
        if matched:
            return "".join(emitted), True
    return "".join(emitted) + matcher.flush(), False


def test_stop_string_spanning_chunks_is_excluded() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("Hello wo") == ("Hello wo", False)
    assert matcher.feed("rld! ST") == ("rld! ", False)  # "ST" may begin the stop string
    assert matcher.feed("OP and more") == ("", True)
    assert matcher.matched_stop == "STOP"
    assert matcher.feed("later") == ("", True)


def test_text_before_stop_in_same_chunk_is_emitted() -> None:
    matcher = StopStringMatcher(["\n\n", "END"])
    assert matcher.feed("abc END x\n\n") == ("abc ", True)
    assert matcher.matched_stop == "END"


def test_holds_only_possible_stop_prefixes() -> None:
    matcher = StopStringMatcher(["<|end|>"])
    assert matcher.feed("a <") == ("a ", False)
    assert matcher.feed("|e") == ("", False)
    assert matcher.feed("x") == ("<|ex", False)  # no longer a stop prefix: released
    assert matcher.feed("done <|") == ("done ", False)
    assert matcher.flush() == "<|"


def test_no_stop_strings_passes_text_through() -> None:
    matcher = StopStringMatcher([])
    assert matcher.feed("anything") == ("anything", False)
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(["ok", ""])


def test_random_chunking_matches_reference() -> None:
    rng = random.Random(2)
    stops = ["ab", "cab", "日本🙂", "zzz"]
    for _ in range(300):
        text = "".join(rng.choice("abcz日本🙂 ") for _ in range(rng.randint(0, 30)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(1, 6))))
        chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        matcher = StopStringMatcher(stops)
        max_held = max(map(len, stops)) - 1
        emitted, fed = [], 0
        for chunk in chunks:
            out, matched = matcher.feed(chunk)
            emitted.append(out)
            fed += len(chunk)
            if matched:
                break
            assert fed - len("".join(emitted)) <= max_held  # holds back at most that much
        starts = [i for i in (text.find(s) for s in stops) if i != -1]
        expected = text[: min(starts)] if starts else text
        result, matched = _feed_all(StopStringMatcher(stops), chunks)
        assert (result, matched) == (expected, bool(starts))
