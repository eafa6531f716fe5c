"""pd-router and pd-client as processes, in front of a fake decode node served by the test."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys

import pytest
from router_fakes import FakeModel, FakeNode, run

from pdserve.v1 import node_pb2
from router.client_cli import build_client_parser
from router.client_cli import main as client_main

CLI_TIMEOUT_S = 30.0


async def _run_client(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "router.client_cli",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await process.communicate()
    return process.returncode, stdout.decode(), stderr.decode()


ROUTER_ARGV = (sys.executable, "-m", "router.cli", "--port", "0", "--http-port", "0",
               "--log-level", "warning")  # fmt: skip
CHAT_JSON_ARGS = ("--chat", "--system", "Be brief.", "hi", "--json", "--max-tokens", "2",
                  "--logprobs", "0")  # fmt: skip


@pytest.mark.parametrize("event_loop", ["asyncio", "uvloop"])
def test_pd_router_serves_pd_client_and_stops_on_sigterm(
    tokenizer_files, tokenizer, event_loop
) -> None:
    """Also on uvloop (--event-loop uvloop): the same answers, the same clean stop."""
    output_ids = tokenizer.encode("héllo wörld 🙂", add_special_tokens=False)

    async def body():
        node = FakeNode(node_pb2.NODE_ROLE_DECODE, FakeModel(output_ids), tokenizer_files)
        await node.start()
        router = await asyncio.create_subprocess_exec(
            *ROUTER_ARGV,
            "--decode",
            node.address,
            "--event-loop",
            event_loop,
            stdout=asyncio.subprocess.PIPE,
        )
        try:
            line = (await asyncio.wait_for(router.stdout.readline(), CLI_TIMEOUT_S)).decode()
            addr = line.rsplit(" ", 1)[-1].strip()
            results = (
                await _run_client("--addr", addr, "hi", "--max-tokens", str(len(output_ids))),
                await _run_client("--addr", addr, *CHAT_JSON_ARGS),
                await _run_client("--addr", addr, "hi", "--top-p", "2"),
            )
            router.send_signal(signal.SIGTERM)
            exit_code = await asyncio.wait_for(router.wait(), CLI_TIMEOUT_S)
        finally:
            if router.returncode is None:
                router.kill()
            await node.stop()
        return line, results, exit_code, node.requests

    line, (streamed, as_json, invalid), exit_code, requests = run(body(), timeout_s=60)

    assert line.startswith("pd-router listening on 127.0.0.1:")
    assert streamed == (0, "héllo wörld 🙂\n", "")
    code, stdout, _ = as_json
    payload = json.loads(stdout)
    assert code == 0 and payload["token_ids"] == output_ids[:2]
    assert payload["finish_reason"] == "length" and payload["usage"]["completion_tokens"] == 2
    assert payload["text"] == tokenizer.decode(output_ids[:2]) and len(payload["logprobs"]) == 2
    chat_prompt = tokenizer.decode(requests[1].prompt_token_ids, skip_special_tokens=False)
    assert chat_prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi")
    assert invalid[0] == 1 and invalid[2].startswith("pd-client: INVALID_ARGUMENT: top_p must be")
    assert exit_code == 0


def test_pd_client_flags_mirror_sampling_params() -> None:
    args = build_client_parser().parse_args(
        ["p", "--stop", "a", "--stop", "b", "--stop-token-id", "7", "--top-k", "-1", "--ignore-eos"]
    )

    assert (args.stop, args.stop_token_ids, args.top_k, args.ignore_eos) == (
        ["a", "b"],
        [7],
        -1,
        True,
    )
    assert args.temperature is None and args.max_tokens is None  # unset: the engine's default


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-tokens", "-1"], "--max-tokens: must be between 0 and 4294967295, got -1"),
        (["--seed", str(2**64)], "--seed: must be between 0 and 18446744073709551615"),
        (["--top-k", "3000000000"], "--top-k: must be between -2147483648 and 2147483647"),
        (["--stop-token-id", "-1"], "--stop-token-id: must be between 0 and 4294967295"),
        (["--logprobs", "x"], "--logprobs: expected an integer, got 'x'"),
    ],
)
def test_pd_client_refuses_what_no_request_can_hold(capsys, flags, message) -> None:
    """A usage error naming the flag, not a protobuf traceback."""
    with pytest.raises(SystemExit) as exit_:
        build_client_parser().parse_args(["p", *flags])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_pd_client_reports_an_unreachable_router(capsys) -> None:
    code = client_main(["--addr", "127.0.0.1:1", "--timeout-s", "0.5", "hi"])

    assert code == 1
    assert capsys.readouterr().err.startswith("pd-client: UNAVAILABLE: ")


def test_pd_client_stops_quietly_when_its_reader_leaves() -> None:
    """`pd-client ... | head`: the pipe closes under a streaming answer; the client ends with
    SIGPIPE's status and no traceback. (The stream is faked: tokens written as they come.)"""
    script = (
        "import sys, router.client_cli as c\n"
        "async def streaming(args):\n"
        "    for _ in range(100_000):\n"
        "        sys.stdout.write('token ' * 100)\n"
        "        sys.stdout.flush()\n"
        "c._generate = streaming\n"
        "sys.exit(c.main(['hi']))\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    process.stdout.close()  # the reader leaves before the first token
    _, stderr = process.communicate(timeout=CLI_TIMEOUT_S)

    assert process.returncode == 141
    assert stderr == b""
