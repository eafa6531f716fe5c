"""The Llama family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM2) over a flat varlen batch.

```
input_ids [T], positions [T]           all tokens of the step, requests concatenated
  embed_tokens -> residual [T, hidden]; x = None (nothing to add yet)
  per layer:  qkv, residual = normed_projection(x, residual, input_layernorm, qkv_proj)
                                       (residual += x; qkv = qkv_proj(norm(residual)))
              q, k, v = qk_norm?(qkv)
              rotary_qk_write_kv: q, k rotated; k, v stored in the paged KV cache (one op)
              x = o_proj(attn(q))                  (the backend attends; it does not write)
              on_layer_done(layer_idx)             (the layer's KV is in the cache)
              gate_up, residual = normed_projection(x, residual, post_attention_layernorm,
                                                    gate_up_proj)
              x = down_proj(silu_and_mul(gate_up))
  hidden, _ = add_rms_norm(x, residual) with the final norm -> hidden [T, hidden]
  compute_logits(hidden[rows]) -> [rows, vocab] float32
```

q/k/v and gate/up are fused Linear layers; `load_weights` stacks Hugging Face's separate tensors
into them. Attention itself is the injected `AttentionBackend`; the residual add + RMSNorm,
rotary on q and k with the KV-cache write, and SwiGLU are `LayerOps` (kernels/fused: one
Triton launch each on CUDA; the torch reference, bit-identical to the unfused code, on CPU and
with the "torch" backend). The projections (Linear layers, LM head) run through
`LayerOps.linear`: F.linear, or the Triton skinny GEMM for small steps (which also takes the
norm before QKV and gate_up, and the SwiGLU before down_proj, into its launch).

Tensor parallelism (`set_tensor_parallel`, engine/distributed): each rank's model is built with
its shard's sizes (its q and kv heads, its MLP columns, its vocab rows); o_proj and down_proj
all-reduce their partial sums, the embedding looks up this rank's vocab rows and all-reduces,
and compute_logits gathers every rank's vocab slice to rank 0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
from torch import nn

from engine.distributed import TPLayers
from engine.model.arch_config import ModelArchConfig
from engine.model.layers import RMSNorm
from engine.model.rope import RotaryEmbedding
from kernels.attention.backend import AttentionBackend
from kernels.attention.metadata import AttentionMetadata
from kernels.fused import REFERENCE_OPS, LayerOps, with_packed_linear
from kernels.gemm import cpu_packed

KVCache = tuple[torch.Tensor, torch.Tensor]  # k, v: [num_blocks, block_size, num_kv_heads, D]

# Fused module name -> the Hugging Face modules stacked into it, in row order.
_FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
# Checkpoint tensors that carry no weights (old checkpoints saved RoPE buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _project(ops: LayerOps, linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`linear(x)` through the layer ops (F.linear, or the skinny GEMM for small steps)."""
    return ops.linear(x, linear.weight, linear.bias)


