import math

import pytest
import torch

from engine.logits_processors import apply_min_tokens, apply_penalties
from engine.request import Request
from engine.sampler import Sampler
from engine.scheduler_output import DeviceTokens
from pdserve.sampling_params import SamplingParams

DEVICES = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
EOS = 3


def _request(
    params: SamplingParams, prompt: list[int] | None = None, output: list[int] | None = None
) -> Request:
    return Request(
        request_id="r",
        prompt_token_ids=prompt if prompt is not None else [0, 1, 2],
        sampling_params=params,
        eos_token_ids=(EOS,),
        output_token_ids=list(output or []),
    )


def _draws(logits_row: list[float], params: SamplingParams, num_draws: int, seed: int = 0):
    """Sample `num_draws` times from one row (as a batch of identical unseeded rows)."""
    logits = torch.tensor([logits_row]).repeat(num_draws, 1)
    requests = [_request(params) for _ in range(num_draws)]
    return torch.tensor(Sampler(seed=seed)(logits, requests).token_ids)


def _reference_penalties(row: torch.Tensor, request: Request) -> torch.Tensor:
    """One row, token by token, straight from the definitions."""
    params, row = request.sampling_params, row.clone()
    for token in set(request.prompt_token_ids) | set(request.output_token_ids):
        penalty = params.repetition_penalty
        row[token] = row[token] / penalty if row[token] > 0 else row[token] * penalty
    for token in set(request.output_token_ids):
        row[token] -= params.frequency_penalty * request.output_token_ids.count(token)
        row[token] -= params.presence_penalty
    return row


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax(device: str) -> None:
    logits = torch.randn(6, 50, device=device)
    greedy = [_request(SamplingParams(temperature=0.0)) for _ in range(6)]
    assert Sampler()(logits, greedy).token_ids == logits.argmax(-1).tolist()
    mixed = [_request(SamplingParams(temperature=0.0 if i % 2 else 1.0)) for i in range(6)]
    tokens = Sampler()(logits, mixed).token_ids
    assert tokens[1::2] == logits.argmax(-1).tolist()[1::2]


@pytest.mark.parametrize("device", DEVICES)
def test_penalties_match_reference(device: str) -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 12, device=device) * 3
    requests = [
        _request(SamplingParams(repetition_penalty=1.7), prompt=[0, 5], output=[5, 7, 7]),
        _request(SamplingParams(), prompt=[1, 2], output=[2, 3]),  # no penalty: untouched
        _request(SamplingParams(presence_penalty=0.8, frequency_penalty=0.5), output=[4, 4, 9]),
        _request(
            SamplingParams(repetition_penalty=0.6, presence_penalty=-1.0, frequency_penalty=1.5),
            prompt=[8, 8, 11],
            output=[11, 10, 10, 10],
        ),
    ]
    penalized = apply_penalties(logits, requests)
    for i, request in enumerate(requests):
        expected = _reference_penalties(logits[i].cpu(), request)
        torch.testing.assert_close(penalized[i].cpu(), expected)
    assert not torch.equal(penalized[0], logits[0]) and not torch.equal(penalized[3], logits[3])


@pytest.mark.parametrize("device", DEVICES)
def test_penalties_count_a_token_still_pending_on_the_device(device: str) -> None:
    """Async scheduling: a request's last output token may still be on the device (the
    running step's ids); penalties count it exactly as if it were in output_token_ids."""
    torch.manual_seed(1)
    logits = torch.randn(2, 12, device=device) * 3
    params = SamplingParams(repetition_penalty=1.4, presence_penalty=0.6, frequency_penalty=0.9)
    landed = [_request(params, output=[5, 7]), _request(params, output=[2, 9, 9])]
    pending = [_request(params, output=[5]), _request(params, output=[2, 9])]
    for request in pending:
        request.num_pending_tokens = 1
    step_ids = torch.tensor([4, 9, 7], device=device)  # the running step sampled 9 and 7
    given = DeviceTokens(step_ids, {pending[0]: 2, pending[1]: 1})
    torch.testing.assert_close(
        apply_penalties(logits, pending, given), apply_penalties(logits, landed)
    )
    with pytest.raises(ValueError, match="pending"):
        apply_penalties(logits, pending)  # the pending tokens not given: refused, not ignored


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.zeros(4, 10)
    requests = [
        _request(SamplingParams(min_tokens=2, stop_token_ids=[6]), output=[1]),
        _request(SamplingParams(min_tokens=2, stop_token_ids=[6]), output=[1, 2]),  # long enough
        _request(SamplingParams(min_tokens=2, stop_token_ids=[6], ignore_eos=True)),
        _request(SamplingParams(min_tokens=1, stop_token_ids=[60])),  # out of vocab: ignored
    ]
    masked = apply_min_tokens(logits, requests)
    is_masked = masked.isneginf()
    assert is_masked[0].nonzero().flatten().tolist() == [EOS, 6]
    assert not is_masked[1].any()
    assert is_masked[2].nonzero().flatten().tolist() == [6]
    assert is_masked[3].nonzero().flatten().tolist() == [EOS]
    assert not logits.isneginf().any()  # the input is left alone

    eos_favoured = torch.zeros(1, 10)
    eos_favoured[0, EOS] = 10.0
    short = [_request(SamplingParams(temperature=0.0, min_tokens=1))]
    assert Sampler()(eos_favoured, short).token_ids != [EOS]


