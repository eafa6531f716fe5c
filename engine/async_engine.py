"""`AsyncEngine`: runs an `EngineCore` on its own thread; the nodes' one way to the engine.

    asyncio callers ──command──> EngineThread (engine/engine_thread.py): commands, step()
    engine thread ──result, StepOutput──> loop.call_soon_threadsafe ──> future, request stream
                                          (RequestStreams, engine/request_streams.py)

What the nodes call (the engine thread is the only one that touches the EngineCore):

    generate(request)                        add for local prefill; stream its outputs
    resume(request, block_ids, first_token)  admit a request whose prompt KV is in place; stream
    abort(request_id) -> bool                end its stream now; the engine frees it after
    abort_nowait(request_id[, at_once])      the same, not waiting (at_once=False: the stream
                                             ends after the engine's abort, not before)
    release_nowait(request_id)               prefill-only: free a finished prefill's blocks
    reserve(request_id, num_tokens)          blocks for incoming KV (NoFreeBlocksError: none)
    reserve_prefix(request, num_tokens)      ... led by its prompt's cached prefix (held)
    detach_reservation(request_id)           a reservation's blocks, out of the engine's hands
    kv_events([snapshot])                    block hashes the prefix cache stored / removed
    free_blocks_nowait(block_ids)            ... given back once no KV writer can touch them
    stats() / last_stats                     after the current step / as of the last step
    prepare_structured(params)               a request's grammar, compiled off the loop (cached)
    add_dead_callback(cb)                    cb(error) once the engine thread ended
    validate(...), make_request(...),        on the caller's thread (fixed configuration only)
      hash_prompt_ahead()
    check_no_leaks(), reset_prefix_cache()   tests and operators

No fixed timeout decides anything here: an awaited command waits for the engine thread to
reach it, however long its current step runs, and the caller's own deadline (a gRPC deadline, a
transfer deadline) bounds that wait by cancelling it. A command whose caller went away still
runs, in order, so an abort queued behind an add always finds what the add did. A request's
stream ends after the output that finishes it (or marks its prefill done, in prefill-only
mode), at once on an abort (the engine's own abort follows when it gets there; outputs the
engine publishes before that are stale and dropped), or when its consumer stops reading (then
the request is aborted). When the engine thread ends (stop, or a step raised), every pending
command and stream fails with EngineDeadError: nothing waits forever.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

from engine.block_hash import request_block_hashes
from engine.engine_core import EngineCore, EngineStats
from engine.engine_thread import EngineDeadError, EngineThread
from engine.kv_events import KVEventBatch
from engine.kv_reservations import PrefixReservation
from engine.outputs import StepOutput
from engine.request import FinishReason, Request
from engine.request_streams import RequestStreams, log_error, log_failure, settle
from engine.spec_decode.handoff_drafts import first_drafts
from engine.structured import CompiledGrammar
from pdserve.block_hash import BlockHash
from pdserve.sampling_params import SamplingParams

T = TypeVar("T")

__all__ = ["AsyncEngine", "EngineDeadError"]


class AsyncEngine:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._thread = EngineThread(core, self._deliver, self._engine_ended)
        self._streams = RequestStreams(core, self._thread)  # each request's outputs, aborts
        self._dead_callbacks: list[Callable[[EngineDeadError], None]] = []
        # How the prefix cache hashes blocks (fixed at start), for hash_prompt_ahead.
        kv = core.kv_cache_manager
        self._block_hashing = (kv.block_size, kv.root_for) if kv.enable_prefix_caching else None

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start(asyncio.get_running_loop())

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the engine thread after its current step (waiting at most `timeout_s` for it);
        pending commands and streams then fail with EngineDeadError."""
        await self._thread.stop(timeout_s)

    @property
    def last_stats(self) -> EngineStats:
        """The engine's stats as of its last step or command, without waiting for it (a
        registry heartbeat must not wait for a long prefill step)."""
        return self._thread.last_stats

    # ---- requests -------------------------------------------------------------------------

    async def prepare_structured(
        self, params: SamplingParams, timeout_s: float | None = None
    ) -> CompiledGrammar | None:
        """The compiled grammar of `params.structured_output` (None without one), compiled off
        the engine thread and this loop (cached by digest), waited for at most `timeout_s`
        (the request's deadline): pass it to `make_request`. InvalidRequestError: refused or
        too slow; StructuredOutputBusyError: too many compiling, retry later."""
        return await self.core.structured.prepare(params, timeout_s)

    def make_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        cache_salt: str = "",
        grammar: CompiledGrammar | None = None,
    ) -> Request:
        """A validated Request (InvalidRequestError if not), built on the caller's thread:
        `EngineCore.make_request` reads only fixed configuration, and a trip to the engine
        thread would wait for its current step. A structured output needs `grammar` from
        `prepare_structured` (or its spec compiled and cached)."""
        return self.core.make_request(request_id, prompt_token_ids, params, cache_salt, grammar)

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """`make_request`'s checks without its grammar (InvalidRequestError), on the caller's
        thread: a node refuses a bad request before it reserves or compiles anything."""
        self.core.validate(prompt_token_ids, params)

    @property
    def vocab_size(self) -> int:
        return self.core.arch.vocab_size

    async def generate(self, request: Request) -> AsyncIterator[StepOutput]:
        """Add a request for local prefill and stream its outputs (an add the engine refuses
        raises from the stream)."""
        stream = self._streams.open(request, lambda: self.core.add_request(request))
        async for out in self._streams.drain(request, stream):
            yield out

    async def resume(
        self,
        request: Request,
        block_ids: Sequence[int],
        first_token: int,
        drafts: Sequence[int] = (),
    ) -> AsyncIterator[StepOutput]:
        """Admit a request whose prompt KV is in its reserved blocks (with the `drafts` its
        prefill node proposed after the first token); stream its outputs."""
        stream = self._streams.open(
            request, lambda: self.core.add_prefilled(request, block_ids, first_token, drafts)
        )
        async for out in self._streams.drain(request, stream):
            yield out

    def first_drafts(self, request: Request, first_token: int) -> list[int]:
        """The drafts a prefill node sends with `first_token` (spec_decode/handoff_drafts.py);
        reads only the fixed configuration: any thread may call it."""
        return first_drafts(self.core.config.speculative, request, first_token)

    async def abort(self, request_id: str) -> bool:
        """Abort wherever the request is. Its stream, if any, ends at once with finish_reason
        abort, and the answer is True without waiting for the engine; otherwise (a reservation,
        or nothing) the engine's own answer, once it gets to it: whether it knew the id."""
        streaming = self._streams.end(request_id)
        try:
            known = self._streams.queue_abort(request_id, lambda: self.core.abort(request_id))
        except EngineDeadError:  # the engine holds nothing any more
            return streaming
        if streaming:
            known.add_done_callback(log_failure)
            return True
        return await known

    def abort_nowait(self, request_id: str, at_once: bool = True) -> None:
        """`abort` without waiting for anything (cleanup in a call that may be cancelled);
        nothing when the engine is gone (it holds nothing any more). `at_once=False`: its
        stream ends only once the engine's own abort has run, so what the engine publishes
        before that (the first token of a prefill in the step under way) still arrives."""
        if at_once:
            self._streams.end(request_id)
            self._streams.abort_unawaited(request_id, lambda: self.core.abort(request_id))
            return
        stream = self._streams.get(request_id)

        def done(result: Any, error: BaseException | None) -> None:
            if stream is not None:  # (no longer read if its request finished meanwhile)
                stream.put_nowait(StepOutput(request_id, [], finish_reason=FinishReason.ABORT))
            log_error(result, error)

        with contextlib.suppress(EngineDeadError):  # (dead: the engine holds nothing any more)
            self._thread.submit(lambda: self.core.abort(request_id), done)

    def release_nowait(self, request_id: str) -> None:
        """Prefill-only: the hand-off resolved; the engine frees the request's held blocks
        before its next step (an error is logged)."""
        self._post(lambda: self.core.release(request_id))

    async def reserve(self, request_id: str, num_tokens: int) -> list[int]:
        """Blocks for `num_tokens` tokens of incoming KV (decode role). NoFreeBlocksError: not
        now; InvalidRequestError: the id is in use."""
        return await self._ask(lambda: self.core.reserve(request_id, num_tokens))

    async def reserve_prefix(self, request: Request, num_tokens: int) -> PrefixReservation:
        """Blocks for `num_tokens` tokens of `request`'s incoming KV, led by its prompt's
        longest cached prefix (either tier), which the peer need not send; the hits are held
        from now on (freed with the reservation). Hash the prompt first (`hash_prompt_ahead`)
        to spare the engine thread. NoFreeBlocksError: not now; InvalidRequestError: the id
        is in use."""
        return await self._ask(lambda: self.core.reserve_prefix(request, num_tokens))

    async def kv_events(
        self, snapshot: bool = False
    ) -> tuple[KVEventBatch, list[BlockHash] | None]:
        """The block hashes the prefix cache (both tiers) stored and removed since the last
        call, and with `snapshot` every hash it holds after them (the first call starts the
        log and answers with a snapshot: engine/kv_events.py)."""
        return await self._ask(lambda: self.core.kv_cache_manager.read_kv_events(snapshot))

    async def detach_reservation(self, request_id: str) -> list[int]:
        """Take `request_id`'s reserved blocks from it without freeing them (a KV writer may
        still land in them); give them back with `free_blocks_nowait`. [] if it has none."""
        return await self._ask(lambda: self.core.detach_reservation(request_id))

    def free_blocks_nowait(self, block_ids: Sequence[int]) -> None:
        """Free blocks `detach_reservation` handed out (before the engine's next step)."""
        self._post(lambda: self.core.free_blocks(block_ids))

    def hash_prompt_ahead(self, request: Request) -> None:
        """Hash the full blocks of a request's prompt on the caller's thread, before the engine
        holds it (a decode node, while the prompt's KV is on its way): admitting it then finds
        the prefix cache's digests computed instead of hashing them on the engine thread
        (an 8K-token prompt: ~1 ms on the 2-core CPU VM, `pdserve.block_hash.block_hashes`
        timed alone; every running request's next step waited that long). Nothing when prefix
        caching is off."""
        if self._block_hashing is not None:
            block_size, root_for = self._block_hashing
            root = root_for(request)
            request_block_hashes(request, request.prompt_len // block_size, block_size, root)

    # ---- state ----------------------------------------------------------------------------

    async def stats(self) -> EngineStats:
        """The engine's stats once its current step is done (`last_stats`: without waiting)."""
        return await self._ask(self.core.stats)

    async def check_no_leaks(self) -> None:
        """AssertionError unless every KV block is free (or evictable) and nothing is held."""
        await self._ask(self.core.check_no_leaks)

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached block; False (refused) while any block is in use."""
        return await self._ask(self.core.kv_cache_manager.reset_prefix_cache)

    # ---- commands -------------------------------------------------------------------------

    async def _ask(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread; its result (or its error). Cancelling the wait does
        not stop the command."""
        future: asyncio.Future[T] = self._thread.loop().create_future()
        self._thread.submit(fn, lambda result, error: settle(future, result, error))
        return await future

    def _post(self, fn: Callable[[], object]) -> None:
        """Run `fn` on the engine thread, not waiting; an error is logged. Nothing when the
        engine is gone (what `fn` would free went with it)."""
        with contextlib.suppress(EngineDeadError):
            self._thread.submit(fn, log_error)

    # ---- the engine thread's callbacks ---------------------------------------------------

    def add_dead_callback(self, callback: Callable[[EngineDeadError], None]) -> None:
        """Call `callback(error)` on the event loop when the engine thread ends (stopped, or a
        step raised: e.g. a tensor-parallel rank died or hung)."""
        self._dead_callbacks.append(callback)

    def _deliver(self, outputs: list[StepOutput]) -> None:
        self._streams.deliver(outputs)

    def _engine_ended(self, error: EngineDeadError) -> None:
        self._streams.fail(error)
        for callback in self._dead_callbacks:
            callback(error)
