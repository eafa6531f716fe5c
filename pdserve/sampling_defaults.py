"""A model's sampling defaults: what a request field the client left unset becomes, in every
entry point (the router: gRPC and HTTP; `LLM`, pd-generate), as vLLM's
`--generation-config auto`.

```
generation_config.json ──sampling_defaults──► {"temperature": 0.6, "top_p": 0.95, ...}
    (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens -> max_tokens)
an alias whose files set none ──ALIAS_SAMPLING──► its model card's
node: NodeInfo.default_sampling (defaults_to_proto) ──► router: defaults_from_proto ──►
    SamplingParams.from_proto(request.sampling, defaults)
default_help(name)   how a sampling flag's --help names its default
```
Torch-free.
"""

from __future__ import annotations

from typing import Any

from pdserve.sampling_params import SamplingParams
from pdserve.v1 import node_pb2

# generation_config.json key -> SamplingParams field (the keys vLLM's --generation-config auto
# reads)
GENERATION_CONFIG_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
SamplingDefaults = dict[str, float | int]  # field -> value, e.g. {"temperature": 0.2}
# Model alias -> sampling defaults, for those whose files set none. SmolLM2-135M-Instruct (the
# default model): its GGUF has no sampling metadata and its generation_config.json only
# bos/eos; its model card (huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct, "How to use")
# samples with temperature=0.2, top_p=0.9 (at 1.0 its chat and haiku answers are gibberish).
ALIAS_SAMPLING: dict[str, SamplingDefaults] = {"smollm2-135m": {"temperature": 0.2, "top_p": 0.9}}


def sampling_defaults(generation_config: dict[str, Any]) -> SamplingDefaults:
    """The sampling defaults a model's generation_config.json sets (numbers only; the rest
    is ignored)."""
    defaults: SamplingDefaults = {}
    for key, name in GENERATION_CONFIG_KEYS.items():
        value = generation_config.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            defaults[name] = int(value) if name in ("top_k", "max_tokens") else float(value)
    return defaults


def defaults_to_proto(defaults: SamplingDefaults) -> node_pb2.NodeSamplingParams:
    """A NodeInfo's `default_sampling`: the fields `defaults` sets."""
    proto = node_pb2.NodeSamplingParams()
    for name, value in defaults.items():
        setattr(proto, name, value)
    return proto


def defaults_from_proto(proto: node_pb2.NodeSamplingParams) -> SamplingDefaults:
    """The fields a NodeInfo's `default_sampling` sets."""
    return {name: getattr(proto, name) for name in GENERATION_CONFIG_KEYS.values()
            if proto.HasField(name)}  # fmt: skip


def default_help(name: str) -> str:
    """How a sampling flag's help names its default: the model's, else SamplingParams'."""
    own = getattr(SamplingParams, name)
    own_text = "none" if own is None else f"{own}"
    if name not in GENERATION_CONFIG_KEYS.values():
        return f"default: {own_text}"
    cards = [f"{d[name]:g} for {alias}" for alias, d in ALIAS_SAMPLING.items() if name in d]
    model = f"the model's ({', '.join(cards)}), else" if cards else "the model's, else"
    return f"default: {model} {own_text}"