PROBS = [0.5, 0.25, 0.15, 0.07, 0.03]
LOG_PROBS = [math.log(p) for p in PROBS]


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(top_k=3), {0, 1, 2}),
        (SamplingParams(top_p=0.8), {0, 1, 2}),  # 0.5 + 0.25 < 0.8 <= 0.5 + 0.25 + 0.15
        (SamplingParams(min_p=0.4), {0, 1}),  # threshold 0.4 * 0.5 = 0.2
        # top-p and min-p act on the top-k renormalized distribution (0.52, 0.26, 0.15, 0.07)
        (SamplingParams(top_k=4, top_p=0.9), {0, 1, 2}),
        (SamplingParams(top_k=4, top_p=0.95, min_p=0.2), {0, 1, 2}),
        (SamplingParams(top_k=1), {0}),
        (SamplingParams(top_p=1e-9), {0}),  # the top token always survives
    ],
)
def test_truncation_never_samples_outside_allowed_set(
    params: SamplingParams, allowed: set[int]
) -> None:
    drawn = set(_draws(LOG_PROBS, params, 3000).tolist())
    assert drawn == allowed


def _chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    observed = torch.bincount(tokens, minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    return float(((observed - expected) ** 2 / expected).sum())


def test_temperature_shapes_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    tokens = _draws(logits.tolist(), SamplingParams(temperature=0.7), 20000, seed=1234)
    # 4 degrees of freedom: 18.5 is the 0.1% tail; the untempered distribution is far off.
    assert _chi_square(tokens, (logits / 0.7).softmax(-1)) < 18.5
    assert _chi_square(tokens, logits.softmax(-1)) > 100


def _seeded(seed: int, n: int, **kwargs) -> Request:
    return _request(SamplingParams(seed=seed, **kwargs), output=list(range(10, 10 + n)))


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_tokens_do_not_depend_on_batch(device: str) -> None:
    torch.manual_seed(0)
    vocab = 1000
    for n in range(8):
        row = torch.randn(1, vocab, device=device)
        alone = Sampler(seed=1)(row, [_seeded(7, n, top_k=50)]).token_ids[0]
        others = [
            _request(SamplingParams()),
            _seeded(8, n),
            _request(SamplingParams(temperature=0.0)),
            _seeded(9, n + 3, top_p=0.9),
        ]
        batch = torch.cat(
            [torch.randn(2, vocab, device=device), row, torch.randn(2, vocab, device=device)]
        )
        requests = [*others[:2], _seeded(7, n, top_k=50), *others[2:]]
        for sampler_seed in (1, 2):  # a fresh sampler elsewhere: a hand-off
            assert Sampler(seed=sampler_seed)(batch, requests).token_ids[2] == alone


def test_seeded_noise_changes_with_output_index_and_seed() -> None:
    flat = torch.zeros(1, 1000)
    by_index = [Sampler()(flat, [_seeded(7, n)]).token_ids[0] for n in range(20)]
    by_seed = [Sampler()(flat, [_seeded(seed, 0)]).token_ids[0] for seed in range(20)]
    assert len(set(by_index)) >= 15 and len(set(by_seed)) >= 15
    assert by_index == [Sampler()(flat, [_seeded(7, n)]).token_ids[0] for n in range(20)]


def test_unseeded_draws_follow_sampler_seed() -> None:
    logits = torch.zeros(64, 1000)
    requests = [_request(SamplingParams()) for _ in range(64)]
    first = Sampler(seed=3)(logits, requests).token_ids
    assert first == Sampler(seed=3)(logits, requests).token_ids
    assert first != Sampler(seed=4)(logits, requests).token_ids


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_of_raw_logits(device: str) -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 30, device=device)
    logits[1, 7] = 5.0  # repeated token that the penalty pushes down
    requests = [
        _request(SamplingParams(temperature=0.5, logprobs=3)),
        _request(SamplingParams(temperature=0.0, repetition_penalty=10.0, logprobs=2), output=[7]),
        _request(SamplingParams(temperature=0.0)),
        _request(SamplingParams(temperature=2.0, seed=1, logprobs=0)),
    ]
    raw = logits.clone()
    out = Sampler()(logits, requests)
    torch.testing.assert_close(logits, raw)  # the caller's logits are not modified
    expected = torch.log_softmax(raw.cpu().double(), dim=-1)
    assert out.logprobs[2] is None
    assert out.token_ids[1] != 7  # sampled after the penalty...
    for i in (0, 1, 3):
        entry, row = out.logprobs[i], expected[i]
        token = out.token_ids[i]
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(row[token].item(), abs=1e-5)
        assert entry.rank == int((row > row[token]).sum()) + 1
        num_top = requests[i].sampling_params.logprobs
        top_values, top_ids = row.topk(num_top)
        assert [t for t, _ in entry.top] == top_ids.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(top_values.tolist(), abs=1e-5)
    assert out.logprobs[1].top[0][0] == 7  # ...but the logprobs are the raw model's
    assert out.logprobs[1].rank > 1


def test_rejects_mismatched_batch() -> None:
    with pytest.raises(ValueError, match="one row per request"):
        Sampler()(torch.zeros(2, 10), [_request(SamplingParams())])
