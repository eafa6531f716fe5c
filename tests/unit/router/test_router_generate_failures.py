"""Generate through a real RouterServer over fake nodes when something fails: a prefill node's
failure or absence (the decode node prefills locally), a decode node's status, no decode node,
the client's deadline, a router bug."""

from __future__ import annotations

import grpc
import pytest
from router_fakes import TEST_TIMEOUT_S, RouterHarness, run

from tests.waiting import wait_until

WAIT_S = 10.0  # what the router's cancellations get to reach the fake nodes

TEXT = "héllo wörld 日本語 🙂 naïve café"


@pytest.fixture(scope="module")
def output_ids(tokenizer) -> list[int]:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) >= 8
    return ids


def test_a_failed_attach_ticket_cancels_the_transfer_and_the_prefill_call(
    tokenizer_files, output_ids
) -> None:
    async def body():
        async with RouterHarness(tokenizer_files, output_ids, transfer_timeout_s=30.0) as h:
            h.prefill[0].attach_fail_code = grpc.StatusCode.INTERNAL
            result = await h.client.generate_all("hello", max_tokens=5)
            await wait_until(lambda: h.prefill[0].cancelled, TEST_TIMEOUT_S)  # reaches P
            return result, h

    result, h = run(body())

    assert result.token_ids == output_ids[:5] and result.finish_reason == "length"
    assert len(h.decode[0].cancelled_transfers) == 1  # D prefilled locally at once
    assert h.prefill[0].cancelled == [h.prefill[0].requests[0].request_id]
    assert h.router.stats.num_prefill_failures == 1


def test_prefill_failure_cancels_the_transfer_and_the_output_is_complete(
    tokenizer_files, output_ids
) -> None:
    async def body():
        # D would wait 30 s for the KV: only CancelTransfer lets it finish within the test.
        async with RouterHarness(tokenizer_files, output_ids, transfer_timeout_s=30.0) as h:
            h.prefill[0].fail_code = grpc.StatusCode.INTERNAL
            result = await h.client.generate_all("hello", max_tokens=5)
            return result, h

    result, h = run(body())

    assert result.token_ids == output_ids[:5] and result.finish_reason == "length"
    assert len(h.decode[0].cancelled_transfers) == 1
    assert h.router.stats.num_prefill_failures == 1


def test_a_failed_transfer_prefill_reports_cancels_the_decode_side_at_once(
    tokenizer_files, output_ids
) -> None:
    """P's first token went out but its KV never reached D (e.g. the P->D connection broke):
    P's failed transfer result makes the router cancel D's reservation, so D prefills locally
    at once instead of waiting out its 30 s transfer deadline (the test's 10 s bound)."""

    async def body():
        async with RouterHarness(tokenizer_files, output_ids, transfer_timeout_s=30.0) as h:
            h.prefill[0].transfer_error = "send to tcp://D failed: connection reset"
            result = await h.client.generate_all("hello", max_tokens=5)
            return result, h

    result, h = run(body())

    assert result.token_ids == output_ids[:5] and result.finish_reason == "length"
    (transfer_id,) = h.decode[0].cancelled_transfers
    (prefill_request,) = h.prefill[0].requests
    (attached,) = h.prefill[0].attached
    assert transfer_id == attached.ticket.transfer_id
    assert prefill_request.transfer_timeout_s == 30.0  # one timeout: P gets D's
    assert h.router.stats.num_prefill_failures == 1


def test_unreachable_prefill_node_falls_back_to_local_prefill(tokenizer_files, output_ids) -> None:
    async def body():
        async with RouterHarness(tokenizer_files, output_ids, transfer_timeout_s=30.0) as h:
            await h.prefill[0].stop()
            result = await h.client.generate_all("hello", max_tokens=4)
            return result, h

    result, h = run(body())

    assert result.token_ids == output_ids[:4]
    assert len(h.decode[0].cancelled_transfers) == 1


def test_a_router_bug_mid_stream_counts_as_internal_not_cancelled(
    tokenizer_files, output_ids, monkeypatch
) -> None:
    def broken(self, tokens):
        raise RuntimeError("a bug in the output path")

    monkeypatch.setattr("router.request_handler.OutputProcessor.process", broken)

    async def body():
        async with RouterHarness(tokenizer_files, output_ids) as h:
            with pytest.raises(grpc.aio.AioRpcError):
                await h.client.generate_all("hello", max_tokens=4)
            return h

    h = run(body())

    assert h.router.stats.errors == {"INTERNAL": 1}
    assert h.router.stats.num_cancelled == 0
    assert "pdserve_requests_running 0.0" in h.router.stats.metrics.render().decode()


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.DEADLINE_EXCEEDED),
        (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL),
    ],
)
def test_decode_node_errors_map_to_client_statuses(
    tokenizer_files, output_ids, code, expected, caplog
) -> None:
    """The status carries the node's failure, never its address (issue 39 item 10: clients
    learn no internal address); the router's log keeps it."""

    async def body():
        async with RouterHarness(tokenizer_files, output_ids) as h:
            h.decode[0].fail_code = code
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await h.client.generate_all("hello", max_tokens=4)
            return error.value, h

    error, h = run(body())

    assert error.code() == expected
    assert "decode node" in error.details() and "scripted decode failure" in error.details()
    assert h.decode[0].address not in error.details()
    assert h.decode[0].address in caplog.text
    assert h.router.stats.errors == {expected.name: 1}


def test_no_ready_decode_node_is_unavailable(tokenizer_files, output_ids) -> None:
    async def body():
        async with RouterHarness(tokenizer_files, output_ids, num_decode=0) as h:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await h.client.generate_all("hello", max_tokens=4)
            return error.value

    error = run(body())

    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "no decode node is ready" in error.details()


def test_client_deadline_is_deadline_exceeded(tokenizer_files, output_ids) -> None:
    async def body():
        async with RouterHarness(tokenizer_files, output_ids) as h:
            h.decode[0].gate.clear()
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await h.client.generate_all("hello", max_tokens=4, timeout_s=0.3)
            await wait_until(lambda: h.decode[0].cancelled, WAIT_S)
            return error.value, h

    error, h = run(body())

    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert len(h.decode[0].cancelled) == 1  # the node call does not outlive the client's


@pytest.mark.parametrize("allowance", ["prefill", "none"])
def test_the_wait_for_a_first_token_covers_the_prefill(tokenizer_files, output_ids, allowance):
    """Issue 34: a prefill longer than token_timeout_s (a long prompt, a backlog) is waited
    for: the first token's wait adds the prompt tokens its prefill node has in flight over
    min_prefill_tokens_per_s (30 tokens at 10/s: 3 s); without that allowance (a rate of a
    billion tokens/s) the same 1.5 s prefill is DEADLINE_EXCEEDED at token_timeout_s."""
    rate = 10.0 if allowance == "prefill" else 1e9

    async def body():
        async with RouterHarness(
            tokenizer_files, output_ids, token_timeout_s=0.5, min_prefill_tokens_per_s=rate
        ) as h:
            h.prefill[0].first_token_delay_s = 1.5
            return await h.client.generate_all(prompt_token_ids=[5] * 30, max_tokens=4)

    if allowance == "prefill":
        result = run(body())
        assert result.token_ids == output_ids[:4]
        return
    with pytest.raises(grpc.aio.AioRpcError) as error:
        run(body())
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
