"""OutputProcessor: one request's client stream, built from the tokens its nodes send.

```
NodeTokens (P's first token, D's chunks; any order, overlapping)
  └─ skip output indices already emitted (each index goes out once, from the first stream
     that has it); index 0's prompt logprobs (when asked for) go out with it
       └─ per token: IncrementalDetokenizer.update -> StopStringMatcher.feed
            ├─ no match:  token, its text (maybe held back: a partial character or a possible
            │             stop-string start) and logprobs join this chunk
            └─ match:     the text before the stop string; later tokens dropped; "stop"
  └─ the node's finish_reason: flush held text (a stop string may still match); the last
     GenerateResponse carries finish_reason and usage
```

Without a tokenizer (a model that has none) responses carry token ids and empty text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from pdserve.detokenizer import IncrementalDetokenizer, StopStringMatcher
from pdserve.tokenizer import Tokenizer
from pdserve.v1 import generation_pb2, node_pb2
from router.errors import RouterError
from router.input_processor import ProcessedRequest


@dataclass(frozen=True)
class NodeTokens:
    """Output tokens from one node stream; `token_ids[0]` is output index `output_index`."""

    output_index: int
    token_ids: Sequence[int]
    logprobs: Sequence[generation_pb2.TokenLogprob] = ()  # one per token when requested
    finish_reason: str = ""  # set when these tokens end the request
    num_cached_tokens: int = 0  # prompt tokens the node found in its prefix cache
    # with output index 0, from the node that prefilled, when prompt_logprobs was asked for
    prompt_logprobs: Sequence[generation_pb2.TokenLogprob] = ()

    @classmethod
    def of_chunk(cls, chunk: node_pb2.TokenChunk) -> NodeTokens:
        """A decode node's chunk (its repeated fields as they are: no copies)."""
        return cls(
            output_index=chunk.output_index,
            token_ids=chunk.token_ids,
            logprobs=chunk.logprobs,
            finish_reason=chunk.finish_reason,
            num_cached_tokens=chunk.num_cached_tokens,
            prompt_logprobs=chunk.prompt_logprobs,
        )

    @classmethod
    def of_first_token(cls, first: node_pb2.PrefillFirstToken) -> NodeTokens:
        """A prefill node's first token (output index 0)."""
        return cls(
            output_index=0,
            token_ids=[first.token_id],
            logprobs=[first.logprob] if first.HasField("logprob") else [],
            finish_reason=first.finish_reason,
            num_cached_tokens=first.num_cached_tokens,
            prompt_logprobs=list(first.prompt_logprobs),
        )


class OutputProcessor:
    """Turns one request's NodeTokens into GenerateResponses (`process`) until it finishes."""

    def __init__(self, request: ProcessedRequest, tokenizer: Tokenizer | None) -> None:
        self._request = request
        self._detokenizer = None
        if tokenizer is not None:
            self._detokenizer = IncrementalDetokenizer(
                tokenizer, request.prompt_token_ids, skip_special_tokens=True
            )
        self._stop_matcher = StopStringMatcher(request.sampling_params.stop)
        self._want_logprobs = request.sampling_params.logprobs is not None
        self._want_prompt_logprobs = request.sampling_params.prompt_logprobs is not None
        self.num_output_tokens = 0  # emitted so far; the next output index expected
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None  # set once the last response is built

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def process(self, tokens: NodeTokens) -> generation_pb2.GenerateResponse | None:
        """The response for the output indices of `tokens` not emitted yet; None when there is
        nothing new to send (or the request already finished)."""
        if self.finished:
            return None
        first_new = self.num_output_tokens - tokens.output_index
        if first_new < 0:
            raise RouterError(
                grpc.StatusCode.INTERNAL,
                f"request {self._request.request_id}: a node sent output index "
                f"{tokens.output_index} before index {self.num_output_tokens}",
            )
        # Nodes that ran the prefill report their prefix-cache hits; the others report 0.
        self.num_cached_tokens = max(self.num_cached_tokens, tokens.num_cached_tokens)
        response = generation_pb2.GenerateResponse(request_id=self._request.client_request_id)
        if first_new == 0 and tokens.output_index == 0 and self._want_prompt_logprobs:
            response.prompt_logprobs.extend(tokens.prompt_logprobs)  # with the first token
        texts = []
        for i in range(first_new, len(tokens.token_ids)):
            response.token_ids.append(tokens.token_ids[i])
            if self._want_logprobs and i < len(tokens.logprobs):
                response.logprobs.append(tokens.logprobs[i])
            self.num_output_tokens += 1
            text, matched = self._stop_matcher.feed(self._text(tokens.token_ids[i : i + 1]))
            texts.append(text)
            if matched:
                self.finish_reason = "stop"
                break
        if tokens.finish_reason and not self.finished:
            texts.append(self._final_text())
            self.finish_reason = self.finish_reason or tokens.finish_reason
        response.text = "".join(texts)
        if self.finished:
            response.finish_reason = self.finish_reason
            response.usage.CopyFrom(self.usage())
        elif not response.token_ids and not response.text:
            return None
        return response

    def usage(self) -> generation_pb2.Usage:
        return generation_pb2.Usage(
            prompt_tokens=self._request.prompt_len,
            completion_tokens=self.num_output_tokens,
            cached_tokens=self.num_cached_tokens,
        )

    def _text(self, token_ids: Sequence[int]) -> str:
        """The text `token_ids` add ("" without a tokenizer)."""
        return self._detokenizer.update(token_ids) if self._detokenizer is not None else ""

    def _final_text(self) -> str:
        """The text held back at the end of the output; sets "stop" if it completes a stop
        string."""
        held = self._detokenizer.flush() if self._detokenizer is not None else ""
        text, matched = self._stop_matcher.feed(held)
        if matched:
            self.finish_reason = "stop"
            return text
        return text + self._stop_matcher.flush()
