"""Backend selection: auto order, and errors that say why and what to use instead."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kernels.attention import TorchAttentionBackend, get_attention_backend, selector
from kernels.attention.selector import resolve_backend_name

CPU = torch.device("cpu")
CUDA = torch.device("cuda")


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch):
    """Pretend exactly the given optional packages are installed."""

    def pretend(*packages: str) -> None:
        monkeypatch.setattr(selector, "is_installed", lambda package: package in packages)

    return pretend


@pytest.mark.parametrize("name", ["auto", "torch"])
def test_cpu_gets_torch(name: str) -> None:
    backend = get_attention_backend(name, CPU, torch.float32, 16)
    assert isinstance(backend, TorchAttentionBackend)


@pytest.mark.parametrize(
    ("packages", "dtype", "block_size", "expected"),
    [
        (("triton", "flash_attn"), torch.bfloat16, 256, "flash_attn"),
        (("triton", "flash_attn"), torch.bfloat16, 16, "triton"),
        (("triton", "flash_attn"), torch.float32, 256, "triton"),
        (("triton",), torch.float16, 512, "triton"),
        ((), torch.bfloat16, 256, "torch"),
    ],
)
def test_auto_order_on_cuda(installed, packages, dtype, block_size, expected) -> None:
    installed(*packages)
    assert resolve_backend_name("auto", CUDA, dtype, block_size) == expected


@pytest.mark.parametrize(
    ("name", "device", "dtype", "block_size", "why"),
    [
        ("triton", CPU, torch.float32, 16, "needs a CUDA device"),
        ("flash_attn", CPU, torch.bfloat16, 256, "needs a CUDA device"),
        ("flash_attn", CUDA, torch.bfloat16, 16, "block_size % 256 == 0"),
        ("flash_attn", CUDA, torch.float32, 256, "float16 or bfloat16"),
        ("triton", CUDA, torch.float64, 16, "float16, bfloat16 and float32"),
    ],
)
def test_unavailable_backend_says_why(installed, name, device, dtype, block_size, why) -> None:
    installed("triton", "flash_attn")
    with pytest.raises(ValueError, match=why) as info:
        resolve_backend_name(name, device, dtype, block_size)
    assert "instead" in str(info.value)


def test_missing_package_says_not_installed(installed) -> None:
    installed()
    with pytest.raises(ValueError, match="'triton' package is not installed.*use 'torch'"):
        resolve_backend_name("triton", CUDA, torch.bfloat16, 16)


def test_unknown_name_lists_choices() -> None:
    with pytest.raises(ValueError, match="choose one of"):
        get_attention_backend("xformers", CPU, torch.float32, 16)


def test_package_import_does_not_import_triton() -> None:
    code = "import sys, kernels.attention; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
