"""`EngineCore`: the one object the node roles drive.

add_request(req) ─────────────┐                    (local prefill)
reserve(id, n) -> block_ids   │                    (decode role: blocks for incoming KV)
reserve_prefix(req, n)        │                    (... led by the prompt's cached prefix)
add_prefilled(req, ids, tok) ─┤                    (decode role: prompt KV in place)
                              v
step():  Scheduler.schedule() -> ModelRunner.launch() -> Scheduler.on_launched()
         -> LaunchedStep.wait() -> Scheduler.update_from_output() -> list[StepOutput]
         (prefill-only mode: StepOutput.prefill_done, blocks held)
         async scheduling: step n+1 is scheduled ahead and launched before step n is waited
         for, so step() returns step n's outputs while n+1 runs (see `step`)
abort(id) / release(id): free everything the request holds
close(): stop the tensor-parallel worker ranks (engine/distributed: rank 0 is this object)
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import torch

from engine.cuda_graphs import decode_graph_reserve_bytes, make_decode_graphs
from engine.distributed import TensorParallel, WorkerInit
from engine.engine_settings import async_scheduling_on, with_backend_block_size
from engine.engine_stats import EngineStats
from engine.kv_cache_manager import KVCacheManager
from engine.kv_cache_pool import KVCachePool
from engine.kv_offload import KVOffload, KVOffloadStats
from engine.kv_reservations import KVReservations, NoFreeBlocksError, PrefixReservation
from engine.model import LoadedModel, load_model, resolve_device, resolve_dtype
from engine.model.sources import resolve_model_source
from engine.model_runner import LaunchedStep, LayerHook, ModelRunner
from engine.outputs import StepOutput
from engine.prompt_logprobs import with_prompt_logprobs
from engine.request import Request, RequestStatus
from engine.request_checks import check_request
from engine.sampler import Sampler
from engine.scheduler import Scheduler
from engine.scheduler_output import SchedulerOutput
from engine.spec_decode import SpecDecodeParts, SpecDecodeStats
from engine.spec_decode.handoff_drafts import checked_drafts
from engine.structured import CompiledGrammar, StructuredOutputManager
from kernels.attention import get_attention_backend
from pdserve import envs
from pdserve.config import EngineConfig
from pdserve.sampling_params import InvalidRequestError, SamplingParams

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, on_layer_done: LayerHook | None = None, *,
                 worker_init: WorkerInit | None = None, tp: TensorParallel | None = None) -> None:  # fmt: skip
        """`worker_init` (tensor_parallel_size > 1): run in each worker rank's process with its
        EngineCore (engine/README.md, tensor parallelism); `tp`: set on a worker rank."""
        if tp is None and config.parallel.tensor_parallel_size > 1:  # rank 0 starts the others
            arch = resolve_model_source(config.model.model).arch  # (a GGUF converted here, once)
            tp = TensorParallel.start(config, arch, worker_init)
        self.tp = tp  # None at TP 1; each rank builds this engine around its shard
        try:
            self._init_engine(config, on_layer_done)
        except BaseException:
            self.close()
            raise

    def _init_engine(self, config: EngineConfig, on_layer_done: LayerHook | None) -> None:
        tp, device = self.tp, config.parallel.devices or config.model.device
        self.device = tp.device if tp else resolve_device(device)
        self.dtype = resolve_dtype(config.model.dtype, self.device, config.model.model)
        self.config = config = with_backend_block_size(config, self.device, self.dtype)
        self.on_layer_done, block_size = on_layer_done, config.cache.block_size
        self.attn_backend = get_attention_backend(
            config.model.attention_backend, self.device, self.dtype, block_size,
            cpu_decode_kernel=envs.cpu_attention_kernel(), kv_cache_dtype=config.cache.kv_cache_dtype,
        )  # fmt: skip
        self.loaded: LoadedModel = load_model(
            config.model, self.attn_backend, self.device, self.dtype, tp
        )
        self.arch = self.loaded.arch
        self.max_model_len = config.model.max_model_len or self.arch.max_position_embeddings
        if self.max_model_len > self.arch.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's context length "
                f"{self.arch.max_position_embeddings}"
            )
        self._init_memory(config, tp)
        if tp is not None:  # rank 0: publishes each step, waits until the group is ready
            tp.attach(self.runner)
        # Structured outputs (engine/structured/README.md): grammars and the sampler's masks
        self.structured = StructuredOutputManager.for_model(self.loaded.tokenizer_dir, self.arch)
        self.runner.token_bitmask = self.structured.token_bitmask(self.device)
        self._reservations = KVReservations(
            self.kv_cache_manager, self.kv_offload.settle if self.kv_offload else None
        )
        self.async_scheduling = async_scheduling_on(config, self.device)
        self._in_flight: tuple[SchedulerOutput, LaunchedStep] | None = None
        self.num_steps_ahead = 0  # steps launched before the previous one was waited for
        self._log_ready()

    def _init_memory(self, config: EngineConfig, tp: TensorParallel | None) -> None:
        """The KV pool (with a draft model's share), the host tier, the block ledger, the
        scheduler, the graphs and the runner."""
        use_graphs, block_size = self._decode_graphs_usable(), config.cache.block_size
        spec_parts = SpecDecodeParts(
            config, self.loaded, self.attn_backend, self.device, self.dtype, self.max_model_len
        )  # (a draft model's weights load before the pool is sized)
        reserve = decode_graph_reserve_bytes(self.arch, config.scheduler.max_num_seqs)
        self.pool = KVCachePool(
            self.loaded.model.arch, config.cache, self.device, self.dtype,  # (this rank's heads)
            reserve_bytes=reserve + spec_parts.reserve_bytes() if use_graphs else 0,
            extra_bytes_per_block=spec_parts.extra_bytes_per_block(),
            agree=tp.agree_num_blocks if tp else None,
        )  # fmt: skip
        self.pool.attach_scales(self.loaded.model.model.layers)  # (FP8 KV: its scales)
        self.kv_offload = KVOffload.build(config.cache, self.pool)  # None: no host tier
        self.kv_cache_manager = KVCacheManager(
            self.pool.num_blocks, block_size, config.cache.enable_prefix_caching,
            config.cache.prefix_cache_salt, self.kv_offload.host_blocks if self.kv_offload else None,
        )  # fmt: skip
        self.spec, verify_graphs = spec_parts.build(self.pool, use_graphs)
        sched = config.scheduler
        self.scheduler = Scheduler(sched, self.kv_cache_manager, self.max_model_len, self.spec)
        decode_graphs = make_decode_graphs(
            self.loaded.model, self.pool.kv_caches, sched.max_num_seqs, self.max_model_len,
            self.pool.scratch_block, self.device, not config.model.enforce_eager,
        ) if use_graphs else None  # fmt: skip
        self.runner = ModelRunner(
            self.loaded.model, self.pool.kv_caches, block_size, Sampler(seed=config.model.seed),
            self.device, self.pool.scratch_block, decode_graphs, verify_graphs,
            self.spec.observe if self.spec is not None else None,
        )  # fmt: skip

    def _log_ready(self) -> None:
        graphs, spec = self.runner.decode_graphs, self.config.speculative
        logger.info(
            "engine ready: model=%s device=%s dtype=%s attention=%s kv_blocks=%d x %d tokens "
            "(%s) decode=%s async_scheduling=%s speculative=%s",
            self.loaded.name, self.device, self.dtype, self.attn_backend.name,
            self.pool.num_blocks, self.pool.block_size, self.pool.dtype,
            "eager" if graphs is None or not graphs.captured else
            f"cuda graphs (batch <= {graphs.sizes[-1]}, {graphs.capture_s:.1f} s, "
            f"{graphs.pool_bytes / (1 << 20):.0f} MiB)",
            self.async_scheduling,
            f"{spec.speculative_method} K={spec.num_speculative_tokens}" if self.spec else "off",
        )  # fmt: skip

    def _decode_graphs_usable(self) -> bool:
        """Static decode buffers (and graphs unless enforce_eager): CUDA, and a backend whose
        graph decode covers this context length."""
        limit = self.attn_backend.graph_max_context
        return self.device.type == "cuda" and (limit is None or self.max_model_len <= limit)

    def layer_ready(self, layer_idx: int) -> torch.cuda.Event | None:
        """In a prefill step's hook: the CUDA event after layer `layer_idx`'s KV write (wait
        on it before reading that KV on another stream or the host); None on CPU."""
        return self.runner.layer_ready(layer_idx)

    # ---- requests -------------------------------------------------------------------------

    def make_request(self, request_id: str, prompt_token_ids: Sequence[int],
                     params: SamplingParams, cache_salt: str = "",
                     grammar: CompiledGrammar | None = None) -> Request:  # fmt: skip
        """Build a validated request carrying this model's EOS ids (its prefix-cache namespace
        `cache_salt`; `grammar`: `structured.prepare`'s). Reads only the fixed configuration
        (model, context, pool size): any thread may call it (the nodes' event loops do)."""
        self.validate(prompt_token_ids, params)
        return Request(request_id=request_id, prompt_token_ids=list(prompt_token_ids),
                       sampling_params=params, eos_token_ids=self.arch.eos_token_ids,
                       cache_salt=cache_salt,
                       grammar=self.structured.grammar_for(params, grammar))  # fmt: skip

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        check_request(
            prompt_token_ids, params, self.arch.vocab_size, self.max_model_len,
            self.pool.num_blocks * self.pool.block_size, tensor_parallel=self.tp is not None,
        )  # fmt: skip

    def add_request(self, request: Request) -> None:
        self._check_new_id(request.request_id)
        self.validate(request.prompt_token_ids, request.sampling_params)
        self.structured.start_matcher(request)  # advanced by its output (a migrated request)
        self.scheduler.add_request(request)

    def reserve(self, request_id: str, num_tokens: int) -> list[int]:
        """Take blocks for `num_tokens` tokens of incoming KV (decode role)."""
        self._check_new_id(request_id)
        return self._reservations.reserve(request_id, num_tokens).block_ids

    def reserve_prefix(self, request: Request, num_tokens: int) -> PrefixReservation:
        """Blocks for `num_tokens` tokens of `request`'s incoming KV, led by its prompt's
        longest cached prefix (held from now on): the peer sends only the rest."""
        self._check_new_id(request.request_id)
        return self._reservations.reserve_prefix(request, num_tokens)

    def add_prefilled(
        self,
        request: Request,
        block_ids: Sequence[int],
        first_token: int,
        draft_token_ids: Sequence[int] = (),
    ) -> None:
        """Admit a request whose prompt KV already sits in `block_ids` (from `reserve`), with
        the first token sampled elsewhere; it continues decoding from position prompt_len.
        `draft_token_ids`: drafts proposed after the first token (the first step verifies them;
        spec_decode/handoff_drafts.py)."""
        self._reservations.admit(request, block_ids)
        request.num_computed_tokens = request.prompt_len
        request.output_token_ids = [first_token]
        if self.spec is not None and self.spec.speculates(request):
            request.draft_token_ids = checked_drafts(draft_token_ids, self.spec, self.arch)
        try:
            self.structured.start_matcher(request)  # advanced by the first token (or raises)
            self.scheduler.add_prefilled(request)
        except BaseException:
            # The reservation is spent either way: free it rather than leak it.
            self.kv_cache_manager.free(request)
            raise

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks. True if it was known."""
        if self._reservations.release(request_id):
            return True
        return self.scheduler.abort(request_id) is not None

    def detach_reservation(self, request_id: str) -> list[int]:
        """Take `request_id`'s reserved blocks away from it without freeing them (a KV writer
        may still land in them); give them back with `free_blocks`. [] if it has none."""
        return self._reservations.detach(request_id)

    def free_blocks(self, block_ids: Sequence[int]) -> None:
        """Free blocks `detach_reservation` handed out."""
        self.kv_cache_manager.free_blocks(block_ids)

    def release(self, request_id: str) -> None:
        """Prefill-only mode: the transfer resolved; free the request's held blocks."""
        self.scheduler.release(request_id)

    # ---- stepping -------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Run one step; return the outputs of the step that completed.

        Without async scheduling: schedule, launch, wait, update. With it, a step launched
        by the previous call is in flight: the next one is scheduled ahead and launched first
        (`Scheduler.schedule_ahead`), then the one in flight is waited for and its outputs
        returned, so the host's work overlaps the device's. When the next step cannot be
        chosen ahead (a slot only preemption could free), the one in flight is waited for
        first and the next is scheduled as usual and left in flight. A constrained step launched
        ahead samples once the one in flight landed (`ModelRunner.launch`, defer_sampling)."""
        if not self.async_scheduling:
            scheduler_output = self.scheduler.schedule()
            if scheduler_output.is_empty:
                return self.scheduler.drain_finished_outputs()
            return self._wait(scheduler_output, self._launch(scheduler_output))
        outputs: list[StepOutput] = []
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            ahead = self.scheduler.schedule_ahead()
            if ahead is not None:
                self._in_flight = (ahead, self._launch(ahead, prev=in_flight[1]))
                self.num_steps_ahead += 1
            outputs = self._wait(*in_flight)
            if self._in_flight is not None:
                self._sample_deferred(*self._in_flight)
                return outputs
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return outputs + self.scheduler.drain_finished_outputs()
        self._in_flight = (scheduler_output, self._launch(scheduler_output))
        return outputs

    def _launch(
        self, scheduler_output: SchedulerOutput, prev: LaunchedStep | None = None
    ) -> LaunchedStep:
        if self.kv_offload is not None:
            self.kv_offload.flush()  # host-tier copies first: the step reads promoted blocks
        if self.spec is not None:  # draft slots -> verify chunks (drafts proposed now)
            self.spec.fill_drafts(scheduler_output, self.kv_cache_manager)
        defer = prev is not None and scheduler_output.has_grammar  # masks need prev's tokens
        launched = self.runner.launch(scheduler_output, self.on_layer_done, prev, defer)
        self.scheduler.on_launched(scheduler_output, sampled=not defer)
        return launched

    def _sample_deferred(self, scheduler_output: SchedulerOutput, launched: LaunchedStep) -> None:
        if launched.deferred is not None:  # the step before it landed: masks can be built
            self.runner.sample_deferred(launched)
            self.scheduler.on_sampled(scheduler_output)

    def _wait(self, scheduler_output: SchedulerOutput, launched: LaunchedStep) -> list[StepOutput]:
        result = launched.wait()
        outputs = self.scheduler.update_from_output(
            scheduler_output, result.sampled, result.verified
        )
        return with_prompt_logprobs(outputs, scheduler_output, result.prompt_logprobs)

    def close(self) -> None:
        """Stop the tensor-parallel worker ranks and leave the group (nothing at TP 1)."""
        if self.tp is not None:
            self.tp.close()

    def has_unfinished(self) -> bool:
        return self._in_flight is not None or self.scheduler.has_unfinished()

    def get_request(self, request_id: str) -> Request | None:
        return self.scheduler.get_request(request_id)

    def check_no_leaks(self) -> None:
        """Assert every KV block is free (or evictable prefix cache) once nothing runs."""
        assert not self._reservations, f"reservations still held: {self._reservations.ids()}"
        assert self._in_flight is None, "a launched step was never waited for"
        self.kv_cache_manager.check_no_leaks()

    def stats(self) -> EngineStats:
        prefix = self.kv_cache_manager.prefix_cache_stats
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_prefilled_held=self.scheduler.num_prefilled_held,
            num_reserved=len(self._reservations),
            num_total_blocks=self.kv_cache_manager.num_total_blocks,
            num_free_blocks=self.kv_cache_manager.num_free_blocks,
            prefix_cache_hit_tokens=prefix.hit_tokens, prefix_cache_query_tokens=prefix.query_tokens,
            prompt_tokens_computed=self.scheduler.num_prompt_tokens_computed,
            kv_offload=self.kv_offload.stats(prefix.host_hit_tokens)
            if self.kv_offload is not None else KVOffloadStats(),
            spec_decode=dataclasses.replace(self.spec.stats) if self.spec else SpecDecodeStats(),
        )  # fmt: skip

    def _check_new_id(self, request_id: str) -> None:
        if request_id in self._reservations or self.scheduler.get_request(request_id) is not None:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")


__all__ = ["EngineCore", "EngineStats", "NoFreeBlocksError", "RequestStatus"]
