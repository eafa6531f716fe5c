"""Why a sender's handshake or layer manifest does not fit the receiver's ticket: pure checks
(`KVReceiver` keeps the state and acts on the answer; None means it fits).

    handshake_refusal(layout, num_tokens, handshake)
    layer_refusal(layout, layer_token_end, num_tokens, first_token_came, manifest, payload_bytes)
    written_layers_refusal(...)   a manifest of layers written in place: each layer's span
"""

from __future__ import annotations

from collections.abc import Sequence

from cache_transfer.layout import KVLayout
from cache_transfer.protocol import PROTOCOL_VERSION
from pdserve.v1 import transfer_pb2


def handshake_refusal(
    layout: KVLayout, num_tokens: int, handshake: transfer_pb2.TransferHandshake
) -> str | None:
    expected = {
        "protocol_version": PROTOCOL_VERSION,
        "layout_hash": layout.layout_hash(),
        "num_layers": layout.num_layers,
        "num_tokens": num_tokens,
        "num_blocks": layout.num_blocks_for(num_tokens),
    }
    for field, want in expected.items():
        got = getattr(handshake, field)
        if got != want:
            return f"{field} is {got!r}, this receiver expects {want!r}"
    if not handshake.src_address:
        return "no src_address to reply to"
    return None


def layer_refusal(
    layout: KVLayout,
    layer_token_end: Sequence[int],  # tokens of each layer accepted so far
    num_tokens: int,
    first_token_came: bool,
    manifest: transfer_pb2.LayerManifest,
    payload_bytes: int,
    layer_idx: int | None = None,  # that layer of the manifest (default: its layer_idx)
) -> str | None:
    """The manifest's next span of one layer: after what was received, within the ticket's
    tokens, the exact block range and byte count, and before the first token."""
    layer_idx = manifest.layer_idx if layer_idx is None else layer_idx
    token_end = manifest.token_end
    if first_token_came:
        return "a layer after the first token"
    if layer_idx >= layout.num_layers:
        return f"layer index {layer_idx} outside [0, {layout.num_layers})"
    prev_end = layer_token_end[layer_idx]
    if not prev_end < token_end <= num_tokens:
        return (
            f"layer {layer_idx}: token_end {token_end} must exceed {prev_end} (already "
            f"received) and not exceed {num_tokens}"
        )
    block_offset = prev_end // layout.block_size
    num_blocks = layout.num_blocks_for(token_end) - block_offset
    if (manifest.block_offset, manifest.num_blocks) != (block_offset, num_blocks):
        return (
            f"layer {layer_idx}: blocks [{manifest.block_offset}, +{manifest.num_blocks}) "
            f"for tokens [{prev_end}, {token_end}), expected [{block_offset}, +{num_blocks})"
        )
    num_bytes = layout.layer_bytes(num_blocks)
    if manifest.num_bytes != num_bytes or payload_bytes != num_bytes:
        return (
            f"layer {layer_idx}: {payload_bytes} payload bytes (manifest says "
            f"{manifest.num_bytes}) for {num_blocks} blocks of {num_bytes} bytes"
        )
    return None


def written_layers_refusal(
    layout: KVLayout,
    layer_token_end: Sequence[int],
    num_tokens: int,
    first_token_came: bool,
    manifest: transfer_pb2.LayerManifest,
) -> str | None:
    """A manifest of layers written in place (its layer and `more_layer_ids`, one span each)."""
    layer_ids = [manifest.layer_idx, *manifest.more_layer_ids]
    if len(set(layer_ids)) != len(layer_ids):
        return f"layers {layer_ids[:8]}... announced twice in one manifest"
    for layer_idx in layer_ids:
        reason = layer_refusal(
            layout, layer_token_end, num_tokens, first_token_came, manifest, manifest.num_bytes,
            layer_idx,
        )  # fmt: skip
        if reason is not None:
            return reason
    return None
