"""Wire conversions both node roles need, on plain values (torch- and engine-free).

NodeSamplingParams ──sampling_kwargs──► keyword arguments of the engine's SamplingParams
a token's log-probabilities ──token_logprob──► TokenLogprob
a model's tokenizer folder ──read_tokenizer_files──► TokenizerFiles
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from pdserve.v1 import generation_pb2, node_pb2

# proto3 `optional` fields of NodeSamplingParams: unset means "the engine's default".
OPTIONAL_SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "min_tokens",
    "logprobs",
)


class TokenLogprobsLike(Protocol):
    """What `token_logprob` reads (the engine's `TokenLogprobs` has these fields)."""

    token_id: int
    logprob: float
    rank: int
    top: Sequence[tuple[int, float]]


def sampling_kwargs(params: node_pb2.NodeSamplingParams) -> dict[str, object]:
    """Keyword arguments for the engine's SamplingParams: every field the router set (unset
    optional fields keep the engine's defaults). Raises ValueError on a non-finite number."""
    kwargs: dict[str, object] = {
        name: getattr(params, name) for name in OPTIONAL_SAMPLING_FIELDS if params.HasField(name)
    }
    for name, value in kwargs.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"sampling.{name} must be a finite number, got {value}")
    kwargs["stop_token_ids"] = list(params.stop_token_ids)
    kwargs["ignore_eos"] = params.ignore_eos
    return kwargs


def token_logprob(logprobs: TokenLogprobsLike) -> generation_pb2.TokenLogprob:
    """One sampled token's log-probability, rank and top alternatives, as sent on the wire."""
    return generation_pb2.TokenLogprob(
        token_id=logprobs.token_id,
        logprob=logprobs.logprob,
        rank=logprobs.rank,
        top=[
            generation_pb2.TopLogprob(token_id=token_id, logprob=logprob)
            for token_id, logprob in logprobs.top
        ],
    )


def read_tokenizer_files(
    folder: Path | None, chat_template: str | None = None
) -> node_pb2.TokenizerFiles:
    """`tokenizer.json` and `tokenizer_config.json` of `folder` (empty when absent: a synthetic
    model has no tokenizer, and the router can then take token ids only), and the chat template
    the node resolved (`""` when none)."""
    if folder is None:
        return node_pb2.TokenizerFiles(chat_template=chat_template or "")
    config_path = folder / "tokenizer_config.json"
    return node_pb2.TokenizerFiles(
        tokenizer_json=(folder / "tokenizer.json").read_bytes(),
        tokenizer_config_json=config_path.read_bytes() if config_path.is_file() else b"",
        chat_template=chat_template or "",
    )
