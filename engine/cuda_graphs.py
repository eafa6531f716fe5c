"""`DecodeGraphs`: the model's decode forward captured as CUDA graphs, one per batch size.

```
batch sizes      1, 2, 4, 8, then every 8 up to max_num_seqs (a decode batch pads to the next)
query_len        Q tokens per request: 1 (decode), or K + 1 (a speculative verify step: the
                 last token and K drafts, causal among themselves; `decode_query_len`)
static inputs    input_ids, positions, slot_mapping [max_bs * Q] int64; seq_lens [max_bs]
                 int32; query_start_loc [max_bs + 1] int32 (0, Q, 2Q, ..); block_tables
                 [max_bs, max_blocks_per_seq] int32; each graph uses the first bs rows
run(batch)       copy the step's device inputs into the static ones (block tables: the
                 columns it uses), then replay (or, without graphs, run the same forward
                 eagerly on the same buffers: the shapes and kernels are the graph's)
```

The attention metadata of a graph is `static_shapes=True`: backends read lengths only from the
device tensors. All graphs share one memory pool; capture runs largest first.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.model.arch_config import ModelArchConfig
from engine.step_inputs import FlatBatch
from kernels.attention import AttentionMetadata

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to max_num_seqs (which is included)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))[1:]
    return sorted(set(sizes) | {max_num_seqs})


def decode_graph_reserve_bytes(arch: ModelArchConfig, num_tokens: int) -> int:
    """Memory set aside for the graphs' pool before the KV cache is sized: a forward's live
    activations at `num_tokens` (the largest batch x its query length), with room for the
    attention kernels' scratch."""
    qkv = (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
    per_token = 4 * (6 * arch.hidden_size + 3 * arch.intermediate_size + 2 * qkv)  # fp32-wide
    return num_tokens * per_token * 4 + (64 << 20)


def make_decode_graphs(
    model: torch.nn.Module,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    max_num_seqs: int,
    max_model_len: int,
    scratch_block: int,
    device: torch.device,
    capture: bool,
    query_len: int = 1,
) -> DecodeGraphs:
    """`model`'s decode forward over `kv_caches` for batches up to max_num_seqs of `query_len`
    tokens each, captured unless `capture` is False (enforce_eager: same buffers, eager)."""
    block_size = kv_caches[0][0].shape[1]
    graphs = DecodeGraphs(
        model, kv_caches, max_num_seqs, -(-max_model_len // block_size), block_size,
        scratch_block, device, query_len,
    )  # fmt: skip
    if capture:
        graphs.capture()
    return graphs


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        scratch_block: int,
        device: torch.device,
        query_len: int = 1,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.block_size = block_size
        self.query_len = q = query_len
        max_bs = self.sizes[-1]
        self.input_ids = torch.zeros(max_bs * q, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_bs * q, dtype=torch.int64, device=device)
        scratch_slot = scratch_block * block_size
        self.slot_mapping = torch.full(
            (max_bs * q,), scratch_slot, dtype=torch.int64, device=device
        )
        self.seq_lens = torch.full((max_bs,), q, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(
            0, (max_bs + 1) * q, q, dtype=torch.int32, device=device
        )
        self.block_tables = torch.full(
            (max_bs, max_blocks_per_seq), scratch_block, dtype=torch.int32, device=device
        )
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_s = 0.0
        self.pool_bytes = 0

    def padded_size(self, num_rows: int) -> int | None:
        """The batch size a decode batch of `num_rows` runs at, or None if too large."""
        for size in self.sizes:
            if size >= num_rows:
                return size
        return None

    def meta(self, bs: int) -> AttentionMetadata:
        capacity = self.block_tables.shape[1] * self.block_size
        q = self.query_len
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            slot_mapping=self.slot_mapping[: bs * q],
            block_tables=self.block_tables[:bs],
            max_query_len=q,
            max_seq_len=capacity,
            num_decodes=bs,
            query_lens_cpu=(q,) * bs,
            seq_lens_cpu=(capacity,) * bs,
            static_shapes=True,
            decode_query_len=q,
        )

    def _forward(self, bs: int) -> torch.Tensor:
        n = bs * self.query_len
        return self.model(self.input_ids[:n], self.positions[:n], self.kv_caches, self.meta(bs))

    def capture(self) -> None:
        """Capture every size, largest first, into one shared pool; logs time and memory."""
        start = time.perf_counter()
        before = torch.cuda.memory_reserved()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bs in reversed(self.sizes):
                self._forward(bs)  # warm-up: kernel compiles and library handles
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    out = self._forward(bs)
                self._graphs[bs] = (graph, out)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - start
        self.pool_bytes = torch.cuda.memory_reserved() - before
        logger.info(
            "captured %d %s CUDA graphs (batch %d..%d) in %.1f s, %.1f MiB",
            len(self._graphs), "decode" if self.query_len == 1 else f"{self.query_len}-token verify",
            self.sizes[0], self.sizes[-1], self.capture_s, self.pool_bytes / (1 << 20),
        )  # fmt: skip

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def run(self, batch: FlatBatch) -> torch.Tensor:
        """The hidden states [bs * Q, hidden] of a padded decode-only batch of Q tokens per
        row (bs = a graph size)."""
        bs = batch.num_rows
        meta = batch.meta
        if meta.decode_query_len != self.query_len:
            raise ValueError(
                f"a batch of {meta.decode_query_len}-token decodes replayed on graphs captured "
                f"for {self.query_len}"
            )
        width = meta.block_tables.shape[1]
        n = bs * self.query_len
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:bs].copy_(meta.seq_lens)
        self.block_tables[:bs, :width].copy_(meta.block_tables)
        entry = self._graphs.get(bs)
        if entry is None:  # graphs off (enforce_eager): the same forward, eagerly
            return self._forward(bs)
        graph, out = entry
        graph.replay()
        return out
