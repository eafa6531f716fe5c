"""Moving a request's KV cache from a prefill node to a decode node (see README.md)."""

from cache_transfer.in_place.pool_sharing import CudaIpcSharing, InProcessSharing, PoolSharing
from cache_transfer.kv_transfer_manager import KVTransferManager
from cache_transfer.layout import KVLayout, dtype_mismatch
from cache_transfer.packing.block_copy import LayerBlocks, copy_layer, copy_layers
from cache_transfer.packing.packed_layer import pack_layer, unpack_layer
from cache_transfer.receiver import KVReceiver
from cache_transfer.sender import KVSender
from cache_transfer.state import TransferState
from cache_transfer.transports import (
    KVTransport,
    TransportBindError,
    TransportError,
    make_transport,
)

__all__ = [
    "CudaIpcSharing",
    "InProcessSharing",
    "KVLayout",
    "KVReceiver",
    "KVSender",
    "KVTransferManager",
    "KVTransport",
    "LayerBlocks",
    "PoolSharing",
    "TransferState",
    "TransportBindError",
    "TransportError",
    "copy_layer",
    "copy_layers",
    "dtype_mismatch",
    "make_transport",
    "pack_layer",
    "unpack_layer",
]
