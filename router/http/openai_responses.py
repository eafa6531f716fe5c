"""OpenAI response bodies and stream chunks from the router's GenerateResponses.

```
completions   {"id", "object": "text_completion", "created", "model",
               "choices": [{"index", "text", "logprobs", "finish_reason"}], "usage"}
chat          {"id", "object": "chat.completion", ..., "choices": [{"index",
               "message": {"role": "assistant", "content"}, "logprobs", "finish_reason"}]}
stream        "text_completion" / "chat.completion.chunk" chunks (chat: a first chunk per
              choice with the role), then with include_usage a chunk with "choices": []
logprobs      completions: {tokens, token_logprobs, top_logprobs, text_offset};
              chat: {content: [{token, logprob, bytes, top_logprobs: [...]}]}
```
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from pdserve.tokenizer import Tokenizer
from pdserve.v1 import generation_pb2
from router.http.openai_protocol import OpenAIRequest


class ChoiceState:
    """One choice's output so far."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.logprobs: list[generation_pb2.TokenLogprob] = []
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.completion_tokens = 0
        self.cached_tokens = 0

    def add(self, response: generation_pb2.GenerateResponse) -> None:
        self.text.append(response.text)
        self.token_ids.extend(response.token_ids)
        self.logprobs.extend(response.logprobs)
        if response.finish_reason:
            self.finish_reason = response.finish_reason
            self.completion_tokens = response.usage.completion_tokens
            self.cached_tokens = response.usage.cached_tokens


class ResponseBuilder:
    def __init__(
        self,
        parsed: OpenAIRequest,
        request_id: str,
        prompt_lens: Sequence[int],
        tokenizer: Tokenizer | None,
    ) -> None:
        self._parsed = parsed
        self._id = request_id
        self._prompt_lens = prompt_lens
        self._tokenizer = tokenizer
        self._created = int(time.time())
        self._object = "chat.completion" if parsed.chat else "text_completion"
        self._text_offsets = [0] * len(prompt_lens)  # completions logprobs, per choice

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = self._object + (".chunk" if chunk and self._parsed.chat else "")
        return {"id": self._id, "object": kind, "created": self._created,
                "model": self._parsed.model}  # fmt: skip

    def full_response(self, states: Sequence[ChoiceState]) -> dict[str, Any]:
        choices = []
        for index, state in enumerate(states):
            text = "".join(state.text)
            choice: dict[str, Any] = {"index": index}
            if self._parsed.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choice["logprobs"] = self._logprobs(index, state.logprobs)
            choice["finish_reason"] = state.finish_reason
            choices.append(choice)
        return {**self._head(False), "choices": choices, "usage": self._usage(states)}

    def first_chunks(self) -> list[dict[str, Any]]:
        """Chat streams open each choice with its role."""
        if not self._parsed.chat:
            return []
        return [
            self._chunk_body(
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )  # fmt: skip
            for i in range(len(self._prompt_lens))
        ]

    def chunk(self, index: int, response: generation_pb2.GenerateResponse) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        if self._parsed.chat:
            choice["delta"] = {"content": response.text} if response.text else {}
        else:
            choice["text"] = response.text
        choice["logprobs"] = self._logprobs(index, response.logprobs)
        choice["finish_reason"] = response.finish_reason or None
        return self._chunk_body([choice])

    def usage_chunk(self, states: Sequence[ChoiceState]) -> dict[str, Any]:
        return {**self._head(True), "choices": [], "usage": self._usage(states)}

    def _chunk_body(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body = {**self._head(True), "choices": choices}
        if self._parsed.include_usage:
            body["usage"] = None
        return body

    def _usage(self, states: Sequence[ChoiceState]) -> dict[str, Any]:
        """Each prompt counted once (n choices share it), every choice's output tokens."""
        n = len(states) // max(1, self._parsed.num_prompts)
        prompt_tokens = sum(self._prompt_lens[i] for i in range(0, len(states), max(1, n)))
        completion_tokens = sum(s.completion_tokens for s in states)
        cached = sum(states[i].cached_tokens for i in range(0, len(states), max(1, n)))
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _logprobs(
        self, index: int, logprobs: Sequence[generation_pb2.TokenLogprob]
    ) -> dict[str, Any] | None:
        if self._parsed.logprobs is None:
            return None
        if self._parsed.chat:
            return {"content": [self._chat_logprob(lp) for lp in logprobs]}
        tokens, offsets = [], []
        for lp in logprobs:
            token = self._token_text(lp.token_id)
            tokens.append(token)
            offsets.append(self._text_offsets[index])
            self._text_offsets[index] += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [
                {self._token_text(t.token_id): t.logprob for t in lp.top} for lp in logprobs
            ],
            "text_offset": offsets,
        }

    def _chat_logprob(self, lp: generation_pb2.TokenLogprob) -> dict[str, Any]:
        entry = self._token_entry(lp.token_id, lp.logprob)
        entry["top_logprobs"] = [self._token_entry(t.token_id, t.logprob) for t in lp.top]
        return entry

    def _token_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self._token_text(token_id)
        # the token's own bytes: a piece of a multi-byte character is not its U+FFFD text's
        raw = token.encode() if self._tokenizer is None else self._tokenizer.token_bytes(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(raw)}

    def _token_text(self, token_id: int) -> str:
        if self._tokenizer is None:
            return f"token_id:{token_id}"
        return self._tokenizer.decode([token_id], skip_special_tokens=False)
