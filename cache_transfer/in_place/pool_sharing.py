"""Writes in place: a receiver's KV caches exported, and mapped by a sender on the same GPU.

```
receiver  export(kv_caches) -> KVPoolExport | None    the caches' one allocation (CUDA IPC),
                                                      each layer's K and V offsets in it
sender    open(export, device) -> [(k, v), ...]       the receiver's caches, mapped once per
                                                      allocation (cached), as tensors here
```

`CudaIpcSharing` uses torch's CUDA storage sharing (`_share_cuda_` / `_new_shared_cuda`, what
`torch.multiprocessing` sends through its queues): both processes on one host and, for the
handle to open, on the same GPU. `InProcessSharing` maps caches of the same process (tests of
the protocol without a GPU: a local-transport receiver and sender in one process).
"""

from __future__ import annotations

import itertools
from typing import Protocol

import torch

from cache_transfer.layout import KVCaches
from pdserve.v1 import transfer_pb2


class PoolSharing(Protocol):
    def export(self, kv_caches: KVCaches) -> transfer_pb2.KVPoolExport | None: ...

    def open(
        self, export: transfer_pb2.KVPoolExport, device: torch.device
    ) -> list[tuple[torch.Tensor, torch.Tensor]]: ...


def describe_caches(kv_caches: KVCaches) -> transfer_pb2.KVPoolExport:
    """The caches' geometry (shape, stride, per-layer offsets, dtype) with no handle yet;
    ValueError unless every cache is a view of one storage with one shape, stride and dtype."""
    first = kv_caches[0][0]
    storage = first.untyped_storage()
    export = transfer_pb2.KVPoolExport(
        dtype=str(first.dtype).removeprefix("torch."),
        shape=list(first.shape),
        stride=list(first.stride()),
    )
    for k_cache, v_cache in kv_caches:
        for cache in (k_cache, v_cache):
            if (
                cache.untyped_storage().data_ptr() != storage.data_ptr()
                or cache.shape != first.shape
                or cache.stride() != first.stride()
                or cache.dtype != first.dtype
            ):
                raise ValueError("the KV caches to export are not views of one storage alike")
        export.k_offsets.append(int(k_cache.storage_offset()))
        export.v_offsets.append(int(v_cache.storage_offset()))
    return export


def views_of(
    export: transfer_pb2.KVPoolExport, storage: torch.UntypedStorage, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k, v) views of `storage` as `export` describes them, bounds-checked."""
    dtype = getattr(torch, export.dtype, None)
    if not isinstance(dtype, torch.dtype) or len(export.k_offsets) != len(export.v_offsets):
        raise ValueError(f"a KV pool export of dtype {export.dtype!r} with unpaired offsets")
    flat = torch.empty(0, dtype=dtype, device=device).set_(
        storage, 0, (storage.nbytes() // dtype.itemsize,), (1,)
    )
    shape, stride = tuple(export.shape), tuple(export.stride)
    span = 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))
    caches = []
    for k_offset, v_offset in zip(export.k_offsets, export.v_offsets, strict=True):
        if max(k_offset, v_offset) + span > flat.numel():
            raise ValueError("a KV pool export's layer lies outside its storage")
        caches.append(
            (flat.as_strided(shape, stride, k_offset), flat.as_strided(shape, stride, v_offset))
        )
    return caches


class CudaIpcSharing:
    """CUDA IPC through torch's storage sharing; `open` maps each allocation once."""

    def __init__(self) -> None:
        self._mapped: dict[bytes, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def export(self, kv_caches: KVCaches) -> transfer_pb2.KVPoolExport | None:
        if not kv_caches or kv_caches[0][0].device.type != "cuda":
            return None
        export = describe_caches(kv_caches)
        storage = kv_caches[0][0].untyped_storage()
        (_, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = (
            storage._share_cuda_()  # type: ignore[no-untyped-call]  # torch's own, unannotated
        )
        export.ipc_handle = handle
        export.storage_size_bytes = size
        export.storage_offset_bytes = offset
        export.ref_counter_handle = ref_handle
        export.ref_counter_offset = ref_offset
        export.event_handle = event_handle or b""
        export.event_sync_required = bool(event_sync)
        return export

    def open(
        self, export: transfer_pb2.KVPoolExport, device: torch.device
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        key = bytes(export.ipc_handle) + export.storage_offset_bytes.to_bytes(8, "little")
        if key not in self._mapped:
            storage = torch.UntypedStorage._new_shared_cuda(
                device.index if device.index is not None else torch.cuda.current_device(),
                export.ipc_handle,
                export.storage_size_bytes,
                export.storage_offset_bytes,
                export.ref_counter_handle,
                export.ref_counter_offset,
                export.event_handle or None,
                export.event_sync_required,
            )
            self._mapped[key] = views_of(export, storage, device)
        return self._mapped[key]


class InProcessSharing:
    """Caches of this very process, by a handle it numbers (tests: no GPU, no second process)."""

    def __init__(self) -> None:
        self._storages: dict[bytes, torch.UntypedStorage] = {}
        self._ids = itertools.count()

    def export(self, kv_caches: KVCaches) -> transfer_pb2.KVPoolExport | None:
        export = describe_caches(kv_caches)
        export.ipc_handle = f"in-process-{next(self._ids)}".encode()
        self._storages[export.ipc_handle] = kv_caches[0][0].untyped_storage()
        return export

    def open(
        self, export: transfer_pb2.KVPoolExport, device: torch.device
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        storage = self._storages.get(bytes(export.ipc_handle))
        if storage is None:
            raise ValueError("no such in-process KV pool")
        return views_of(export, storage, device)
