"""Turns one step's logits into next tokens, one row per request, vectorized over the batch.

```
logits [num_reqs, vocab] (raw)
  ├─ repetition penalty (prompt + output), presence / frequency penalties (output; a token
  │  still pending on the device under async scheduling is counted there: DeviceTokens)
  ├─ logit_bias: each request's bias added to its tokens' logits
  ├─ min_tokens: EOS and stop_token_ids masked while the output is shorter
  ├─ grammar mask (structured outputs): the tokens a row's grammar refuses -> -inf
  │  (GrammarMask, built on the host by engine/structured/ and copied once per step)
  ├─ greedy rows: argmax                      (all greedy, no penalties: argmax alone)
  ├─ random rows: / temperature -> top-k -> top-p -> softmax -> min-p
  │               -> argmax(probs / Exp(1) noise)
  │               noise: one batched draw for unseeded rows; a seeded row's noise for output
  │               index n comes from a generator seeded with (seed, n)
  └─ rows that asked for logprobs: log_softmax of the RAW logits -> logprob, rank, top-n
  -> one device-to-host copy: the ids (and the logprobs, packed with them)
```

Everything runs on the logits' device for the whole batch; host lists enter through pinned,
non-blocking copies, so the only sync of a step is the copy of its results.

Seeded draws depend only on (seed, n, vocab size, device type), so a seeded request gets the
same tokens alone, in any batch, after preemption, or after a hand-off to another engine.

Parts: the penalties and masks (`logits_processors.py`), the host <-> device copies
(`host_copy.py`), what a launch returns and the logprobs' packing (`sampler_output.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.host_copy import HostCopy, on_device
from engine.logits_processors import (
    apply_logit_bias,
    apply_min_p,
    apply_min_tokens,
    apply_penalties,
    apply_top_k_top_p,
)
from engine.request import Request
from engine.sampler_output import PendingSample, SamplerOutput, with_logprobs
from engine.scheduler_output import DeviceTokens
from engine.structured import GrammarMask, apply_grammar_mask

_MASK64 = (1 << 64) - 1
_MIN_TEMPERATURE = 1e-5


def seeded_generator_seed(seed: int, output_index: int) -> int:
    """The generator seed for a seeded request's draw at `output_index`: (seed, n) mixed
    through splitmix64, so nearby seeds and indices give unrelated noise."""
    x = (seed * 1_000_003 + output_index + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class Sampler:
    """Samples one token per request from `[num_reqs, vocab]` float32 logits (CPU or CUDA)."""

    def __init__(self, seed: int = 0) -> None:
        self._seed = seed  # unseeded draws: one generator per device, seeded once
        self._unseeded: dict[torch.device, torch.Generator] = {}
        self._seeded: dict[torch.device, torch.Generator] = {}  # reseeded for every draw

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> SamplerOutput:
        """Sample and wait for the result (one copy to the host)."""
        return self.launch(logits, requests).result()

    def launch(
        self,
        logits: torch.Tensor,
        requests: Sequence[Request],
        pending: DeviceTokens | None = None,
        grammar_mask: GrammarMask | None = None,
    ) -> PendingSample:
        """Queue the sampling of every row on the logits' device and the one copy of its
        results to the host; `PendingSample.result()` waits for them. Reads each request's
        params and `num_sampled_tokens` now (the caller may then mark the tokens pending);
        `pending`: the previous step's ids, where a penalized request's pending token is;
        `grammar_mask`: the constrained rows' allowed tokens (structured outputs)."""
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise ValueError(
                f"logits must be [num_reqs, vocab] with one row per request; got shape "
                f"{tuple(logits.shape)} for {len(requests)} requests"
            )
        raw_logits = logits
        logits = apply_penalties(logits.float(), requests, pending)
        logits = apply_logit_bias(logits, requests)
        logits = apply_min_tokens(logits, requests)
        if grammar_mask is not None:
            logits = apply_grammar_mask(logits, grammar_mask)
        random_rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if random_rows:
            token_ids = self._sample_random_rows(logits, requests, random_rows)
        else:
            token_ids = logits.argmax(dim=-1)  # [num_reqs]
        logprob_rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        if not logprob_rows:
            num_reqs = len(requests)
            return PendingSample(
                token_ids, HostCopy(token_ids),
                lambda ids: SamplerOutput(ids, [None] * num_reqs),
            )  # fmt: skip
        return with_logprobs(raw_logits, token_ids, requests, logprob_rows)

    def _sample_random_rows(
        self, logits: torch.Tensor, requests: Sequence[Request], random_rows: list[int]
    ) -> torch.Tensor:
        """Token ids for all rows: argmax for greedy rows, a random draw for `random_rows`."""
        if len(random_rows) == len(requests):
            return self._sample(logits, requests)
        row_idx = on_device(random_rows, logits.device)
        sampled = self._sample(logits[row_idx], [requests[i] for i in random_rows])
        return logits.argmax(dim=-1).index_copy(0, row_idx, sampled)  # [num_reqs]

    def _sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, then the exponential race. All rows random."""
        device, vocab_size = logits.device, logits.shape[1]
        params = [r.sampling_params for r in requests]
        temperature = on_device([p.temperature for p in params], device)
        # Clamped so that a vanishing temperature cannot overflow the scaled logits.
        temperature = temperature.clamp_min(_MIN_TEMPERATURE)
        logits = logits / temperature.unsqueeze(1)  # [num_rows, vocab]
        top_k = top_p = None
        if any(p.top_k > 0 for p in params):
            k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
            top_k = on_device(k, device)
        if any(p.top_p < 1.0 for p in params):
            top_p = on_device([p.top_p for p in params], device)
        if top_k is not None or top_p is not None:
            logits = apply_top_k_top_p(logits, top_k, top_p)
        probs = logits.softmax(dim=-1)  # [num_rows, vocab]
        if any(p.min_p > 0.0 for p in params):
            probs = apply_min_p(probs, on_device([p.min_p for p in params], device))
        noise = self._exponential_noise(probs, requests)  # [num_rows, vocab]
        return (probs / noise).argmax(dim=-1)

    def _exponential_noise(self, probs: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """Exp(1) noise shaped like probs: argmax(probs / noise) samples from probs. Seeded
        rows draw their own row from (seed, output index); the rest share one batched draw."""
        device = probs.device
        noise = torch.empty_like(probs)
        seeded_rows = [
            (i, seed)
            for i, r in enumerate(requests)
            if (seed := r.sampling_params.seed) is not None
        ]
        if len(seeded_rows) < len(requests):
            noise.exponential_(generator=self._generator(self._unseeded, device, self._seed))
        generator = self._generator(self._seeded, device, 0)
        for i, row_seed in seeded_rows:
            seed = seeded_generator_seed(row_seed, requests[i].num_sampled_tokens)
            generator.manual_seed(seed)
            noise[i].exponential_(generator=generator)  # in place: the row is contiguous
        # exponential_ may return exactly 0; keep the division finite.
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)

    @staticmethod
    def _generator(cache: dict, device: torch.device, seed: int) -> torch.Generator:
        generator = cache.get(device)
        if generator is None:
            generator = cache[device] = torch.Generator(device=device)
            generator.manual_seed(seed)
        return generator
