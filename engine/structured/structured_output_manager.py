"""`StructuredOutputManager`: each spec compiled once, off the engine thread and off any event
loop, under a time limit, cached by digest.

```
prepare(params, timeout_s)  (async: nodes)  ─┐
compile(params, timeout_s)  (blocking: LLM) ─┴─► cached? ─ yes ─► CompiledGrammar (or its error)
                                                  │ no                  └─► make_request(grammar=)
                                                  │ no
                                                  ▼
        one compile per digest in flight (later askers share it), at most max_queued_compiles
        ─► ThreadPoolExecutor(num_compile_threads): GrammarCompiler.compile (GIL released)
        ─► the result, or InvalidRequestError, enters the LRU (max_cached_grammars)
```

A caller waits at most `timeout_s` (default `compile_timeout_s`): past it, InvalidRequestError
says the spec took too long, and the spec is refused from the cache until its compile ends
(then its result replaces the refusal). The compile itself cannot be interrupted; llguidance's
limits bound it (every hostile spec of `benchmarks/bench_grammar_engines.py` ended within
2 s, see README.md). Its grammar construction recurses once per level of rule nesting: a
128 KiB `$ref` or rule chain (1500 levels) overflows an 8 MiB thread stack (a segfault), so the
compile threads get `COMPILE_STACK_BYTES` (virtual memory; 64 MiB measured enough for 20000
levels). The engine never waits for a compile: a request is added only with its grammar
compiled (`EngineCore.make_request`).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from engine.model.arch_config import ModelArchConfig
from engine.structured.grammar_compiler import (
    CompiledGrammar,
    GrammarCompiler,
    load_grammar_compiler,
)
from engine.structured.grammar_matcher import GrammarMatcher
from engine.structured.token_bitmask import TokenBitmask
from pdserve.sampling_params import InvalidRequestError, SamplingParams
from pdserve.structured_output import StructuredOutputParams

logger = logging.getLogger(__name__)
COMPILE_STACK_BYTES = 256 << 20


class StructuredOutputBusyError(RuntimeError):
    """Too many grammars are compiling: retry later (RESOURCE_EXHAUSTED / HTTP 429)."""


@dataclass(frozen=True)
class StructuredOutputConfig:
    compile_timeout_s: float = 10.0  # the longest a request waits for its grammar
    max_cached_grammars: int = 256  # compiled grammars (and refusals) kept, LRU
    num_compile_threads: int = 2
    max_queued_compiles: int = 64  # distinct specs compiling or queued; more: busy
    num_mask_threads: int = 1  # > 1: batch masks filled in parallel (llguidance's executor)


Cached = CompiledGrammar | InvalidRequestError


class ConstrainedRequest(Protocol):
    """What `start_matcher` reads and sets of an engine request."""

    sampling_params: SamplingParams
    output_token_ids: list[int]
    grammar: CompiledGrammar | None
    matcher: GrammarMatcher | None


class StructuredOutputManager:
    def __init__(
        self, compiler: GrammarCompiler | None, config: StructuredOutputConfig | None = None
    ) -> None:
        """`compiler`: None for a model without a tokenizer (structured outputs refused)."""
        self.compiler = compiler
        self.config = config = config or StructuredOutputConfig()
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Cached] = OrderedDict()
        self._compiling: dict[str, Future[CompiledGrammar]] = {}
        self._pool = CompileThreads(config.num_compile_threads)
        self.num_compiles = 0  # compiles started (cache misses)

    @classmethod
    def for_model(
        cls,
        tokenizer_dir: Path | None,
        arch: ModelArchConfig,
        config: StructuredOutputConfig | None = None,
    ) -> StructuredOutputManager:
        """The manager of a model: its tokenizer.json (when it has one) against its vocabulary
        and EOS ids (the grammar compiler is made once per process for each)."""
        compiler = None
        if tokenizer_dir is not None and arch.eos_token_ids:
            try:
                compiler = load_grammar_compiler(
                    tokenizer_dir / "tokenizer.json", arch.vocab_size, tuple(arch.eos_token_ids)
                )
            except ValueError as error:  # e.g. EOS ids the tokenizer does not know
                logger.warning("structured outputs are off for this model: %s", error)
        return cls(compiler, config)

    def token_bitmask(self, device: torch.device) -> TokenBitmask | None:
        """The sampler's mask builder on `device`; None when nothing can be constrained."""
        if self.compiler is None:
            return None
        return TokenBitmask(self.compiler.vocab_size, device, self.config.num_mask_threads)

    # ---- what nodes and the engine call --------------------------------------------------

    async def prepare(
        self, params: SamplingParams, timeout_s: float | None = None
    ) -> CompiledGrammar | None:
        """The compiled grammar of `params.structured_output` (None without one), awaited
        without blocking the loop, at most `timeout_s` (e.g. the request's deadline; never
        above `compile_timeout_s`): pass it to `EngineCore.make_request`. A cancelled caller
        leaves the compile running for the cache and for other askers of the same spec.
        InvalidRequestError: a refused spec, or too slow; StructuredOutputBusyError: retry."""
        spec = self._spec(params)
        if spec is None:
            return None
        timeout_s = self._timeout(timeout_s)
        future = asyncio.wrap_future(self.submit(spec))
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except TimeoutError:
            raise self._timed_out(spec, timeout_s) from None

    def compile(
        self, params: SamplingParams, timeout_s: float | None = None
    ) -> CompiledGrammar | None:
        """`prepare`, blocking (offline use and tests; never on an event loop)."""
        spec = self._spec(params)
        if spec is None:
            return None
        timeout_s = self._timeout(timeout_s)
        try:
            return self.submit(spec).result(timeout_s)
        except FutureTimeoutError:
            raise self._timed_out(spec, timeout_s) from None

    def grammar_for(
        self, params: SamplingParams, grammar: CompiledGrammar | None
    ) -> CompiledGrammar | None:
        """The grammar a request of `params` runs under: `grammar` (checked to be its spec's)
        or the cached one; InvalidRequestError when it has not been compiled."""
        spec = self._spec(params)
        if spec is None:
            if grammar is not None:
                raise InvalidRequestError("a grammar was given for a request without one")
            return None
        grammar = grammar or self.lookup(spec)
        if grammar is None:
            raise InvalidRequestError(
                "structured output: the grammar is not compiled; await "
                "EngineCore.structured.prepare(params) before making the request",
                "structured_output",
            )
        if grammar.digest != spec.digest:
            raise InvalidRequestError("the grammar given is not the request's structured_output")
        return grammar

    def start_matcher(self, request: ConstrainedRequest) -> None:
        """Give a request being added its own matcher (if it has a grammar: its own, or the
        cached one), advanced by the output tokens it already has; InvalidRequestError when
        its grammar is not compiled or refuses one of them."""
        request.grammar = self.grammar_for(request.sampling_params, request.grammar)
        if request.grammar is not None and request.matcher is None:
            request.matcher = request.grammar.new_matcher(request.output_token_ids)

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    def lookup(self, params: StructuredOutputParams) -> CompiledGrammar | None:
        """The compiled grammar if cached (raises its cached refusal), else None. Never waits."""
        with self._lock:
            cached = self._touch(params.digest)
        if isinstance(cached, InvalidRequestError):
            raise cached
        return cached

    def submit(self, params: StructuredOutputParams) -> Future[CompiledGrammar]:
        """A future of the compiled grammar: done at once when cached, else the compile in
        flight for this digest (started now if there is none)."""
        digest = params.digest
        with self._lock:
            cached = self._touch(digest)
            if cached is not None:
                done: Future[CompiledGrammar] = Future()
                if isinstance(cached, InvalidRequestError):
                    done.set_exception(cached)
                else:
                    done.set_result(cached)
                return done
            future = self._compiling.get(digest)
            if future is not None:
                return future
            if len(self._compiling) >= self.config.max_queued_compiles:
                raise StructuredOutputBusyError(
                    f"{len(self._compiling)} grammars are compiling; retry shortly"
                )
            future = self._pool.submit(self._compile, params)  # (compiler set: see _spec)
            self._compiling[digest] = future
            self.num_compiles += 1
            return future

    def close(self) -> None:
        """Stop the compile threads once the compiles queued so far are done."""
        self._pool.close()

    # ---- internals -----------------------------------------------------------------------

    def _spec(self, params: SamplingParams) -> StructuredOutputParams | None:
        if params.structured_output is not None and self.compiler is None:
            raise InvalidRequestError(
                "structured outputs need the model's tokenizer, and this model has none",
                "structured_output",
            )
        return params.structured_output

    def _timeout(self, timeout_s: float | None) -> float:
        limit = self.config.compile_timeout_s
        return limit if timeout_s is None else max(0.0, min(timeout_s, limit))

    def _touch(self, digest: str) -> Cached | None:
        cached = self._cache.get(digest)
        if cached is not None:
            self._cache.move_to_end(digest)
        return cached

    def _store(self, digest: str, value: Cached) -> None:
        self._cache[digest] = value
        self._cache.move_to_end(digest)
        while len(self._cache) > self.config.max_cached_grammars:
            self._cache.popitem(last=False)

    def _compile(self, params: StructuredOutputParams) -> CompiledGrammar:
        """In a compile thread: compile, cache the result or the refusal."""
        digest = params.digest
        assert self.compiler is not None
        try:
            compiled = self.compiler.compile(params)
        except InvalidRequestError as error:
            with self._lock:
                self._store(digest, error)
                self._compiling.pop(digest, None)
            raise
        except Exception as error:
            logger.exception("compiling a %s failed", params.kind.value)
            refusal = InvalidRequestError(
                f"structured output: the {params.kind.value} cannot be compiled: {error}",
                "structured_output",
            )
            with self._lock:
                self._store(digest, refusal)
                self._compiling.pop(digest, None)
            raise refusal from error
        with self._lock:
            self._store(digest, compiled)
            self._compiling.pop(digest, None)
        return compiled

    def _timed_out(self, params: StructuredOutputParams, timeout_s: float) -> InvalidRequestError:
        error = InvalidRequestError(
            f"structured output: compiling the {params.kind.value} took longer than "
            f"{timeout_s:g} s; simplify it",
            "structured_output",
        )
        with self._lock:  # refused from the cache while it still compiles
            if params.digest in self._compiling:
                self._store(params.digest, error)
        logger.warning("a %s compile passed %.3g s", params.kind.value, timeout_s)
        return error


class CompileThreads:
    """Daemon threads with `COMPILE_STACK_BYTES` of stack, taking jobs from one queue; started
    by the first job (an engine that never compiles has none)."""

    def __init__(self, num_threads: int) -> None:
        self._num_threads = num_threads
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def submit(
        self,
        fn: Callable[[StructuredOutputParams], CompiledGrammar],
        params: StructuredOutputParams,
    ) -> Future[CompiledGrammar]:
        future: Future[CompiledGrammar] = Future()

        def job() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(params))
            except BaseException as error:
                future.set_exception(error)

        self._start()
        self._jobs.put(job)
        return future

    def close(self) -> None:
        with self._lock:
            for _ in self._threads:
                self._jobs.put(None)
            self._threads = []

    def _start(self) -> None:
        with self._lock:
            if self._threads:
                return
            previous = threading.stack_size(COMPILE_STACK_BYTES)  # for the threads made here
            try:
                for i in range(self._num_threads):
                    thread = threading.Thread(
                        target=self._run, name=f"grammar-compile-{i}", daemon=True
                    )
                    thread.start()
                    self._threads.append(thread)
            finally:
                threading.stack_size(previous)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()
