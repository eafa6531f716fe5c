"""Streaming token ids -> text, and stop-string matching on the streamed text. Torch-free.

```
token ids ──IncrementalDetokenizer.update──> finished text ──StopStringMatcher.feed──> client
            (holds a trailing partial UTF-8 char)         (holds a possible stop-string start;
                                                           on a match: text before it, matched)
```

The detokenizer decodes a sliding window (the tokens already emitted last time, then the new
ones) and emits the difference, as vLLM and HF's TextStreamer do: prefix tokens give the
decoder the context it needs for spacing, and a window ending in U+FFFD is a multi-byte
character still being spelled out over byte-level tokens, so it is held back.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.tokenizer import Tokenizer

_PROMPT_CONTEXT_LEN = 5  # prompt tokens decoded before the first output tokens (spacing)
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a request's output token ids into text, one `update` per step.

    Each call decodes only the window `[prefix, read) + new`: `[prefix, read)` are the tokens
    whose text was emitted last, `[read, end)` those whose text is still held."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._window = list(prompt_token_ids[-_PROMPT_CONTEXT_LEN:])  # token ids from `prefix`
        self._read_offset = len(self._window)  # window index of the first unemitted token
        self._prefix_text = self._decode(self._window)
        self._chunks: list[str] = []
        self._text = ""

    @property
    def text(self) -> str:
        """All output text emitted so far."""
        if self._chunks:
            self._text += "".join(self._chunks)
            self._chunks.clear()
        return self._text

    def update(self, new_token_ids: Sequence[int]) -> str:
        """Add the step's new tokens; return the text they finished (may be empty)."""
        pieces = []
        for token_id in new_token_ids:
            self._window.append(token_id)
            pieces.append(self._emit(final=False))
        return self._record("".join(pieces))

    def flush(self) -> str:
        """At the end of the output: the held-back text, even an incomplete character."""
        return self._record(self._emit(final=True))

    def _emit(self, final: bool) -> str:
        window_text = self._decode(self._window)
        if len(window_text) <= len(self._prefix_text):
            return ""  # e.g. a skipped special token, or bytes of one character so far
        if not final and window_text.endswith(_REPLACEMENT_CHAR):
            return ""  # a multi-byte character split across tokens: wait for its end
        new_text = window_text[len(self._prefix_text) :]
        self._window = self._window[self._read_offset :]
        self._read_offset = len(self._window)
        self._prefix_text = self._decode(self._window)
        return new_text

    def _record(self, text: str) -> str:
        if text:
            self._chunks.append(text)
        return text

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)


class StopStringMatcher:
    """Finds stop strings in streamed text. `feed` returns the text safe to emit and whether a
    stop string matched; the stop string and anything after it are never emitted."""

    def __init__(self, stop: Sequence[str]) -> None:
        if any(not s for s in stop):
            raise ValueError(f"stop strings must be non-empty, got {list(stop)!r}")
        self._stop = list(stop)
        # A trailing piece this long or shorter may be the start of a stop string.
        self._max_hold_len = max((len(s) for s in self._stop), default=1) - 1
        self._held = ""
        self.matched_stop: str | None = None  # the stop string that ended the text

    def feed(self, text: str) -> tuple[str, bool]:
        """Add new text; return (text safe to emit, whether a stop string matched)."""
        if self.matched_stop is not None:
            return "", True
        if not self._stop:
            return text, False
        buffer = self._held + text  # a match must end in `text`: it starts in held or later
        match = self._earliest_match(buffer)
        if match is not None:
            start, self.matched_stop = match
            self._held = ""
            return buffer[:start], True
        split = len(buffer) - self._hold_len(buffer)
        self._held = buffer[split:]
        return buffer[:split], False

    def flush(self) -> str:
        """At the end of the output (no match): the text held as a possible stop-string start."""
        held, self._held = self._held, ""
        return held

    def _earliest_match(self, buffer: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stop:
            start = buffer.find(stop)
            if start != -1 and (best is None or start < best[0]):
                best = (start, stop)
        return best

    def _hold_len(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of a stop string."""
        for length in range(min(self._max_hold_len, len(buffer)), 0, -1):
            suffix = buffer[-length:]
            if any(stop.startswith(suffix) for stop in self._stop):
                return length
        return 0
