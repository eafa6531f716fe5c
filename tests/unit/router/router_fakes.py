"""Fake prefill and decode nodes (in-process grpc.aio servers scripted by the test), a tokenizer
trained on the spot, and a harness that puts a real RouterServer and client in front of them.

The fake "model" answers every prompt with `FakeModel.output_token_ids` (cut at max_tokens:
finish "length"; shorter: finish "stop", as at EOS). A fake prefill node hands its first token to
the fake decode node through `FakeModel` (standing in for the KV transfer); the decode node
then streams every output index from 0, the first token included, as a real one does.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import grpc
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from pdserve.config import RouterConfig
from pdserve.v1 import generation_pb2, node_pb2, node_pb2_grpc
from router.client import GenerationClient
from router.server import RouterServer
from tests.ports import free_port, start_on_free_ports_async

CORPUS = [
    "héllo wörld 日本語 🙂",
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello there! naïve café, 日本 and 語 🙂🙃",
]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
VOCAB_SIZE = 320
MAX_MODEL_LEN = 64
# A hang guard for a whole test body (router, fake nodes, HTTP server and the calls), not a
# timing assertion: on a loaded 2-core machine a body that takes 3 s alone once took over 10 s.
TEST_TIMEOUT_S = 60.0


def run(coro: Coroutine[Any, Any, Any], timeout_s: float = TEST_TIMEOUT_S) -> Any:
    """Runs a test body on a fresh event loop, failing it after `timeout_s`."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def build_tokenizer_files(folder: Path) -> node_pb2.TokenizerFiles:
    """A byte-level BPE small enough that multi-byte characters split across tokens, with a
    ChatML template; saved to `folder` and returned as a node's GetTokenizer answer."""
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 3, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return node_pb2.TokenizerFiles(
        tokenizer_json=(folder / "tokenizer.json").read_bytes(),
        tokenizer_config_json=(folder / "tokenizer_config.json").read_bytes(),
        chat_template=CHATML_TEMPLATE,
    )


class FakeModel:
    """What every fake node generates, and the first-token hand-off between fake nodes."""

    def __init__(self, output_token_ids: list[int], chunk_size: int = 2) -> None:
        self.output_token_ids = output_token_ids
        self.chunk_size = chunk_size
        self.num_cached_tokens = 0  # reported by the node that prefills
        self._transfers: dict[str, asyncio.Future[int | None]] = {}

    def outputs(self, sampling: node_pb2.NodeSamplingParams) -> tuple[list[int], str]:
        token_ids = self.output_token_ids[: sampling.max_tokens]
        return token_ids, "length" if len(token_ids) == sampling.max_tokens else "stop"

    def open_transfer(self) -> str:
        transfer_id = uuid.uuid4().hex
        self._transfers[transfer_id] = asyncio.get_running_loop().create_future()
        return transfer_id

    def deliver(self, transfer_id: str, first_token: int | None) -> bool:
        """P's first token (None: cancelled, D prefills locally); False if already resolved."""
        future = self._transfers.get(transfer_id)
        if future is None or future.done():
            return False
        future.set_result(first_token)
        return True

    async def wait_transfer(self, transfer_id: str, timeout_s: float) -> int | None:
        try:
            return await asyncio.wait_for(self._transfers[transfer_id], timeout_s)
        except TimeoutError:
            return None


