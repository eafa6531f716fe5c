"""`DecodeServicer`: the `DecodeNode` RPCs, `Decode` and `CancelTransfer`.

Decode ──► checks (INVALID_ARGUMENT) ──► its grammar starts compiling (GrammarPrep: refused:
    INVALID_ARGUMENT, too many compiling: RESOURCE_EXHAUSTED)
Decode(LOCAL_PREFILL) ──► grammar ──► AsyncEngine.generate ──► TokenChunk ... (output_index from
    0 with prompt logprobs if asked; a migration's from len(output_token_ids), matcher rebuilt)
Decode(DISAGGREGATED) ──► TransferCaps (timeout clamped; the caller's share of the pool, unless
    it proved the cluster secret: the router's requests wait for free blocks alone)
    ──► reserve ceil((prompt + 1) / block) blocks (while the grammar compiles), the prompt's
        cached prefix first at TP 1 (held, not sent: the ticket's num_cached_blocks, KVSuffix)
        ──► HandOffs.open: a TPReceiver (a KVReceiver; with tensor parallelism every rank's
        routes, each skipping the held blocks)
    ──► TransferTicket ──► the grammar (refused: the reservation freed)
    ──► await the receiver (every layer + the first token, or FAILED):
        it fails after transfer_timeout_s without progress (the prefill node handshakes once
        it has the ticket, then reports progress while it computes this prompt or those
        queued ahead of it), or at the prefill node's ceiling (at most --max-handoff-s)
        SUCCESS ──► TokenChunk{0: first token}, AsyncEngine.resume (matcher advanced by it;
                    refused: INVALID_ARGUMENT) ──► TokenChunk ...
                    (the received KV enters the prefix cache only from an authenticated sender)
        FAILED  ──► free the reservation ──► AsyncEngine.generate ──► TokenChunk ...
CancelTransfer(transfer_id) ──► fail that receiver: its Decode falls back at once
Abort (Node service) / the router cancels the call ──► fail the receiver, free the
    reservation, abort in the engine; the stream ends with finish_reason "abort" (at once, even
    inside a long engine step); an error nothing maps ──► UNAVAILABLE / INTERNAL, not UNKNOWN
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence

import grpc

from cache_transfer import TransferState
from cache_transfer.tp import TPReceiver
from decode_node.decode_checks import check_decode_request
from decode_node.decode_job import DecodeCounters, DecodeJob, Refused, refuse
from decode_node.decode_request import prefix_lookup
from decode_node.decode_trace import DecodeTraces
from decode_node.hand_offs import HandOffs
from decode_node.kv_admission import AdmissionRefused, KVAdmission
from decode_node.transfer_caps import TransferCapExceeded, TransferCaps
from engine.outputs import StepOutput
from engine.request import FinishReason, Request
from node_common.node_base import NodeBase
from node_common.node_messages import GrammarPrep, prompt_logprobs, token_logprob
from node_common.role_servicer import RoleServicer, abort_call, ends_with_status
from pdserve.logs import set_request_id
from pdserve.sampling_params import SamplingParams
from pdserve.v1 import node_pb2, node_pb2_grpc, transfer_pb2

logger = logging.getLogger(__name__)


class DecodeServicer(RoleServicer, node_pb2_grpc.DecodeNodeServicer):
    counters: DecodeCounters

    def __init__(self, node: NodeBase, traces: DecodeTraces) -> None:
        config = node.config
        super().__init__(
            node.engine, node.manager, config.transfer_timeout_s, node.metrics, DecodeCounters()
        )
        self._traces = traces
        self._hand_offs = HandOffs(node, node.manager)
        self._jobs: dict[str, DecodeJob] = {}
        self.admission = KVAdmission(
            self._engine, node.layout.block_size, node.core.config.scheduler.max_num_seqs,
            config.max_queued_requests, config.queue_timeout_s,
        )  # fmt: skip
        self._block_size = node.layout.block_size
        self._max_handoff_s = config.max_handoff_s
        self._kv_authenticated = node.auth is not None  # KV handshakes prove the secret
        # reserve (and receive) only what the prefix cache lacks (KVSuffix); at TP 1 only: the
        # other ranks' host tiers are not looked up (a TP prefill node's routes skip it too)
        self._suffix = config.suffix_handoff and node.core.config.cache.enable_prefix_caching
        self._suffix = self._suffix and node.tp_ranks is None
        self.caps = TransferCaps(
            node.core.pool.num_blocks, config.max_transfer_timeout_s,
            config.max_pending_kv_share, config.max_pending_transfers, config.max_queued_requests,
        )  # fmt: skip

    @ends_with_status
    async def Decode(
        self, request: node_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[node_pb2.DecodeResponse, None]:
        set_request_id(request.request_id)  # this call's log lines carry the request id
        params = await check_decode_request(self._engine, request, context)
        if request.request_id in self._jobs:
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS,
                f"request {request.request_id!r} is already decoding on this node",
            )
        job = self._jobs[request.request_id] = DecodeJob(
            request.request_id, self._traces.open(request.request_id)
        )
        grammar = GrammarPrep.start(self._engine, params, context)  # compiles meanwhile
        try:
            if request.mode == node_pb2.DECODE_MODE_DISAGGREGATED:
                receiver = await self._reserve(job, request, params, context)
                job.trace.mark("ticket")
                yield node_pb2.DecodeResponse(ticket=receiver.ticket())
                engine_request = await grammar.request(request)  # (refused: _close frees)
                if self._kv_authenticated:  # received KV may enter the prefix cache
                    self._engine.hash_prompt_ahead(engine_request)  # while P computes the KV
                chunks = await self._after_transfer(job, engine_request, receiver)
            else:
                engine_request = await grammar.request(request, request.output_token_ids)
                chunks = self._prefill_locally(job, engine_request)
            async for chunk in chunks:
                yield node_pb2.DecodeResponse(tokens=chunk)
        except Refused as refused:
            await refuse(context, refused.error)
        finally:
            grammar.close()
            self._close(job)

    async def CancelTransfer(
        self, request: node_pb2.CancelTransferRequest, context: grpc.aio.ServicerContext
    ) -> node_pb2.CancelTransferResponse:
        reason = f"by the router ({request.reason or 'no reason given'})"
        hand_off = self._hand_offs.find(request.transfer_id)
        if hand_off is not None:
            hand_off.cancel(reason)
            return node_pb2.CancelTransferResponse(found=True)
        found = self._manager.cancel(request.transfer_id, reason)
        return node_pb2.CancelTransferResponse(found=found)

    async def abort(self, request_id: str) -> bool:
        """Node.Abort: end the request wherever it is (awaiting blocks or KV, or in the engine:
        its stream ends at once); a request of no Decode call here waits for the engine's
        answer (a reservation, freed)."""
        job = self._jobs.get(request_id)
        if job is None:
            return await self._engine.abort(request_id)
        job.aborted = True
        if job.receiver is not None:
            job.receiver.cancel("the request was aborted")
        self._engine.abort_nowait(request_id)  # frees a reservation too
        return True

    # ---- phases of one Decode call ------------------------------------------------------

    async def _reserve(
        self,
        job: DecodeJob,
        request: node_pb2.DecodeRequest,
        params: SamplingParams,
        context: grpc.aio.ServicerContext,
    ) -> TPReceiver:
        """Blocks for the prompt's KV and the first token's, and a receiver for them."""
        request_id, prompt_len = job.request_id, len(request.prompt_token_ids)
        num_tokens = prompt_len + 1
        timeout_s = self.caps.timeout_s(request.transfer_timeout_s, self._transfer_timeout_s)
        num_blocks = -(-num_tokens // self._block_size)
        queue_timeout_s = self.admission.queue_timeout_s
        deadline = time.monotonic() + queue_timeout_s  # one wait for the cap and the blocks
        lookup = prefix_lookup(self._engine, request, params) if self._suffix else None
        try:
            # with a secret every caller proved it (the guard refuses others): the router
            job.hold = await self.caps.acquire(
                context.peer(), num_blocks, queue_timeout_s, trusted=self._kv_authenticated
            )
            wait_s = max(0.0, deadline - time.monotonic())
            reserved = await self.admission.reserve(request_id, num_tokens, wait_s, lookup)
        except (AdmissionRefused, TransferCapExceeded) as error:
            await refuse(context, error)
        except ValueError as error:  # the request id is in use in the engine
            await abort_call(context, grpc.StatusCode.ALREADY_EXISTS, str(error))
        job.block_ids, num_cached = reserved.block_ids, reserved.num_cached_blocks
        receiver = await self._hand_offs.open(
            job.block_ids[num_cached:], prompt_len, (timeout_s, self._max_handoff_s), request_id,
            num_cached,
        )  # fmt: skip
        job.receiver = receiver
        if job.aborted:  # while it waited for blocks: it falls back, to an abort
            receiver.cancel("the request was aborted")
        job.trace.transfer_id = receiver.transfer_id
        receiver.add_layer_callback(job.trace.on_layer_landed)
        receiver.add_finish_callback(self._metrics.transfer_finished)
        return receiver

    async def _after_transfer(
        self, job: DecodeJob, request: Request, receiver: TPReceiver
    ) -> AsyncIterator[node_pb2.TokenChunk]:
        """Resume from the received KV, or free the reservation and prefill locally."""
        state = await receiver.wait()
        job.trace.mark("kv_done")
        job.receiver = None
        if job.hold is not None:
            job.hold.release()  # the blocks are no longer awaiting KV
        first_token = receiver.first_token
        if state == TransferState.SUCCESS and first_token is not None and not job.aborted:
            return self._resume(job, request, job.block_ids, first_token)
        request_id = request.request_id
        self._release_reservation(request_id, receiver)
        if not job.aborted:
            logger.warning(
                "request %s: KV transfer %s failed (%s); prefilling locally",
                request_id, receiver.transfer_id, receiver.error,
            )  # fmt: skip
            self.counters.num_fallbacks += 1
        return self._prefill_locally(job, request)

    async def _resume(
        self,
        job: DecodeJob,
        request: Request,
        block_ids: Sequence[int],
        first_token: transfer_pb2.FirstToken,
    ) -> AsyncIterator[node_pb2.TokenChunk]:
        if job.aborted:  # checked right before the engine sees the request
            yield self._abort_chunk(job, 0)
            return
        # Received KV enters the prefix cache only when its sender proved the cluster secret
        # (every layer landed, or the receiver would not have succeeded).
        request.cache_kv = self._kv_authenticated
        job.trace.mark("decoding")
        job.trace.token_times_s.append(time.monotonic())
        first = node_pb2.TokenChunk(output_index=0, token_ids=[first_token.token_id])
        if first_token.HasField("logprob"):
            first.logprobs.append(first_token.logprob)
        yield first
        drafts = first_token.draft_token_ids  # its first step verifies them
        outputs = self._engine.resume(request, block_ids, first_token.token_id, drafts)
        async for chunk in self._chunks(job, outputs, next_index=1):
            yield chunk

    async def _prefill_locally(
        self, job: DecodeJob, request: Request
    ) -> AsyncIterator[node_pb2.TokenChunk]:
        if job.aborted:  # checked right before the engine sees the request
            yield self._abort_chunk(job, 0, prefilled_here=True)
            return
        job.trace.prefilled_locally = True
        self.counters.num_local_prefills += 1
        num_queued = request.num_tokens  # load, reported until the first token
        self.counters.num_queued_prefill_tokens += num_queued
        next_index = len(request.output_token_ids)  # a migrated request continues its output
        admitted = None
        try:
            admitted = await self.admission.admit_local(request.num_tokens)
            if job.aborted:  # while it waited for room
                yield self._abort_chunk(job, next_index, prefilled_here=True)
                return
            outputs = self._engine.generate(request)
            async for chunk in self._chunks(job, outputs, next_index=next_index):
                self.counters.num_queued_prefill_tokens -= num_queued
                num_queued = 0
                admitted.done()  # its prompt's blocks are the engine's now
                chunk.prefilled_here = True
                yield chunk
        except AdmissionRefused as error:
            raise Refused(error) from None
        finally:
            self.counters.num_queued_prefill_tokens -= num_queued
            if admitted is not None:
                admitted.done()

    async def _chunks(
        self, job: DecodeJob, outputs: AsyncIterator[StepOutput], next_index: int
    ) -> AsyncIterator[node_pb2.TokenChunk]:
        """One TokenChunk per engine output, numbered from `next_index`."""
        async for out in outputs:
            now = time.monotonic()
            job.trace.token_times_s.extend(now for _ in out.new_token_ids)
            chunk = node_pb2.TokenChunk(output_index=next_index, token_ids=out.new_token_ids)
            chunk.logprobs.extend(token_logprob(lp) for lp in out.new_logprobs or ())
            chunk.prompt_logprobs.extend(prompt_logprobs(out))  # a local prefill's, if asked
            next_index += len(out.new_token_ids)
            if out.finish_reason is not None:
                chunk.finish_reason = out.finish_reason.value
                chunk.num_cached_tokens = out.num_cached_tokens
                self._finish(job)
                logger.info(
                    "decode finished (%s): %d output tokens, prefilled %s, %d cached prompt "
                    "tokens", chunk.finish_reason, next_index,
                    "here" if job.trace.prefilled_locally else "by a prefill node",
                    out.num_cached_tokens,
                )  # fmt: skip
            yield chunk

    def _abort_chunk(
        self, job: DecodeJob, output_index: int, prefilled_here: bool = False
    ) -> node_pb2.TokenChunk:
        self._finish(job)
        return node_pb2.TokenChunk(
            output_index=output_index,
            finish_reason=FinishReason.ABORT.value,
            prefilled_here=prefilled_here,
        )

    def _finish(self, job: DecodeJob) -> None:
        job.finished = True
        self.counters.num_finished_requests += 1

    def _close(self, job: DecodeJob) -> None:
        """However the call ended: nothing of the request stays on this node."""
        self._jobs.pop(job.request_id, None)
        if job.hold is not None:
            job.hold.release()
        self.admission.notify()  # its blocks free up (the engine frees them at its next step)
        receiver = job.receiver
        if receiver is not None:
            receiver.cancel("the decode call ended")
        if not job.finished:
            self._release_reservation(job.request_id, receiver)

    def _release_reservation(self, request_id: str, receiver: TPReceiver | None) -> None:
        """Free the request's reserved blocks (or abort it, past its reservation): those of a
        transfer written in place only once its sender cannot write any more (its drained
        notice, or its deadline: TPReceiver.writes_settled)."""
        self.admission.release(request_id, receiver.writes_settled if receiver else None)
