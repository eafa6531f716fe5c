"""Compile once per digest, off the caller's thread, under a time limit; refusals cached."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine.structured import (
    GrammarCompiler,
    StructuredOutputBusyError,
    StructuredOutputConfig,
    StructuredOutputManager,
)
from pdserve.sampling_params import InvalidRequestError, SamplingParams
from pdserve.structured_output import StructuredOutputParams
from tests.waiting import wait_until

WAIT_S = 60.0  # a bound for a loaded machine; the checks never depend on it passing


def constrained(spec: StructuredOutputParams) -> SamplingParams:
    return SamplingParams(structured_output=spec)


class BlockingCompiler:
    """A compiler whose compiles wait for `release` (a compile that takes as long as a test
    wants), counting what it was asked."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self.vocab_size = compiler.vocab_size
        self.release = threading.Event()
        self.started = threading.Event()
        self.num_calls = 0

    def compile(self, params: StructuredOutputParams):
        self.num_calls += 1
        self.started.set()
        assert self.release.wait(WAIT_S)
        return self.compiler.compile(params)


def test_each_spec_compiles_once(compiler):
    manager = StructuredOutputManager(compiler)
    params = constrained(StructuredOutputParams.regex("[a-z]{3}"))
    first = manager.compile(params)
    assert manager.compile(params) is first
    assert manager.compile(constrained(StructuredOutputParams.regex("[a-z]{3}"))) is first
    assert manager.num_compiles == 1
    assert manager.compile(SamplingParams()) is None  # unconstrained: nothing to compile


def test_the_cache_is_bounded(compiler):
    manager = StructuredOutputManager(compiler, StructuredOutputConfig(max_cached_grammars=3))
    for i in range(5):
        manager.compile(constrained(StructuredOutputParams.choice([f"word{i}"])))
    assert manager.num_cached == 3
    assert manager.lookup(StructuredOutputParams.choice(["word0"])) is None  # evicted
    assert manager.lookup(StructuredOutputParams.choice(["word4"])) is not None


def test_a_refusal_is_cached_too(compiler):
    manager = StructuredOutputManager(compiler)
    params = constrained(StructuredOutputParams.regex("(unclosed"))
    for _ in range(2):
        with pytest.raises(InvalidRequestError, match="cannot be compiled"):
            manager.compile(params)
    assert manager.num_compiles == 1 and manager.num_compiling == 0


def test_a_slow_compile_is_refused_at_the_time_limit_and_cached_when_done(compiler):
    slow = BlockingCompiler(compiler)
    manager = StructuredOutputManager(slow, StructuredOutputConfig(compile_timeout_s=0.05))
    params = constrained(StructuredOutputParams.regex("[0-9]+"))
    with pytest.raises(InvalidRequestError, match="took longer than 0.05 s"):
        manager.compile(params)
    with pytest.raises(InvalidRequestError, match="took longer"):  # refused while it runs
        manager.compile(params, timeout_s=WAIT_S)
    slow.release.set()
    asyncio.run(wait_until(lambda: manager.num_compiling == 0, WAIT_S))  # the compile ends
    assert manager.compile(params) is not None  # its result replaced the refusal
    assert slow.num_calls == 1


def test_prepare_waits_off_the_event_loop_and_shares_one_compile(compiler):
    slow = BlockingCompiler(compiler)
    manager = StructuredOutputManager(slow)
    params = constrained(StructuredOutputParams.regex("x+"))

    async def main():
        waiters = [asyncio.create_task(manager.prepare(params, WAIT_S)) for _ in range(3)]
        ticks = 0
        while not slow.started.is_set() or ticks < 5:  # the loop keeps running meanwhile
            await asyncio.sleep(0.001)
            ticks += 1
        waiters[0].cancel()  # a cancelled asker leaves the compile to the others
        slow.release.set()
        results = await asyncio.gather(*waiters[1:])
        assert results[0] is results[1] is not None
        with pytest.raises(asyncio.CancelledError):
            await waiters[0]

    asyncio.run(asyncio.wait_for(main(), WAIT_S))
    assert slow.num_calls == 1


def test_prepare_refuses_at_the_deadline(compiler):
    slow = BlockingCompiler(compiler)
    manager = StructuredOutputManager(slow)
    params = constrained(StructuredOutputParams.regex("y+"))
    with pytest.raises(InvalidRequestError, match="took longer than 0.01 s"):
        asyncio.run(manager.prepare(params, timeout_s=0.01))
    slow.release.set()


def test_too_many_compiles_at_once_is_busy(compiler):
    slow = BlockingCompiler(compiler)
    config = StructuredOutputConfig(num_compile_threads=1, max_queued_compiles=2)
    manager = StructuredOutputManager(slow, config)
    manager.submit(StructuredOutputParams.regex("a+"))
    manager.submit(StructuredOutputParams.regex("b+"))
    manager.submit(StructuredOutputParams.regex("a+"))  # the same spec joins its compile
    with pytest.raises(StructuredOutputBusyError):
        manager.submit(StructuredOutputParams.regex("c+"))
    slow.release.set()


def test_without_a_tokenizer_structured_outputs_are_refused():
    manager = StructuredOutputManager(None)
    params = constrained(StructuredOutputParams.json_object())
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        manager.compile(params)
    assert manager.compile(SamplingParams()) is None
    assert manager.token_bitmask(__import__("torch").device("cpu")) is None


def test_grammar_for_checks_the_request_has_its_own(compiler):
    manager = StructuredOutputManager(compiler)
    params = constrained(StructuredOutputParams.regex("z+"))
    with pytest.raises(InvalidRequestError, match="not compiled"):
        manager.grammar_for(params, None)
    grammar = manager.compile(params)
    assert manager.grammar_for(params, None) is grammar  # found in the cache
    other = constrained(StructuredOutputParams.regex("w+"))
    with pytest.raises(InvalidRequestError, match="not the request's"):
        manager.grammar_for(other, grammar)
    with pytest.raises(InvalidRequestError, match="without one"):
        manager.grammar_for(SamplingParams(), grammar)
