"""Copies between the host and the device that do not stall a step: `on_device` (a host
list in, through pinned memory, non-blocking) and `HostCopy` / `to_host_list` (a device tensor
out, waited for with the GIL released)."""

from __future__ import annotations

import torch


def on_device(values: list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host list as a device tensor without a sync: on CUDA built in pinned memory and copied
    non-blocking (the same values and dtype `torch.tensor(values, device=device)` gives)."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """A non-blocking copy of a device tensor into pinned host memory, queued now on the
    current stream; `tolist()` waits for it with the GIL released. (`tensor.tolist()` would
    hold the GIL for the step's whole GPU time, starving the node's event loop: KV sends, token
    streaming, heartbeats.) On CPU the values are taken at once."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._done: torch.cuda.Event | None = None
        if not tensor.is_cuda:
            self._host = tensor
            return
        self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._host.copy_(tensor, non_blocking=True)
        self._done = torch.cuda.Event()
        self._done.record(torch.cuda.current_stream(tensor.device))

    def tolist(self) -> list:
        if self._done is not None:
            self._done.synchronize()  # releases the GIL while it waits
        return self._host.tolist()


def to_host_list(tensor: torch.Tensor) -> list:
    """`tensor.tolist()`, waiting for a CUDA tensor with the GIL released (see `HostCopy`)."""
    return HostCopy(tensor).tolist()