class FakeNode(
    node_pb2_grpc.NodeServicer, node_pb2_grpc.PrefillNodeServicer, node_pb2_grpc.DecodeNodeServicer
):
    """A prefill or decode node that records what the router asks of it."""

    def __init__(self, role: int, model: FakeModel, files: node_pb2.TokenizerFiles, **info) -> None:
        self.model = model
        self.files = files
        self.info = node_pb2.NodeInfo(
            role=role,
            model_name="fake-model",
            layout_hash="layout-1",
            max_model_len=MAX_MODEL_LEN,
            vocab_size=VOCAB_SIZE,
            eos_token_ids=[2],
            block_size=16,
            kv_transport="local",
            protocol_version=1,
        )
        for name, value in info.items():
            setattr(self.info, name, value)
        self.requests: list[node_pb2.DecodeRequest | node_pb2.PrefillRequest] = []
        self.cancelled: list[str] = []  # request ids whose call the router cancelled
        self.aborted: list[str] = []  # request ids of Abort calls
        self.cancelled_transfers: list[str] = []  # transfer ids of CancelTransfer calls
        self.attached: list[node_pb2.AttachTicketRequest] = []  # AttachTicket calls
        self._tickets: dict[str, asyncio.Future] = {}  # P: request id -> its attached ticket
        self.fail_code: grpc.StatusCode | None = None  # Prefill/Decode fail at once with it
        self.transfer_error = ""  # P: the KV never reaches D; P's result reports this error
        self.gate = asyncio.Event()  # D: chunks from index `hold_at` on wait for it; P: the result
        self.gate.set()
        self.ticket_gate = asyncio.Event()  # D: the ticket waits for it
        self.ticket_gate.set()
        self.attach_fail_code: grpc.StatusCode | None = None  # P: AttachTicket fails with it
        self.first_before_ticket = False  # P: the first token goes out before its ticket is in
        self.first_token_delay_s = 0.0  # P: a prefill this long (a long prompt, a backlog)
        self.first_token_gate = asyncio.Event()  # P: a first token after the KV waits for it
        self.first_token_gate.set()
        self.chunks_sent: list[int] = []  # D: the output index of each chunk written
        self.hold_at = 0
        self.server: grpc.aio.Server | None = None
        self.address = ""

    async def start(self, port: int = 0) -> str:
        self.server = grpc.aio.server()
        node_pb2_grpc.add_NodeServicer_to_server(self, self.server)
        if self.info.role == node_pb2.NODE_ROLE_PREFILL:
            node_pb2_grpc.add_PrefillNodeServicer_to_server(self, self.server)
        else:
            node_pb2_grpc.add_DecodeNodeServicer_to_server(self, self.server)
        port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        await self.server.start()
        self.address = f"127.0.0.1:{port}"
        return self.address

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=None)

    async def GetNodeInfo(self, request, context):
        return self.info

    async def GetTokenizer(self, request, context):
        return self.files

    async def Abort(self, request, context):
        self.aborted.append(request.request_id)
        return node_pb2.AbortResponse(found=True)

    async def CancelTransfer(self, request, context):
        self.cancelled_transfers.append(request.transfer_id)
        return node_pb2.CancelTransferResponse(found=self.model.deliver(request.transfer_id, None))

    async def AttachTicket(self, request, context):
        self.attached.append(request)
        if self.attach_fail_code is not None:
            await context.abort(self.attach_fail_code, "scripted AttachTicket failure")
        future = self._ticket_of(request.request_id)
        if future.done():
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, "the call has its ticket")
        future.set_result(request.ticket)
        return node_pb2.AttachTicketResponse()

    def _ticket_of(self, request_id: str) -> asyncio.Future:
        return self._tickets.setdefault(request_id, asyncio.get_running_loop().create_future())

    async def Prefill(self, request, context):
        self.requests.append(request)
        try:
            if self.fail_code is not None:
                await context.abort(self.fail_code, "scripted prefill failure")
            first_token = self.model.output_token_ids[0]
            finish_reason = "length" if request.sampling.max_tokens == 1 else ""
            await asyncio.sleep(self.first_token_delay_s)
            first = node_pb2.PrefillFirstToken(
                token_id=first_token,
                finish_reason=finish_reason,
                num_cached_tokens=self.model.num_cached_tokens,
            )
            if request.sampling.HasField("logprobs"):
                first.logprob.CopyFrom(_logprob(first_token, 0))
            if request.sampling.HasField("prompt_logprobs"):  # prompt tokens 2..n
                prompt = request.prompt_token_ids[1:]
                first.prompt_logprobs.extend(_logprob(t, i) for i, t in enumerate(prompt))
            if self.first_before_ticket:  # the forward ended before D's ticket came
                await context.write(node_pb2.PrefillResponse(first_token=first))
            ticket = request.ticket
            if not request.HasField("ticket"):  # the router attaches it
                ticket = await asyncio.wait_for(self._ticket_of(request.request_id), TEST_TIMEOUT_S)
            if not self.transfer_error:
                self.model.deliver(ticket.transfer_id, first_token)
            if not self.first_before_ticket:
                await self.first_token_gate.wait()
                await context.write(node_pb2.PrefillResponse(first_token=first))
            await self.gate.wait()
            result = node_pb2.PrefillTransferResult(
                ok=not self.transfer_error, error=self.transfer_error, num_bytes=1024
            )
            await context.write(node_pb2.PrefillResponse(transfer_result=result))
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise

    async def Decode(self, request, context):
        self.requests.append(request)
        try:
            if self.fail_code is not None:
                await context.abort(self.fail_code, "scripted decode failure")
            if request.mode == node_pb2.DECODE_MODE_DISAGGREGATED:
                transfer_id = self.model.open_transfer()
                ticket = node_pb2.TransferTicket(
                    transfer_id=transfer_id, num_tokens=len(request.prompt_token_ids)
                )
                await self.ticket_gate.wait()
                await context.write(node_pb2.DecodeResponse(ticket=ticket))
                await self.model.wait_transfer(transfer_id, request.transfer_timeout_s)
            await self._stream_chunks(request, context)
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise

    async def _stream_chunks(self, request: node_pb2.DecodeRequest, context) -> None:
        token_ids, finish_reason = self.model.outputs(request.sampling)
        size = self.model.chunk_size
        # A migrated request continues after the output it brings.
        for start in range(len(request.output_token_ids), len(token_ids), size):
            if start >= self.hold_at:
                await self.gate.wait()
            chunk = node_pb2.TokenChunk(
                output_index=start, token_ids=token_ids[start : start + size]
            )
            if request.sampling.HasField("logprobs"):
                chunk.logprobs.extend(_logprob(t, start + i) for i, t in enumerate(chunk.token_ids))
            if start + size >= len(token_ids):
                chunk.finish_reason = finish_reason
                chunk.num_cached_tokens = self.model.num_cached_tokens
            await context.write(node_pb2.DecodeResponse(tokens=chunk))
            self.chunks_sent.append(start)


