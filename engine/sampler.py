"""Turns one step's logits into next tokens, one row per request, vectorized over the batch.

```
logits [num_reqs, vocab] (raw)
  ├─ repetition penalty (prompt + output), presence / frequency penalties (output; a token
  │  still pending on the device under async scheduling is counted there: DeviceTokens)
  ├─ min_tokens: EOS and stop_token_ids masked while the output is shorter
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
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.request import Request, TokenLogprobs
from engine.scheduler_output import DeviceTokens

_MASK64 = (1 << 64) - 1
_MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]  # one per request, in batch order
    logprobs: list[TokenLogprobs | None]  # None for requests that did not ask


def seeded_generator_seed(seed: int, output_index: int) -> int:
    """The generator seed for a seeded request's draw at `output_index`: (seed, n) mixed
    through splitmix64, so nearby seeds and indices give unrelated noise."""
    x = (seed * 1_000_003 + output_index + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _on_device(
    values: list, device: torch.device, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """A host list as a device tensor without a sync: on CUDA built in pinned memory and copied
    non-blocking (the same values and dtype `torch.tensor(values, device=device)` gives)."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def _token_counts(
    token_lists: list[list[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """How often each token occurs in each list: [len(token_lists), vocab_size] float32."""
    num_rows = len(token_lists)
    lengths = _on_device([len(t) for t in token_lists], device)  # [num_rows]
    flat_ids = _on_device(
        list(itertools.chain.from_iterable(token_lists)), device, torch.long
    )  # [total_tokens]
    # output_size known on the host: no sync to size the result
    rows = torch.repeat_interleave(
        torch.arange(num_rows, device=device), lengths, output_size=flat_ids.numel()
    )
    counts = torch.zeros(num_rows * vocab_size, dtype=torch.float32, device=device)
    counts.scatter_add_(
        0, rows * vocab_size + flat_ids, torch.ones_like(flat_ids, dtype=torch.float32)
    )
    return counts.view(num_rows, vocab_size)


def apply_penalties(
    logits: torch.Tensor, requests: Sequence[Request], pending: DeviceTokens | None = None
) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens (divides positive logits, multiplies
    negative ones), then frequency and presence penalties over output tokens (vLLM order); a
    request's output includes its token still pending on the device (async scheduling: found
    in `pending`, counted there). Only rows with a penalty are touched; returns a new tensor
    when any row is."""
    rows = [i for i, r in enumerate(requests) if r.sampling_params.has_penalties]
    if not rows:
        return logits
    counted: list[tuple[int, int]] = []  # (penalized row, row in pending.token_ids)
    for j, i in enumerate(rows):
        request = requests[i]
        if request.num_pending_tokens == 0:
            continue
        if request.num_pending_tokens > 1 or pending is None or request not in pending.rows:
            raise ValueError(
                f"request {request.request_id!r} has {request.num_pending_tokens} pending "
                "tokens: penalties need each of them on the device (pending)"
            )
        counted.append((j, pending.rows[request]))
    device, vocab_size = logits.device, logits.shape[1]
    params = [requests[i].sampling_params for i in rows]
    row_idx = _on_device(rows, device)
    penalized = logits[row_idx]  # [num_rows, vocab]
    output_counts = _token_counts([requests[i].output_token_ids for i in rows], vocab_size, device)
    if counted and pending is not None:  # the pending tokens, on the device: one more each
        at = _on_device([j for j, _ in counted], device)
        token_ids = pending.token_ids[_on_device([k for _, k in counted], device)]
        ones = torch.ones(len(counted), dtype=output_counts.dtype, device=device)
        output_counts.index_put_((at, token_ids), ones, accumulate=True)
    output_seen = output_counts > 0  # [num_rows, vocab]

    if any(p.repetition_penalty != 1.0 for p in params):
        prompt_counts = _token_counts(
            [requests[i].prompt_token_ids for i in rows], vocab_size, device
        )
        repetition = _on_device([p.repetition_penalty for p in params], device)
        repetition = torch.where(output_seen | (prompt_counts > 0), repetition.unsqueeze(1), 1.0)
        penalized = torch.where(penalized > 0, penalized / repetition, penalized * repetition)

    frequency = _on_device([p.frequency_penalty for p in params], device)
    presence = _on_device([p.presence_penalty for p in params], device)
    penalized = penalized - frequency.unsqueeze(1) * output_counts
    penalized = penalized - presence.unsqueeze(1) * output_seen
    return logits.index_copy(0, row_idx, penalized)


def apply_min_tokens(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Mask EOS (unless ignore_eos) and stop_token_ids while a request's output is shorter
    than min_tokens. Returns a new tensor when any row is masked."""
    vocab_size = logits.shape[1]
    rows: list[int] = []
    token_ids: list[int] = []
    for i, request in enumerate(requests):
        params = request.sampling_params
        if request.num_sampled_tokens >= params.min_tokens:
            continue
        banned = set(params.stop_token_ids)
        if not params.ignore_eos:
            banned.update(request.eos_token_ids)
        banned_ids = [t for t in banned if t < vocab_size]
        rows += [i] * len(banned_ids)
        token_ids += banned_ids
    if not rows:
        return logits
    index = (_on_device(rows, logits.device), _on_device(token_ids, logits.device))
    return logits.index_put(index, logits.new_full((), float("-inf")))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask with -inf what lies outside each row's top-k (ties with the k-th value kept) and
    outside its top-p nucleus (the smallest top set whose probability reaches top_p).
    top_k: [num_rows] long in [1, vocab]; top_p: [num_rows] float in (0, 1]."""
    sorted_logits, sorted_idx = logits.sort(dim=-1)  # ascending, [num_rows, vocab]
    vocab_size = logits.shape[1]
    if top_k is not None:
        kth_largest = sorted_logits.gather(1, (vocab_size - top_k).unsqueeze(1))  # [num_rows, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, float("-inf"))
    if top_p is not None:
        cum_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # ascending mass
        drop = cum_probs <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero the tokens whose probability is below min_p times the row's top probability.
    probs: [num_rows, vocab]; min_p: [num_rows]."""
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [num_rows, 1]
    return probs.masked_fill(probs < threshold, 0.0)


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
    ) -> PendingSample:
        """Queue the sampling of every row on the logits' device and the one copy of its
        results to the host; `PendingSample.result()` waits for them. Reads each request's
        params and `num_sampled_tokens` now (the caller may then mark the tokens pending);
        `pending`: the previous step's ids, where a penalized request's pending token is."""
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise ValueError(
                f"logits must be [num_reqs, vocab] with one row per request; got shape "
                f"{tuple(logits.shape)} for {len(requests)} requests"
            )
        raw_logits = logits
        logits = apply_penalties(logits.float(), requests, pending)
        logits = apply_min_tokens(logits, requests)
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
        return _with_logprobs(raw_logits, token_ids, requests, logprob_rows)

    def _sample_random_rows(
        self, logits: torch.Tensor, requests: Sequence[Request], random_rows: list[int]
    ) -> torch.Tensor:
        """Token ids for all rows: argmax for greedy rows, a random draw for `random_rows`."""
        if len(random_rows) == len(requests):
            return self._sample(logits, requests)
        row_idx = _on_device(random_rows, logits.device)
        sampled = self._sample(logits[row_idx], [requests[i] for i in random_rows])
        return logits.argmax(dim=-1).index_copy(0, row_idx, sampled)  # [num_reqs]

    def _sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, then the exponential race. All rows random."""
        device, vocab_size = logits.device, logits.shape[1]
        params = [r.sampling_params for r in requests]
        temperature = _on_device([p.temperature for p in params], device)
        # Clamped so that a vanishing temperature cannot overflow the scaled logits.
        temperature = temperature.clamp_min(_MIN_TEMPERATURE)
        logits = logits / temperature.unsqueeze(1)  # [num_rows, vocab]
        top_k = top_p = None
        if any(p.top_k > 0 for p in params):
            k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
            top_k = _on_device(k, device)
        if any(p.top_p < 1.0 for p in params):
            top_p = _on_device([p.top_p for p in params], device)
        if top_k is not None or top_p is not None:
            logits = apply_top_k_top_p(logits, top_k, top_p)
        probs = logits.softmax(dim=-1)  # [num_rows, vocab]
        if any(p.min_p > 0.0 for p in params):
            probs = apply_min_p(probs, _on_device([p.min_p for p in params], device))
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


class HostCopy:
    """A non-blocking copy of a device tensor into pinned host memory, queued now on the
    current stream; `tolist()` waits for it with the GIL released. (`tensor.tolist()` would
    hold the GIL for the step's whole GPU time, starving the node's event loop: KV sends, token
    streaming, heartbeats.) On CPU the values are taken at once."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._done: torch.cuda.Event | None = None
        if not tensor.is_cuda:
            self._host = tensor
            return
        self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._host.copy_(tensor, non_blocking=True)
        self._done = torch.cuda.Event()
        self._done.record(torch.cuda.current_stream(tensor.device))

    def tolist(self) -> list:
        if self._done is not None:
            self._done.synchronize()  # releases the GIL while it waits
        return self._host.tolist()


