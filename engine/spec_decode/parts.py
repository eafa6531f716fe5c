"""`SpecDecodeParts`: what EngineCore builds for speculative decoding, in two phases.

```
before the KV pool is sized   the draft model's weights (--speculative-method draft), checked
                              against the target; its KV's share of every block
                              (extra_bytes_per_block) and its graphs' memory (reserve_bytes)
after                         the draft's own pool (the target's block count and size), its
                              decode and verify graphs, the proposer, the SpecDecoder; the
                              target's verify graphs (K + 1 tokens per request)
```
"""

from __future__ import annotations

import dataclasses

import torch

from engine.cuda_graphs import DecodeGraphs, decode_graph_reserve_bytes, make_decode_graphs
from engine.kv_cache_pool import KVCachePool
from engine.model import LoadedModel, load_model
from engine.model.arch_config import ModelArchConfig
from engine.spec_decode.draft_model_proposer import DraftModelProposer, check_draft_arch
from engine.spec_decode.ngram_proposer import NgramProposer
from engine.spec_decode.proposer import Proposer
from engine.spec_decode.spec_decoder import SpecDecoder
from engine.step_inputs import StepInputBuilder
from kernels.attention import AttentionBackend
from pdserve.config import CacheConfig, EngineConfig


class SpecDecodeParts:
    def __init__(
        self,
        config: EngineConfig,
        target: LoadedModel,
        attn_backend: AttentionBackend,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
    ) -> None:
        """Phase one: the draft model, if any, loaded and checked (ValueError when unfit)."""
        self.config = config
        self.spec = config.speculative
        self.target = target
        self.device, self.dtype = device, dtype
        self.max_model_len = max_model_len
        self.draft: LoadedModel | None = None
        if self.spec.speculative_method == "draft":
            assert self.spec.speculative_model is not None  # SpeculativeConfig checks it
            draft_config = dataclasses.replace(config.model, model=self.spec.speculative_model)
            self.draft = load_model(draft_config, attn_backend, device, dtype)
            check_draft_arch(self.draft.arch, target.arch, max_model_len)

    @property
    def enabled(self) -> bool:
        return self.spec.speculative_method is not None

    @property
    def query_len(self) -> int:
        """Tokens per request of a full verify step: the last token and K drafts."""
        return self.spec.num_speculative_tokens + 1

    def extra_bytes_per_block(self) -> int:
        """The draft's KV bytes per block (the pool is sized for both)."""
        if self.draft is None:
            return 0
        return KVCachePool.block_bytes(self.draft.arch, self.config.cache.block_size, self.dtype)

    @property
    def verifies(self) -> bool:
        """Whether this engine runs verify steps (a prefill-only engine never decodes: it
        needs no verify or draft graphs, only the draft's observe of its prompts)."""
        return self.enabled and not self.config.scheduler.prefill_only

    def reserve_bytes(self) -> int:
        """CUDA graphs' memory beyond the target's decode graphs: its verify graphs, the
        draft's decode and verify graphs."""
        if not self.verifies:
            return 0
        max_bs = self.config.scheduler.max_num_seqs
        total = decode_graph_reserve_bytes(self.target.arch, max_bs * self.query_len)
        if self.draft is not None:
            arch: ModelArchConfig = self.draft.arch
            total += decode_graph_reserve_bytes(arch, max_bs * (1 + self.query_len))
        return total

    def build(
        self, pool: KVCachePool, use_graphs: bool
    ) -> tuple[SpecDecoder | None, DecodeGraphs | None]:
        """Phase two, once the target's pool is sized: (the SpecDecoder, the target's verify
        graphs); (None, None) when speculation is off."""
        if not self.enabled:
            return None, None
        use_graphs = use_graphs and self.verifies
        verify_graphs = self._graphs(self.target, pool.kv_caches, pool, use_graphs, self.query_len)
        proposer = self._proposer(pool, use_graphs)
        spec = SpecDecoder(proposer, self.spec.num_speculative_tokens, verify_graphs is not None)
        return spec, verify_graphs

    def _proposer(self, pool: KVCachePool, use_graphs: bool) -> Proposer:
        if self.draft is None:
            return NgramProposer(
                self.spec.ngram_prompt_lookup_min, self.spec.ngram_prompt_lookup_max
            )
        cache = CacheConfig(num_blocks=pool.num_blocks, block_size=pool.block_size)
        draft_pool = KVCachePool(self.draft.arch, cache, self.device, self.dtype)
        caches = draft_pool.kv_caches
        return DraftModelProposer(
            self.draft, caches, StepInputBuilder(pool.block_size, pool.scratch_block, self.device),
            self._graphs(self.draft, caches, pool, use_graphs, 1),
            self._graphs(self.draft, caches, pool, use_graphs, self.query_len),
        )  # fmt: skip

    def _graphs(
        self,
        loaded: LoadedModel,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        pool: KVCachePool,
        use_graphs: bool,
        query_len: int,
    ) -> DecodeGraphs | None:
        if not use_graphs:
            return None
        return make_decode_graphs(
            loaded.model, kv_caches, self.config.scheduler.max_num_seqs, self.max_model_len,
            pool.scratch_block, self.device, not self.config.model.enforce_eager, query_len,
        )  # fmt: skip