def _logprob(token_id: int, output_index: int) -> generation_pb2.TokenLogprob:
    return generation_pb2.TokenLogprob(
        token_id=token_id,
        logprob=-0.25 * (output_index + 1),
        rank=1,
        top=[generation_pb2.TopLogprob(token_id=token_id, logprob=-0.25 * (output_index + 1))],
    )


class RouterHarness:
    """Fake nodes, a RouterServer in front of them (on a free port) and a client, in one loop."""

    def __init__(
        self,
        files: node_pb2.TokenizerFiles,
        output_token_ids: list[int],
        num_prefill: int = 1,
        num_decode: int = 1,
        chunk_size: int = 2,
        free_http_port: bool = False,
        **config: Any,
    ) -> None:
        """`free_http_port`: serve HTTP on a free port (picked again if another process takes
        it before the router binds it); else `http_port` (default 0: no HTTP API)."""
        self.model = FakeModel(output_token_ids, chunk_size)
        self.prefill = [
            FakeNode(node_pb2.NODE_ROLE_PREFILL, self.model, files) for _ in range(num_prefill)
        ]
        self.decode = [
            FakeNode(node_pb2.NODE_ROLE_DECODE, self.model, files) for _ in range(num_decode)
        ]
        self._config = {"port": 0, "http_port": 0, "node_wait_s": 2.0, "grace_s": 0.0, **config}
        self._free_http_port = free_http_port
        self.router: RouterServer | None = None
        self.client: GenerationClient | None = None

    async def _start_router(self) -> RouterServer:
        config = dict(self._config, http_port=free_port()) if self._free_http_port else self._config
        router = RouterServer(
            RouterConfig(
                prefill_addrs=tuple(n.address for n in self.prefill),
                decode_addrs=tuple(n.address for n in self.decode),
                **config,
            )
        )
        try:
            await router.start()
        except BaseException:
            await router.stop()
            raise
        return router

    async def __aenter__(self) -> RouterHarness:
        for node in (*self.prefill, *self.decode):
            await node.start()
        self.router = await start_on_free_ports_async(self._start_router)
        self.client = GenerationClient(self.router.address)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.client.close()
        await self.router.stop()
        for node in (*self.prefill, *self.decode):
            await node.stop()