def to_host_list(tensor: torch.Tensor) -> list:
    """`tensor.tolist()`, waiting for a CUDA tensor with the GIL released (see `HostCopy`)."""
    return HostCopy(tensor).tolist()


@dataclass
class PendingSample:
    """A launched sampling: the ids stay on the device for the next step to read, and one copy
    brings them (with any logprobs) to the host."""

    token_ids: torch.Tensor  # [num_reqs] int64, on the logits' device
    copy: HostCopy
    unpack: Callable[[list], SamplerOutput]

    def result(self) -> SamplerOutput:
        """Wait for the copy (GIL released) and unpack it."""
        return self.unpack(self.copy.tolist())


def _with_logprobs(
    raw_logits: torch.Tensor,
    token_ids: torch.Tensor,  # [num_reqs] on the device
    requests: Sequence[Request],
    rows: list[int],  # the rows that asked for logprobs
) -> PendingSample:
    """The token ids, and for `rows` the sampled token's logprob and rank under the raw logits
    and the top-n alternatives; everything comes back to the host in one copy."""
    device, vocab_size = raw_logits.device, raw_logits.shape[1]
    row_idx = _on_device(rows, device)
    logprobs = torch.log_softmax(raw_logits[row_idx].float(), dim=-1)  # [num_rows, vocab]
    sampled = token_ids[row_idx].unsqueeze(1)  # [num_rows, 1]
    sampled_logprobs = logprobs.gather(1, sampled)  # [num_rows, 1]
    ranks = (logprobs > sampled_logprobs).sum(dim=-1, keepdim=True) + 1  # [num_rows, 1]
    counts = [requests[i].sampling_params.logprobs or 0 for i in rows]  # (all set in `rows`)
    num_top = min(max(counts), vocab_size)
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)  # [num_rows, num_top]
    # float64 holds the ids, ranks and float32 logprobs exactly: one tensor, one copy.
    packed = torch.cat(
        [token_ids.double(), sampled_logprobs.double().view(-1), ranks.double().view(-1),
         top_ids.double().view(-1), top_logprobs.double().view(-1)]
    )  # fmt: skip
    return PendingSample(
        token_ids,
        HostCopy(packed),
        lambda host: _unpack_logprobs(host, len(requests), rows, counts, num_top),
    )


def _unpack_logprobs(
    packed: list, num_reqs: int, rows: list[int], counts: list[int], num_top: int
) -> SamplerOutput:
    """`_with_logprobs`'s packed host list -> SamplerOutput."""
    num_rows = len(rows)
    ids = [int(t) for t in packed[:num_reqs]]
    sampled_list = packed[num_reqs : num_reqs + num_rows]
    ranks_list = packed[num_reqs + num_rows : num_reqs + 2 * num_rows]
    tops_start = num_reqs + 2 * num_rows
    top_ids_flat = packed[tops_start : tops_start + num_rows * num_top]
    top_lp_flat = packed[tops_start + num_rows * num_top :]
    result: list[TokenLogprobs | None] = [None] * num_reqs
    for j, (i, num) in enumerate(zip(rows, counts)):
        first = j * num_top
        result[i] = TokenLogprobs(
            token_id=ids[i],
            logprob=sampled_list[j],
            rank=int(ranks_list[j]),
            top=tuple(
                (int(t), lp)
                for t, lp in zip(
                    top_ids_flat[first : first + num], top_lp_flat[first : first + num]
                )
            ),
        )
    return SamplerOutput(ids, result)
