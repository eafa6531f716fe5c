"""The devices of a tensor-parallel group's ranks, and the CPU threads each rank takes."""

from __future__ import annotations

import os

import torch


def tp_devices(devices: str | None, device: str, world_size: int) -> list[torch.device]:
    """Rank r's device: the r-th of `devices` ("cuda:0,cuda:1"), else the first `world_size`
    of `device`'s kind ("auto": CUDA when there is one). CPU ranks share the CPU."""
    if devices:
        names = [name.strip() for name in devices.split(",")]
    else:
        if device.startswith("cuda:") and world_size > 1:
            raise ValueError(
                f"--device {device} names one device; name each of the {world_size} ranks' "
                f"with --devices (e.g. cuda:0,cuda:1)"
            )
        kind = device if device in ("cpu", "cuda") else None
        if device == "auto":
            kind = "cuda" if torch.cuda.is_available() else "cpu"
        if kind is None:
            raise ValueError(f"device {device!r} is not supported; use auto, cpu or cuda")
        names = [f"cuda:{r}" if kind == "cuda" else "cpu" for r in range(world_size)]
    if len(names) != world_size:
        raise ValueError(
            f"--devices {devices} names {len(names)} devices for {world_size} ranks "
            "(tensor_parallel_size)"
        )
    resolved = [torch.device(name) for name in names]
    kinds = {d.type for d in resolved}
    if len(kinds) != 1 or not kinds <= {"cpu", "cuda"}:
        raise ValueError(f"--devices {devices}: every rank on cpu, or every rank on cuda")
    if "cuda" in kinds:
        _check_cuda(resolved, devices)
    return resolved


def _check_cuda(resolved: list[torch.device], devices: str | None) -> None:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    indices = [0 if d.index is None else d.index for d in resolved]
    if len(set(indices)) != len(indices):
        raise ValueError(f"--devices {devices}: each rank needs its own GPU")
    if max(indices) >= count:
        raise ValueError(f"{len(resolved)} ranks need GPUs {indices}, but this machine has {count}")


def cpu_threads_per_rank(device: torch.device, world_size: int) -> int | None:
    """On CPU, each rank's torch threads: the cores this process may use, split evenly (the
    ranks compute at the same time). None on CUDA (torch's default)."""
    if device.type != "cpu":
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // world_size)
