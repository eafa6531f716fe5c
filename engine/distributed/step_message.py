"""`StepMessage`: what rank 0 hands the other ranks once per step, as bytes.

```
header  int64 [kind, num_ints, num_arrays, extras_bytes, ints..., array lengths...]
arrays  int64, concatenated (the step's host inputs: engine/step_inputs.py's HostStep)
extras  pickle of a small object (the prefill record a worker's layer hook gets), or nothing
```

The engine says what the ints and arrays mean (engine/model_runner.py); this module only moves
them. Decoding gives views into the received bytes (no copy).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import numpy as np

_STEP, _STOP = 1, 2
_HEADER_FIELDS = 4


@dataclass(frozen=True)
class StepMessage:
    ints: tuple[int, ...]
    arrays: tuple[np.ndarray, ...]  # 1-D int64
    extras: Any = None  # picklable; None: none

    def encode(self) -> list[memoryview]:
        """The message as byte views (written in order, no concatenation)."""
        extras = b"" if self.extras is None else pickle.dumps(self.extras, protocol=5)
        header = np.array(
            [_STEP, len(self.ints), len(self.arrays), len(extras), *self.ints,
             *(a.size for a in self.arrays)],
            dtype=np.int64,
        )  # fmt: skip
        views = [header.data]
        views += [np.ascontiguousarray(a, dtype=np.int64).data for a in self.arrays]
        if extras:
            views.append(memoryview(extras))
        return views

    @staticmethod
    def decode(data: bytearray) -> StepMessage | None:
        """The message `encode` wrote, or None for `STOP`."""
        kind, num_ints, num_arrays, extras_bytes = np.frombuffer(data, np.int64, _HEADER_FIELDS)
        if kind == _STOP:
            return None
        if kind != _STEP:
            raise ValueError(f"not a step message (kind {kind})")
        meta = np.frombuffer(data, np.int64, num_ints + num_arrays, 8 * _HEADER_FIELDS)
        offset = 8 * (_HEADER_FIELDS + num_ints + num_arrays)
        arrays = []
        for size in meta[num_ints:].tolist():
            arrays.append(np.frombuffer(data, np.int64, size, offset))
            offset += 8 * size
        extras = pickle.loads(data[offset : offset + extras_bytes]) if extras_bytes else None
        return StepMessage(tuple(meta[:num_ints].tolist()), tuple(arrays), extras)


STOP: list[memoryview] = [np.array([_STOP, 0, 0, 0], dtype=np.int64).data]
