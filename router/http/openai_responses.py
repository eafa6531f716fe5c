"""OpenAI response bodies and stream chunks from the router's GenerateResponses.

```
completions   {"id", "object": "text_completion", "created", "model",
               "choices": [{"index", "text", "logprobs", "finish_reason"}], "usage"}
chat          {"id", "object": "chat.completion", ..., "choices": [{"index",
               "message": {"role": "assistant", "content"}, "logprobs", "finish_reason"}]}
              (with tools: tools/tool_output.py's tool_calls and finish_reason "tool_calls")
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
from router.http.tools.tool_output import ToolOutput


class ChoiceState:
    """One choice's output so far."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.logprobs: list[generation_pb2.TokenLogprob] = []
        self.token_ids: list[int] = []
        self.prompt_logprobs: list[generation_pb2.TokenLogprob] = []  # prompt tokens 2..n
        self.finish_reason: str | None = None
        self.completion_tokens = 0
        self.cached_tokens = 0

    def add(self, response: generation_pb2.GenerateResponse) -> None:
        self.text.append(response.text)
        self.token_ids.extend(response.token_ids)
        self.logprobs.extend(response.logprobs)
        self.prompt_logprobs.extend(response.prompt_logprobs)
        if response.finish_reason:
            self.finish_reason = response.finish_reason
            self.completion_tokens = response.usage.completion_tokens
            self.cached_tokens = response.usage.cached_tokens


class ResponseBuilder:
    def __init__(
        self,
        parsed: OpenAIRequest,
        request_id: str,
        prompts: Sequence[Sequence[int]],
        tokenizer: Tokenizer | None,
    ) -> None:
        self._parsed = parsed
        self._id = request_id
        self._prompts = prompts  # each choice's prompt token ids
        self._prompt_lens = [len(p) for p in prompts]
        self._started = [False] * len(prompts)  # a stream's first chunk of the choice went out
        self._tokenizer = tokenizer
        self._created = int(time.time())
        self._object = "chat.completion" if parsed.chat else "text_completion"
        self._text_offsets = [0] * len(prompts)  # completions logprobs, per choice
        tools = parsed.tools if parsed.chat else None  # chat with tools: their output shape
        self._tools = [ToolOutput(tools) for _ in prompts] if tools is not None else None

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = self._object + (".chunk" if chunk and self._parsed.chat else "")
        return {"id": self._id, "object": kind, "created": self._created,
                "model": self._parsed.model}  # fmt: skip

    def full_response(self, states: Sequence[ChoiceState]) -> dict[str, Any]:
        choices = []
        for index, state in enumerate(states):
            text = "".join(state.text)
            choice: dict[str, Any] = {"index": index}
            finish_reason = state.finish_reason
            if self._tools is not None:
                choice["message"], finish_reason = self._tools[index].message(text, finish_reason)
            elif self._parsed.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            self._add_logprobs(choice, index, state.logprobs, state.prompt_logprobs)
            choice["finish_reason"] = finish_reason
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
        finish_reason = response.finish_reason or None
        if self._tools is not None:
            choice["delta"], finish_reason = self._tools[index].delta(response.text, finish_reason)
        elif self._parsed.chat:
            choice["delta"] = {"content": response.text} if response.text else {}
        else:
            choice["text"] = response.text
        first, self._started[index] = not self._started[index], True
        prompt_logprobs = response.prompt_logprobs if first else None
        self._add_logprobs(choice, index, response.logprobs, prompt_logprobs)
        choice["finish_reason"] = finish_reason
        return self._chunk_body([choice])

    def with_usage(self, chunk: dict[str, Any], states: Sequence[ChoiceState]) -> dict[str, Any]:
        """The chunk, with the usage so far when the stream asked for it on every chunk."""
        if self._parsed.continuous_usage:
            chunk["usage"] = self._usage(states)
        return chunk

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
        completion_tokens = sum(s.completion_tokens or len(s.token_ids) for s in states)
        cached = sum(states[i].cached_tokens for i in range(0, len(states), max(1, n)))
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _add_logprobs(
        self,
        choice: dict[str, Any],
        index: int,
        logprobs: Sequence[generation_pb2.TokenLogprob],
        prompt: Sequence[generation_pb2.TokenLogprob] | None,
    ) -> None:
        """The choice's logprobs; with echo (prompt not None: its first chunk, or the whole
        answer) the prompt and its logprobs come first; vLLM's prompt_logprobs when asked."""
        parsed = self._parsed
        echo = parsed.echo and prompt is not None
        if echo:
            prompt_text = self._prompt_text(index)
            choice["text"] = prompt_text + choice["text"]
        if parsed.logprobs is None:
            choice["logprobs"] = None
        elif parsed.chat:
            choice["logprobs"] = {"content": [self._chat_logprob(lp) for lp in logprobs]}
        else:
            entries: list[generation_pb2.TokenLogprob | None] = list(logprobs)
            if echo and prompt is not None:
                entries = [None, *prompt, *logprobs]  # the first prompt token has none
            choice["logprobs"] = self._completion_logprobs(index, entries)
        if parsed.prompt_logprobs and prompt is not None:
            choice["prompt_logprobs"] = [None, *(self._vllm_entry(lp) for lp in prompt)]

    def _prompt_text(self, index: int) -> str:
        request = self._parsed.choices[index].request
        if request.WhichOneof("input") == "prompt":
            return request.prompt
        return self._text(self._prompts[index])

    def _completion_logprobs(
        self, index: int, logprobs: Sequence[generation_pb2.TokenLogprob | None]
    ) -> dict[str, Any]:
        """OpenAI's completions logprobs; a None entry: the prompt's first token (no logprob)."""
        tokens, offsets = [], []
        for lp in logprobs:
            token_id = self._prompts[index][0] if lp is None else lp.token_id
            token = self._token_text(token_id)
            tokens.append(token)
            offsets.append(self._text_offsets[index])
            self._text_offsets[index] += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [None if lp is None else lp.logprob for lp in logprobs],
            "top_logprobs": [
                None if lp is None else {self._token_text(t.token_id): t.logprob for t in lp.top}
                for lp in logprobs
            ],
            "text_offset": offsets,
        }

    def _vllm_entry(self, lp: generation_pb2.TokenLogprob) -> dict[str, Any]:
        """vLLM's prompt_logprobs entry: token id -> logprob, rank (top entries), text."""
        entry = {str(lp.token_id): {"logprob": lp.logprob, "decoded_token":
                                    self._token_text(lp.token_id)}}  # fmt: skip
        for rank, top in enumerate(lp.top, 1):
            key = str(top.token_id)
            entry.setdefault(key, {"logprob": top.logprob,
                                   "decoded_token": self._token_text(top.token_id)})  # fmt: skip
            entry[key]["rank"] = rank
        return entry

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

    def _text(self, token_ids: Sequence[int]) -> str:
        if self._tokenizer is None:
            return "".join(f"token_id:{t}" for t in token_ids)
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=False)
