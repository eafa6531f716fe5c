"""`LayerSpans`: what a `KVSender` has handed over of each layer, and what goes next.

A layer goes in token order, once per prefill chunk: its next span covers its tokens after
those sent, up to `token_end`, as whole blocks `[sent // block_size, ceil(token_end /
block_size))` (a block a chunk left partial goes again, whole); the layer is complete at
`num_tokens`. A receiver that holds the prompt's first blocks already (`KVSuffix`) gets the
rest: every layer starts at `cached_tokens`, and spans index the ticket's blocks from there. Each call turns a caller's layers into one manifest per layer and what fills its
payload, or raises ValueError (a caller's bug) and records nothing.

    from_caches(layers, src_block_ids, token_end)   (layer, k, v): its blocks (LayerBlocks)
    from_packed(layers, token_end, buffer_device)   (layer, payload): packed already
    written(layer_ids, token_end)                   written in place by the caller: no source
    is_complete(), check_complete(what)             every layer sent up to num_tokens?
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from cache_transfer.layout import KVLayout
from cache_transfer.packing.block_copy import LayerBlocks
from cache_transfer.packing.block_ids import CheckedIds, check_block_ids
from cache_transfer.packing.checked_caches import derived
from cache_transfer.packing.packed_layer import LayerSource, check_kv_cache
from cache_transfer.suffix import KVSuffix
from cache_transfer.transports.base import check_payload
from pdserve.v1 import transfer_pb2

CacheLayers = Sequence[tuple[int, torch.Tensor, torch.Tensor]]  # (layer_idx, k_cache, v_cache)
Manifests = list[transfer_pb2.LayerManifest]


class LayerSpans:
    def __init__(self, layout: KVLayout, suffix: KVSuffix) -> None:
        self.layout = layout
        self.suffix = suffix
        self.num_tokens = suffix.num_tokens
        # tokens of each layer handed over (or held by the receiver already)
        self._token_end = [suffix.cached_tokens] * layout.num_layers

    def from_caches(
        self, layers: CacheLayers, src_block_ids: Sequence[int], token_end: int
    ) -> tuple[Manifests, list[LayerBlocks]]:
        """Layers of caches on one device: the blocks of each span, checked once per span and
        pool (not per layer), the caches once per set (`derived`: the same ones every request,
        so checked once, not 32 times a request)."""
        _check_distinct("send_layers", [layer_idx for layer_idx, _, _ in layers])
        caches = [cache for _, k_cache, v_cache in layers for cache in (k_cache, v_cache)]
        if derived(caches, lambda: self._check_caches(layers)) != self.layout:
            self._check_caches(layers)  # checked against another layout before
        manifests, sources = [], []
        span_ids: dict[tuple[int, int, int, torch.device], CheckedIds] = {}
        base = self.suffix.num_cached_blocks  # src_block_ids is the whole prompt's table
        for layer_idx, k_cache, v_cache in layers:
            span = self._span(layer_idx, token_end)
            if len(src_block_ids) < base + span[1]:
                raise ValueError(
                    f"{token_end} tokens span {base + span[1]} blocks; src_block_ids has "
                    f"{len(src_block_ids)}"
                )
            key = (*span, k_cache.shape[0], k_cache.device)
            if key not in span_ids:
                ids = src_block_ids[base + span[0] : base + span[1]]
                span_ids[key] = check_block_ids(ids, k_cache.shape[0], k_cache.device)
            manifests.append(self.manifest(layer_idx, *span, token_end))
            sources.append(LayerBlocks(k_cache, v_cache, span_ids[key]))
        self._advance([layer_idx for layer_idx, _, _ in layers], token_end)
        return manifests, sources

    def from_packed(
        self,
        layers: Sequence[tuple[int, torch.Tensor]],
        token_end: int,
        buffer_device: Callable[[torch.device], torch.device],
    ) -> tuple[Manifests, list[LayerSource]]:
        """Packed layers (flat uint8, exactly the span's bytes): each payload itself where it
        lives on `buffer_device(its device)` (where the transport sends from), else what
        copies it into staging."""
        _check_distinct("send_packed_layers", [layer_idx for layer_idx, _ in layers])
        manifests = []
        for layer_idx, payload in layers:
            block_offset, block_end = self._span(layer_idx, token_end)
            num_bytes = self.layout.layer_bytes(block_end - block_offset)
            if check_payload(payload) != num_bytes:
                raise ValueError(
                    f"layer {layer_idx}: a packed payload of {payload.numel()} bytes; blocks "
                    f"[{block_offset}, {block_end}) of tokens up to {token_end} take {num_bytes}"
                )
            manifests.append(self.manifest(layer_idx, block_offset, block_end, token_end))
        sources: list[LayerSource] = []
        for _, payload in layers:
            if buffer_device(payload.device) == payload.device:
                sources.append(payload)
            else:
                sources.append(_copy_of(payload))
        self._advance([layer_idx for layer_idx, _ in layers], token_end)
        return manifests, sources

    def written(self, layer_ids: Sequence[int], token_end: int) -> Manifests:
        """Layers the caller wrote in place itself."""
        if len(set(layer_ids)) != len(layer_ids) or not layer_ids:
            raise ValueError(f"send_written_layers needs distinct layers, got {layer_ids}")
        manifests = [self.manifest(i, *self._span(i, token_end), token_end) for i in layer_ids]
        self._advance(layer_ids, token_end)
        return manifests

    def is_complete(self) -> bool:
        """Every layer's KV of all `num_tokens` tokens was handed over."""
        return all(end == self.num_tokens for end in self._token_end)

    def check_complete(self, what: str) -> None:
        """ValueError unless every layer's KV of all `num_tokens` tokens was handed over."""
        missing = [i for i, end in enumerate(self._token_end) if end != self.num_tokens]
        if missing:
            raise ValueError(
                f"{what}: send every layer's KV of all {self.num_tokens} tokens before the "
                f"first token; layers {missing[:8]} are incomplete"
            )

    def manifest(
        self, layer_idx: int, block_offset: int, block_end: int, token_end: int
    ) -> transfer_pb2.LayerManifest:
        num_blocks = block_end - block_offset
        return transfer_pb2.LayerManifest(
            layer_idx=layer_idx,
            block_offset=block_offset,
            num_blocks=num_blocks,
            num_bytes=self.layout.layer_bytes(num_blocks),
            token_end=token_end,
        )

    def _span(self, layer_idx: int, token_end: int) -> tuple[int, int]:
        """The (first, end) indices into the ticket's blocks of a layer's tokens [previous
        end, token_end)."""
        if not 0 <= layer_idx < self.layout.num_layers:
            raise ValueError(f"layer_idx {layer_idx} outside [0, {self.layout.num_layers})")
        prev_end = self._token_end[layer_idx]
        if not prev_end < token_end <= self.num_tokens:
            raise ValueError(
                f"layer {layer_idx}: token_end must be in ({prev_end}, {self.num_tokens}] "
                f"(tokens already sent, prompt length), got {token_end}"
            )
        return self.suffix.span(prev_end, token_end)

    def _advance(self, layer_ids: Sequence[int], token_end: int) -> None:
        for layer_idx in layer_ids:
            self._token_end[layer_idx] = token_end

    def _check_caches(self, layers: CacheLayers) -> KVLayout:
        """ValueError unless every layer's caches fit our layout."""
        for _, k_cache, v_cache in layers:
            check_kv_cache(self.layout, k_cache, v_cache)
        return self.layout


def _check_distinct(what: str, layer_ids: list[int]) -> None:
    if len(set(layer_ids)) != len(layer_ids) or not layer_ids:
        raise ValueError(f"{what} needs distinct layers, got {len(layer_ids)}")


def _copy_of(payload: torch.Tensor) -> Callable[[torch.Tensor], object]:
    """What fills a staging buffer with `payload`."""
    return lambda out: out.copy_(payload)
