"""Per-request sampling parameters (vLLM-compatible names and defaults), and their wire form.

generation_pb2.SamplingParams ──SamplingParams.from_proto──► SamplingParams (validated)
SamplingParams ──to_proto(node_pb2.NodeSamplingParams)──► what the nodes receive
node_pb2.NodeSamplingParams ──SamplingParams.from_proto──► the engine's SamplingParams

Structured outputs (`structured_output`, pdserve/structured_output.py), `logit_bias` and
`prompt_logprobs` are validated here too, without the engine: the router refuses what no node
could serve (a token id beyond the vocabulary is the engine's check).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, TypeVar

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from pdserve.errors import InvalidRequestError
from pdserve.structured_output import StructuredOutputParams
from pdserve.v1 import generation_pb2, node_pb2

# proto3 `optional` fields of both SamplingParams messages: unset means "the default".
OPTIONAL_PROTO_FIELDS = (
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
    "prompt_logprobs",
    "speculative",
)
# The two wire forms: the client's (with stop strings) and the one nodes receive.
ProtoT = TypeVar("ProtoT", generation_pb2.SamplingParams, node_pb2.NodeSamplingParams)
_INT_TYPE_RANGES = {
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
}


def int_field_range(message_type: type[Message], name: str) -> tuple[int, int]:
    """(lowest, highest) integer a message's integer field (or each element of a repeated
    one) can hold, from its protobuf type: what an API can check before building the message
    (protobuf raises a bare ValueError beyond it)."""
    return _INT_TYPE_RANGES[message_type.DESCRIPTOR.fields_by_name[name].type]


_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


MAX_LOGPROBS = 20  # logprobs and prompt_logprobs: top-n alternatives at most
MAX_LOGIT_BIAS = 1024  # logit_bias entries
MAX_ABS_LOGIT_BIAS = 100.0
__all__ = ["InvalidRequestError", "SamplingParams", "StructuredOutputParams", "int_field_range"]


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # in (0, 1]
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0  # in [0, 1]
    repetition_penalty: float = 1.0  # > 0; 1 disables
    presence_penalty: float = 0.0  # in [-2, 2]
    frequency_penalty: float = 0.0  # in [-2, 2]
    seed: int | None = None  # same tokens for the same seed, whatever else is in the batch
    stop: list[str] = field(default_factory=list)  # stop strings, excluded from the output text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None: none; 0: sampled token only; n: plus top-n alternatives
    # vLLM's: each prompt token's logprob given its prefix (the first: None) and top-n at each
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    structured_output: StructuredOutputParams | None = None  # the output must match it
    # False: no draft tokens are verified for this request, where the engine speculates
    # (engine/spec_decode); the output distribution is the same either way.
    speculative: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self.logit_bias = dict(self.logit_bias)
        self.validate()

    @classmethod
    def from_proto(
        cls,
        proto: generation_pb2.SamplingParams | node_pb2.NodeSamplingParams,
        defaults: dict[str, float | int] | None = None,
    ) -> SamplingParams:
        """From a `SamplingParams` (client) or `NodeSamplingParams` (nodes) message: the fields
        it sets; unset optional ones take `defaults` (the model's: pdserve.sampling_defaults),
        else the dataclass's. Raises InvalidRequestError."""
        kwargs: dict[str, Any] = dict(defaults or {})
        kwargs.update(
            {name: getattr(proto, name) for name in OPTIONAL_PROTO_FIELDS if proto.HasField(name)}
        )
        for name, value in kwargs.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise InvalidRequestError(
                    f"sampling.{name} must be a finite number, got {value}", name
                )
        if isinstance(proto, generation_pb2.SamplingParams):
            kwargs["stop"] = list(proto.stop)
        if proto.HasField("structured_output"):
            kwargs["structured_output"] = StructuredOutputParams.from_proto(proto.structured_output)
        return cls(
            **kwargs,
            stop_token_ids=list(proto.stop_token_ids),
            ignore_eos=proto.ignore_eos,
            logit_bias=dict(proto.logit_bias),
        )

    def to_proto(self, message_type: type[ProtoT]) -> ProtoT:
        """Every value explicit (None ones unset), so the receiver samples with exactly these;
        stop strings only where the message has them."""
        values = {name: getattr(self, name) for name in OPTIONAL_PROTO_FIELDS}
        message = message_type(
            **{name: value for name, value in values.items() if value is not None},
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
        )
        if isinstance(message, generation_pb2.SamplingParams):
            message.stop.extend(self.stop)
        message.logit_bias.update(self.logit_bias)
        if self.structured_output is not None:
            message.structured_output.CopyFrom(self.structured_output.to_proto())
        return message

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Repetition, presence or frequency penalty: sampling reads the output so far."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def validate(self) -> None:
        def bad(param: str, msg: str) -> InvalidRequestError:
            return InvalidRequestError(msg, param)

        for name in _FLOAT_FIELDS:
            if not math.isfinite(getattr(self, name)):
                raise bad(name, f"{name} must be a finite number, got {getattr(self, name)}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise bad(
                "temperature", f"temperature must be >= 0 (0 means greedy), got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise bad(
                "top_k", f"top_k must be -1 or 0 (disabled) or a positive integer, got {self.top_k}"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise bad(
                "repetition_penalty",
                f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty}",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise bad(name, f"{name} must be in [-2, 2], got {value}")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise bad(
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise bad(name, f"{name} must be between 0 and {MAX_LOGPROBS}, got {value}")
        if any(not s for s in self.stop):
            raise bad("stop", "stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "stop_token_ids must be non-negative token ids")
        self._validate_logit_bias()
        if self.structured_output is not None and not isinstance(
            self.structured_output, StructuredOutputParams
        ):
            raise bad("structured_output", "structured_output must be a StructuredOutputParams")

    def _validate_logit_bias(self) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(
                f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS}",
                "logit_bias",
            )
        for token_id, bias in self.logit_bias.items():
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise InvalidRequestError(
                    f"logit_bias keys must be token ids (integers >= 0), got {token_id!r}",
                    "logit_bias",
                )
            if (
                isinstance(bias, bool)
                or not isinstance(bias, int | float)
                or not -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS
            ):
                raise InvalidRequestError(
                    f"logit_bias[{token_id}] must be a number in [-100, 100], got {bias!r}",
                    "logit_bias",
                )
