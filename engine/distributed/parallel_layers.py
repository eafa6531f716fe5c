"""`TPLayers`: the collectives a sharded Llama model calls (engine/model/llama.py).

```
column-parallel  qkv_proj (each rank: its q heads, its kv heads), gate_up_proj: no collective
row-parallel     o_proj, down_proj: a partial sum on every rank -> reduce (one all-reduce each;
                 a bias is added on rank 0 only, the others hold zeros)
vocab-parallel   embed: each rank looks up the ids in its vocab slice (others: zero rows),
                 then one all-reduce; logits: each rank's slice, gathered to rank 0 only
```
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.distributed.process_group import TPComm
from engine.distributed.tp_shard import ModelPartition


class TPLayers:
    def __init__(self, comm: TPComm, partition: ModelPartition) -> None:
        self.comm = comm
        self.partition = partition

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's partial sums -> the full output (in place)."""
        return self.comm.all_reduce(x)

    def embed(self, weight: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """[vocab_per_rank, hidden] slice, [T] ids -> [T, hidden]: the full embedding."""
        local = input_ids - self.partition.vocab_start
        outside = (local < 0) | (local >= self.partition.vocab_per_rank)  # [T]
        rows = F.embedding(local.masked_fill(outside, 0), weight)  # [T, hidden]
        rows.masked_fill_(outside.unsqueeze(-1), 0)
        return self.comm.all_reduce(rows)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[rows, vocab_per_rank] -> rank 0: [rows, vocab_size]; other ranks: their slice
        (nobody reads it: only rank 0 samples)."""
        gathered = self.comm.gather_to_first(logits)
        if self.partition.rank != 0:
            return logits
        vocab = self.partition.vocab_size
        return gathered if gathered.shape[-1] == vocab else gathered[:, :vocab].contiguous()
