"""The drafts a prefill node sends with the first token (issue 36, under PD): the decode node
hands them to `EngineCore.add_prefilled`, so its first step for the request is a verify step.

```
prefill node: first token x sampled  -> first_drafts(config, request, x)
              n-gram prompt lookup over prompt + [x] (the decode node's proposer would find
              the same drafts from the same tokens)
              -> PrefillFirstToken / transfer FirstToken .draft_token_ids
decode node:  add_prefilled(..., draft_token_ids) -> the first step verifies them
```

Only n-gram drafts travel: a draft model's drafts would need its KV sent with the target's
(not built), so with `--speculative-method draft` none is sent and the decode node proposes its
own from its first step on. Nothing is sent for a request that does not speculate (opted out,
or constrained), nor when the first token already finishes it. Migration needs no state: the
n-gram proposer reads the request's tokens, which a migrated request brings.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.model.arch_config import ModelArchConfig
from engine.request import Request
from engine.spec_decode.ngram_proposer import ngram_lookup
from engine.spec_decode.spec_decoder import SpecDecoder
from pdserve.config import SpeculativeConfig


def first_drafts(config: SpeculativeConfig, request: Request, first_token: int) -> list[int]:
    """Up to K drafts after `first_token` for `request` (its prompt's tokens); [] when none."""
    if config.speculative_method != "ngram" or not SpecDecoder.speculates(request):
        return []
    k = min(config.num_speculative_tokens, request.sampling_params.max_tokens - 2)
    if k < 1 or first_token in request.eos_token_ids:
        return []
    tokens = np.asarray([*request.prompt_token_ids, first_token], dtype=np.int64)
    found = ngram_lookup(tokens, config.ngram_prompt_lookup_min, config.ngram_prompt_lookup_max, k)
    return [int(t) for t in found.tolist()]


def checked_drafts(
    draft_token_ids: Sequence[int], spec: SpecDecoder, arch: ModelArchConfig
) -> list[int]:
    """Drafts a peer handed in, as the engine verifies them: at most K, and none when any is
    not a token of this model (drafts are hints: the output does not depend on them)."""
    if any(not 0 <= t < arch.vocab_size for t in draft_token_ids):
        return []
    return list(draft_token_ids[: spec.num_speculative_tokens])
