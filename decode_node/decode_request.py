"""What a suffix reservation looks up (checked first: decode_checks.py).

```
prefix_lookup(engine, request, params) -> Request | None
    what a suffix reservation looks up in the prefix cache (KVSuffix): the prompt with its
    cache salt, hashed here rather than on the engine thread; no grammar (a lookup plays no
    part in decoding); None when the engine refuses it (the Decode's own request says why)
```
"""

from __future__ import annotations

import dataclasses

from engine.async_engine import AsyncEngine
from engine.request import Request
from pdserve.sampling_params import SamplingParams
from pdserve.v1 import node_pb2


def prefix_lookup(
    engine: AsyncEngine, request: node_pb2.DecodeRequest, params: SamplingParams
) -> Request | None:
    """See the module doc."""
    try:
        lookup = engine.make_request(
            request.request_id, request.prompt_token_ids,
            dataclasses.replace(params, structured_output=None), request.cache_salt,
        )  # fmt: skip
    except ValueError:
        return None
    engine.hash_prompt_ahead(lookup)
    return lookup
