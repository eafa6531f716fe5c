"""The offline API (vLLM-like): `LLM(model=...).generate(prompts, params)`.

prompts (text or token ids) -> Tokenizer.encode
    -> EngineCore.structured.compile (structured outputs: the grammar, compiled once, cached)
    -> EngineCore.make_request -> EngineCore.add_request
loop EngineCore.step():
    new tokens -> IncrementalDetokenizer -> StopStringMatcher (a match aborts the request)
-> one RequestOutput per prompt, in prompt order
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from engine.engine_core import EngineCore
from engine.outputs import RequestOutput, StepOutput
from engine.request import FinishReason
from pdserve.config import DEFAULT_MODEL, EngineConfig
from pdserve.detokenizer import IncrementalDetokenizer, StopStringMatcher
from pdserve.sampling_params import InvalidRequestError, SamplingParams
from pdserve.tokenizer import Tokenizer

Prompt = str | Sequence[int]


@dataclass
class _Tracked:
    output: RequestOutput
    detokenizer: IncrementalDetokenizer | None
    stop_matcher: StopStringMatcher | None


class LLM:
    def __init__(
        self, model: str = DEFAULT_MODEL, device: str = "auto", dtype: str = "auto", **kwargs: Any
    ) -> None:
        """`kwargs`: any other field of EngineConfig's sections by name (`block_size`,
        `max_num_seqs`, `kv_cache_memory`, `gpu_memory_utilization`, ...; pdserve/config.py)."""
        config = EngineConfig.from_kwargs(model=model, device=device, dtype=dtype, **kwargs)
        self.engine = EngineCore(config)
        tokenizer_dir = self.engine.loaded.tokenizer_dir
        self.tokenizer = Tokenizer.from_dir(tokenizer_dir) if tokenizer_dir else None
        self._ids = itertools.count()

    def default_sampling_params(self) -> SamplingParams:
        """The model's sampling defaults (its generation config's, or its model card's;
        engine/model/sources.py), what `generate` and `chat` use without sampling params."""
        return SamplingParams(**self.engine.loaded.sampling_defaults)  # type: ignore[arg-type]

    def close(self) -> None:
        """Stop the engine's tensor-parallel worker ranks (nothing to do at TP 1); they also
        exit with this process."""
        self.engine.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (strings, or lists of token ids) in one continuous batch."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [cast(Prompt, prompts)]  # a single prompt
        prompts = cast(Sequence[Prompt], prompts)
        if sampling_params is None:
            sampling_params = self.default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise InvalidRequestError(
                f"got {len(prompts)} prompts but {len(sampling_params)} sampling params"
            )
        # Validate everything before admitting anything, so a bad prompt adds nothing.
        requests = [
            self._make_request(prompt, params) for prompt, params in zip(prompts, sampling_params)
        ]
        tracked: dict[str, _Tracked] = {}
        for request, prompt in zip(requests, prompts):
            tracked[request.request_id] = self._track(request, prompt)
            self.engine.add_request(request)
        while self.engine.has_unfinished():
            for step_output in self.engine.step():
                self._apply(tracked[step_output.request_id], step_output)
        return [tracked[r.request_id].output for r in requests]

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate."""
        tokenizer = self._require_tokenizer()
        one = bool(messages) and isinstance(messages[0], dict)  # a single conversation
        conversations = cast(Sequence[list[dict[str, Any]]], [messages] if one else messages)
        prompts: list[Prompt] = [tokenizer.apply_chat_template(list(m)) for m in conversations]
        return self.generate(prompts, sampling_params)

    # ---- internals ------------------------------------------------------------------------

    def _make_request(self, prompt: Prompt, params: SamplingParams):
        if isinstance(prompt, str):
            token_ids = self._require_tokenizer().encode(prompt)
        else:
            token_ids = [int(t) for t in prompt]
        grammar = self.engine.structured.compile(params)  # None when unconstrained
        return self.engine.make_request(str(next(self._ids)), token_ids, params, grammar=grammar)

    def _track(self, request, prompt: Prompt) -> _Tracked:
        output = RequestOutput(
            request_id=request.request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=list(request.prompt_token_ids),
            logprobs=[] if request.sampling_params.logprobs is not None else None,
        )
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids)
        stop = request.sampling_params.stop
        matcher = StopStringMatcher(stop) if stop and detokenizer is not None else None
        return _Tracked(output, detokenizer, matcher)

    def _apply(self, tracked: _Tracked, step_output: StepOutput) -> None:
        output = tracked.output
        output.num_cached_tokens = step_output.num_cached_tokens
        if step_output.prompt_logprobs is not None:
            output.prompt_logprobs = step_output.prompt_logprobs
        token_ids = step_output.new_token_ids
        text, num_kept, matched = self._text(tracked, token_ids, step_output.finished)
        output.token_ids.extend(token_ids[:num_kept])
        if output.logprobs is not None and step_output.new_logprobs:
            output.logprobs.extend(step_output.new_logprobs[:num_kept])
        output.text += text
        if matched:
            output.finish_reason = FinishReason.STOP.value
            self.engine.abort(output.request_id)
        elif step_output.finish_reason is not None:
            output.finish_reason = step_output.finish_reason.value

    @staticmethod
    def _text(tracked: _Tracked, token_ids: list[int], finished: bool) -> tuple[str, int, bool]:
        """(the text `token_ids` add, how many of them to keep, whether a stop string
        matched). With stop strings, the tokens go through one at a time: a step may bring
        several (a speculative verify step's accepted run), and a match ends the output at the
        token that completed it, the tokens after it dropped."""
        detokenizer, matcher = tracked.detokenizer, tracked.stop_matcher
        if detokenizer is None:
            return "", len(token_ids), False
        pieces = [[t] for t in token_ids] if matcher is not None and token_ids else [token_ids]
        texts: list[str] = []
        for i, piece in enumerate(pieces):
            text = detokenizer.update(piece)
            last = i == len(pieces) - 1
            if finished and last:
                text += detokenizer.flush()
            if matcher is not None:
                text, matched = matcher.feed(text)
                if matched:
                    return "".join(texts) + text, i + 1, True
                if finished and last:
                    text += matcher.flush()
            texts.append(text)
        return "".join(texts), len(token_ids), False

    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise InvalidRequestError(
                "this model has no tokenizer (synthetic weights): pass prompts as token-id lists"
            )
        return self.tokenizer