def _normed_project(
    ops: LayerOps,
    x: torch.Tensor | None,
    residual: torch.Tensor,
    norm: RMSNorm,
    linear: nn.Linear,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(norm(x + residual)), x + residual): a pre-norm block's input (one launch where
    the skinny GEMM takes the norm)."""
    return ops.normed_projection(x, residual, norm.weight, norm.eps, linear.weight, linear.bias)


class LlamaAttention(nn.Module):
    tp: TPLayers | None = None  # tensor parallelism (set_tensor_parallel)
    kv_scales: torch.Tensor | None = None  # [2, KVH] an FP8 cache's scales (KVCachePool sets)

    def __init__(self, arch: ModelArchConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.scale = arch.head_dim**-0.5
        self.qkv_proj = nn.Linear(
            arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.attention_bias
        )
        # As in transformers: attention_bias also biases o_proj, except in Qwen2 (QKV only).
        o_bias = arch.attention_bias and arch.architecture != "Qwen2ForCausalLM"
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.attn_backend = attn_backend
        self.ops = REFERENCE_OPS

    def forward(
        self,
        qkv: torch.Tensor,  # [num_tokens, q_size + 2 * kv_size]: qkv_proj of the normed input
        cos: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
        sin: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        if self.q_norm is not None and self.k_norm is not None:
            q = self.ops.rms_norm(q, self.q_norm.weight, self.q_norm.eps)
            k = self.ops.rms_norm(k, self.k_norm.weight, self.k_norm.eps)
        k_cache, v_cache = kv_cache
        # Rotary on q and k and the KV-cache write in one op; the backend only attends.
        scales, slots = self.kv_scales, meta.slot_mapping
        q, k = self.ops.rotary_qk_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots, scales)
        out = self.attn_backend.forward(
            q, k, v, k_cache, v_cache, meta, self.scale, kv_written=True, kv_scales=scales
        )  # [T, H, D]
        out = _project(self.ops, self.o_proj, out.reshape(-1, self.q_size))
        return out if self.tp is None else self.tp.reduce(out)  # row-parallel: all-reduce


class LlamaMLP(nn.Module):
    tp: TPLayers | None = None  # tensor parallelism (set_tensor_parallel)

    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)
        self.ops = REFERENCE_OPS

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2 * inter] -> [T, hidden]
        down = self.down_proj  # silu_and_mul, then down_proj (fused in one launch where it can)
        out = self.ops.down_projection(gate_up, down.weight, down.bias)
        return out if self.tp is None else self.tp.reduce(out)  # row-parallel: all-reduce


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArchConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = LlamaAttention(arch, attn_backend)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = LlamaMLP(arch)
        self.ops = REFERENCE_OPS

    def forward(
        self,
        hidden: torch.Tensor | None,  # [num_tokens, hidden]: the last block's output, not yet
        # added to the residual (None before the first layer)
        residual: torch.Tensor,  # [num_tokens, hidden]: the residual stream before the add
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        on_kv_written: Callable[[], None] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (MLP output, residual before the MLP's add)
        attn, mlp = self.self_attn, self.mlp
        qkv, residual = _normed_project(
            self.ops, hidden, residual, self.input_layernorm, attn.qkv_proj
        )
        hidden = attn(qkv, cos, sin, kv_cache, meta)
        if on_kv_written is not None:
            on_kv_written()
        norm = self.post_attention_layernorm
        gate_up, residual = _normed_project(self.ops, hidden, residual, norm, mlp.gate_up_proj)
        return mlp(gate_up), residual


class LlamaModel(nn.Module):
    tp: TPLayers | None = None  # tensor parallelism (set_tensor_parallel)

    def __init__(self, arch: ModelArchConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(arch, attn_backend) for _ in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(arch.head_dim, arch.rope, arch.max_position_embeddings)
        self.ops = REFERENCE_OPS

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        on_layer_done: Callable[[int], None] | None,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        if len(kv_caches) != len(self.layers):
            raise ValueError(
                f"got {len(kv_caches)} KV caches for a model with {len(self.layers)} layers"
            )
        if self.tp is None:
            residual = self.embed_tokens(input_ids)  # [T, hidden]
        else:  # vocab-parallel: this rank's rows, then all-reduce
            residual = self.tp.embed(self.embed_tokens.weight, input_ids)
        cos, sin = self.rotary_emb(positions, residual.dtype)  # [T, 1, head_dim // 2] each
        # Each block's output is added to the residual by the norm after it, fused with the
        # projection that follows (the next layer's QKV; the final norm's add stands alone).
        hidden: torch.Tensor | None = None
        for layer_idx, layer in enumerate(self.layers):
            on_kv_written = None if on_layer_done is None else partial(on_layer_done, layer_idx)
            hidden, residual = layer(
                hidden, residual, cos, sin, kv_caches[layer_idx], meta, on_kv_written
            )
        assert hidden is not None  # a model has layers (its config is checked on load)
        return self.ops.add_rms_norm(hidden, residual, self.norm.weight, self.norm.eps)[0]


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM: one `forward` per engine step, `compute_logits` on chosen rows.

    Parameters are created on the current default device and dtype (the loader sets both).
    """

    tp: TPLayers | None = None  # tensor parallelism (set_tensor_parallel)

    def __init__(self, arch: ModelArchConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.arch = arch
        self.model = LlamaModel(arch, attn_backend)
        # Tied checkpoints reuse the embedding as the output projection.
        self.lm_head = (
            None
            if arch.tie_word_embeddings
            else nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        )
        q_size = arch.num_heads * arch.head_dim
        kv_size = arch.num_kv_heads * arch.head_dim
        # Rows of each Hugging Face tensor inside a fused parameter, in _FUSED_MODULES order.
        self._fused_rows: dict[str, tuple[int, ...]] = {
            "qkv_proj": (q_size, kv_size, kv_size),
            "gate_up_proj": (arch.intermediate_size, arch.intermediate_size),
        }
        # The LM head's weight in a kernel's own layout (a packed copy of a tied embedding);
        # None: the embedding or lm_head weight as it is.
        self._packed_logits_weight: torch.Tensor | None = None

    def set_layer_ops(self, ops: LayerOps) -> None:
        """Use `ops` (kernels/fused: the Triton kernels or the torch reference) everywhere."""
        for module in self.modules():
            if isinstance(module, _USES_OPS):
                module.ops = ops

    def set_tensor_parallel(self, layers: TPLayers) -> None:
        """This model is one rank's shard (built with the rank's head, MLP and vocab sizes):
        its row-parallel projections, embedding and LM head call `layers`' collectives."""
        for module in self.modules():
            if isinstance(module, _USES_TP):
                module.tp = layers

    @property
    def layer_ops(self) -> LayerOps:
        return self.model.ops

    def pack_projections(self) -> None:
        """bf16 on CPU: every projection's weight (and a tied LM head's copy of the embedding)
        packed once for oneDNN, the layer ops' linear taking them (kernels/gemm/cpu_packed.py).
        Call after the weights are loaded."""
        cpu_packed.pack_projections(self)
        if self.lm_head is None:
            self._packed_logits_weight = cpu_packed.pack(self.model.embed_tokens.weight)
        self.set_layer_ops(with_packed_linear(self.layer_ops))

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[KVCache],  # one (k_cache, v_cache) per layer
        meta: AttentionMetadata,
        on_layer_done: Callable[[int], None] | None = None,
    ) -> torch.Tensor:  # [num_tokens, hidden], after the final norm
        """One pass over the step's flat batch; `on_layer_done(i)` runs once layer i's KV is
        in the cache (before that layer's MLP)."""
        return self.model(input_ids, positions, kv_caches, meta, on_layer_done)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden] -> [num_rows, vocab] float32."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self._packed_logits_weight is not None:
            weight = self._packed_logits_weight
        logits = self.model.ops.linear(hidden, weight, None)
        if self.tp is not None:  # vocab-parallel: every rank's slice, gathered to rank 0
            logits = self.tp.gather_logits(logits)
        return logits.float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in (any dtype/device), stacking fused ones.

        Raises ValueError naming unexpected, mis-shaped or missing tensors.
        """
        slots = self._checkpoint_slots()
        loaded: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES) or (
                self.lm_head is None and name == "lm_head.weight"
            ):
                continue
            if name not in slots:
                unexpected.append(name)
                continue
            param, first_row, num_rows = slots[name]
            target = param.narrow(0, first_row, num_rows)
            if tensor.shape != target.shape:
                raise ValueError(
                    f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, but this "
                    f"{self.arch.architecture} config expects {tuple(target.shape)}: "
                    "do config.json and the weights belong to the same model?"
                )
            target.copy_(tensor)
            loaded.add(name)
        if unexpected:
            raise ValueError(
                f"{len(unexpected)} checkpoint tensors are not part of {self.arch.architecture} "
                f"as configured, e.g. {sorted(unexpected)[:5]}"
            )
        missing = sorted(slots.keys() - loaded)
        if missing:
            raise ValueError(
                f"the checkpoint lacks {len(missing)} tensors of {self.arch.architecture}, "
                f"e.g. {missing[:5]}"
            )

    def _checkpoint_slots(self) -> dict[str, tuple[nn.Parameter, int, int]]:
        """Hugging Face tensor name -> (our parameter, first row, number of rows) it fills."""
        slots: dict[str, tuple[nn.Parameter, int, int]] = {}
        for name, param in self.named_parameters():
            module_path, _, param_kind = name.rpartition(".")  # "...self_attn.qkv_proj", "weight"
            parent, _, leaf = module_path.rpartition(".")
            if leaf not in _FUSED_MODULES:
                slots[name] = (param, 0, param.shape[0])
                continue
            first_row = 0
            for hf_leaf, num_rows in zip(_FUSED_MODULES[leaf], self._fused_rows[leaf]):
                slots[f"{parent}.{hf_leaf}.{param_kind}"] = (param, first_row, num_rows)
                first_row += num_rows
        return slots


_USES_OPS: tuple[type[Any], ...] = (LlamaAttention, LlamaMLP, LlamaDecoderLayer, LlamaModel)
_USES_TP: tuple[type[Any], ...] = (LlamaAttention, LlamaMLP, LlamaModel, LlamaForCausalLM)
