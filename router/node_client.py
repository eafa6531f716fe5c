"""NodeClient: the router's connection to one prefill or decode node.

One `grpc.aio` channel per node address, with stubs for the three services of node.proto
(a node serves `Node` plus its role's service). `connect` retries `GetNodeInfo` until a deadline
so nodes may come up after the router; `fetch_tokenizer` turns the node's `GetTokenizer` files
into the router's `Tokenizer` (None for a model without one). `load` is what the policies read.
"""

from __future__ import annotations

import asyncio
import json
import logging
import tempfile
import time
from pathlib import Path

import grpc

from pdserve.config import SecurityConfig
from pdserve.grpc_security import open_channel
from pdserve.registry import NodeRecord
from pdserve.security import ClusterAuth
from pdserve.tokenizer import Tokenizer
from pdserve.v1 import node_pb2, node_pb2_grpc
from router.node_load import NodeLoad

logger = logging.getLogger(__name__)

MAX_RECEIVE_MESSAGE_BYTES = 256 << 20  # tokenizer.json can exceed gRPC's 4 MiB default
_CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES),
    # Reconnect quickly to a node that is still starting (gRPC's default backoff reaches 120 s).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
_RETRIED_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_MAX_RETRY_DELAY_S = 1.0


class NodeClient:
    """Stubs for one node, and the node's `NodeInfo` once `connect` succeeded."""

    def __init__(
        self,
        address: str,
        security: SecurityConfig | None = None,
        auth: ClusterAuth | None = None,
    ) -> None:
        """With `auth`, every call carries a fresh cluster proof (never the secret itself);
        with TLS in `security`, the channel is mutual TLS."""
        self.address = address
        self._channel = open_channel(address, security or SecurityConfig(), auth, _CHANNEL_OPTIONS)
        self.node_stub = node_pb2_grpc.NodeStub(self._channel)
        self.prefill_stub = node_pb2_grpc.PrefillNodeStub(self._channel)
        self.decode_stub = node_pb2_grpc.DecodeNodeStub(self._channel)
        self._info: node_pb2.NodeInfo | None = None  # set by `connect`
        self.record: NodeRecord | None = None  # the registry's, for a registered node
        self.load = NodeLoad()
        self.unreachable_until_s = 0.0  # monotonic; policies skip the node until then
        self._up = True  # admitted: it answered; see `up`

    def __repr__(self) -> str:
        return f"NodeClient({self.address})"

    @property
    def info(self) -> node_pb2.NodeInfo:
        """What the node reported to `connect` (a client is admitted only after it)."""
        if self._info is None:
            raise RuntimeError(f"node {self.address} has not answered GetNodeInfo yet")
        return self._info

    async def connect(self, deadline_s: float, rpc_timeout_s: float) -> node_pb2.NodeInfo:
        """GetNodeInfo, retried while the node is unreachable, until `deadline_s`
        (`time.monotonic()` seconds). Raises TimeoutError when the deadline passes."""
        delay_s = 0.05
        last_error = "never reached"
        while (remaining_s := deadline_s - time.monotonic()) > 0:
            try:
                info: node_pb2.NodeInfo = await self.node_stub.GetNodeInfo(
                    node_pb2.GetNodeInfoRequest(),
                    timeout=min(rpc_timeout_s, remaining_s),
                    wait_for_ready=True,
                )
                self._info = info
                return info
            except grpc.aio.AioRpcError as error:
                if error.code() not in _RETRIED_CODES:
                    raise
                last_error = f"{error.code().name}: {error.details()}"
            await asyncio.sleep(min(delay_s, max(deadline_s - time.monotonic(), 0.0)))
            delay_s = min(2 * delay_s, _MAX_RETRY_DELAY_S)
        raise TimeoutError(f"node {self.address} did not answer GetNodeInfo ({last_error})")

    async def fetch_tokenizer(self, timeout_s: float) -> Tokenizer | None:
        """The node's tokenizer, built off the event loop (a large tokenizer.json takes a while);
        None when the model has none (a synthetic model: the router then takes token ids)."""
        files = await self.node_stub.GetTokenizer(node_pb2.GetTokenizerRequest(), timeout=timeout_s)
        name = self._info.model_name if self._info is not None else self.address
        if not files.tokenizer_json:
            logger.warning("model %s has no tokenizer: the router serves token ids only", name)
            return None
        return await asyncio.to_thread(tokenizer_from_files, files, name)

    async def cancel_transfer(self, transfer_id: str, reason: str, timeout_s: float) -> bool:
        """Tells a decode node the KV of `transfer_id` will not come; True if it was pending."""
        request = node_pb2.CancelTransferRequest(transfer_id=transfer_id, reason=reason)
        response: node_pb2.CancelTransferResponse = await self.decode_stub.CancelTransfer(
            request, timeout=timeout_s
        )
        return response.found

    async def attach_ticket(
        self, request_id: str, ticket: node_pb2.TransferTicket, timeout_s: float
    ) -> None:
        """Hands a prefill node the ticket of its Prefill call sent without one."""
        request = node_pb2.AttachTicketRequest(request_id=request_id, ticket=ticket)
        await self.prefill_stub.AttachTicket(request, timeout=timeout_s)

    async def abort(self, request_id: str, timeout_s: float) -> bool:
        """Ends the request on the node; True if the node held it."""
        request = node_pb2.AbortRequest(request_id=request_id)
        response: node_pb2.AbortResponse = await self.node_stub.Abort(request, timeout=timeout_s)
        return response.found

    def up(self) -> bool:
        """Whether the node's connection looks alive, from the channel's state alone (no RPC,
        no wait): READY or IDLE yes, TRANSIENT_FAILURE or SHUTDOWN no (a dead node's channel
        gets there once a connection attempt fails; this asks the channel to attempt), and
        while it is CONNECTING as it last looked (no flapping while it reconnects)."""
        state = self._channel.get_state(try_to_connect=True)
        if state in (grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.IDLE):
            self._up = True
        elif state in (
            grpc.ChannelConnectivity.TRANSIENT_FAILURE,
            grpc.ChannelConnectivity.SHUTDOWN,
        ):
            self._up = False
        return self._up

    async def close(self) -> None:
        await self._channel.close(grace=None)


def tokenizer_from_files(files: node_pb2.TokenizerFiles, name: str) -> Tokenizer:
    """A Tokenizer from a node's `TokenizerFiles` (written to a temporary folder and read back
    the way the engine reads a model folder); the node's `chat_template` wins over the config's."""
    if not files.tokenizer_json:
        raise ValueError(f"the tokenizer of {name} has an empty tokenizer.json")
    config = json.loads(files.tokenizer_config_json) if files.tokenizer_config_json else {}
    if files.chat_template:
        config["chat_template"] = files.chat_template
    with tempfile.TemporaryDirectory(prefix="pdserve-tokenizer-") as folder:
        (Path(folder) / "tokenizer.json").write_bytes(files.tokenizer_json)
        (Path(folder) / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
        try:
            tokenizer = Tokenizer.from_dir(folder)
        except Exception as error:  # `tokenizers` raises a bare Exception on a malformed file
            raise ValueError(f"the tokenizer files of {name} do not load: {error}") from error
    tokenizer.name = name
    return tokenizer
