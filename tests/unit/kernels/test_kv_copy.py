"""The Triton block gather/scatter/copy (kernels/kv_copy) against torch indexing, on CPU through the
Triton interpreter (in a subprocess: the interpreter is chosen when the kernel is decorated,
and other tests import it compiled). tests/gpu runs it compiled at llama3-8b sizes."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("triton")

from tests.child_env import child_env  # noqa: E402

SCRIPT = r"""
import torch
from cache_transfer.packing.block_copy import LayerBlocks, copy_layer, copy_layers
from cache_transfer.packing.block_ids import CheckedIds, check_block_ids
from cache_transfer.packing.packed_layer import pack_layer, unpack_layer
from cache_transfer.packing.rows import as_rows as _as_rows
from kernels.kv_copy import layers_table

torch.manual_seed(0)
for shape, dtype in (((7, 4, 2, 8), torch.bfloat16), ((8, 3, 1, 6), torch.float32)):
    for adjacent in (True, False):
        if adjacent:  # the engine's pool: K and V views of one [2, N, ...] slab
            slab = torch.randn(2, *shape).to(dtype)
            k, v = slab[0], slab[1]
        else:
            k, v = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
        ids = [5, 1, 6]
        nbytes = 2 * len(ids) * k[0].numel() * k.element_size()
        fast = torch.empty(nbytes, dtype=torch.uint8)
        ref = torch.empty(nbytes, dtype=torch.uint8)
        pack_layer(k, v, check_block_ids(ids, shape[0], "cpu"), fast, impl="triton")
        pack_layer(k, v, ids, ref, impl="torch")
        assert torch.equal(fast, ref), "gather differs"
        packed = ref.view(dtype).view(2, len(ids), *shape[1:])
        assert torch.equal(packed[0], k[ids]) and torch.equal(packed[1], v[ids])
        dk, dv = torch.full_like(k, -7), torch.full_like(v, -7)
        dst = [0, 4, 2]  # distinct, inside both pools
        unpack_layer(fast, dk, dv, dst, impl="triton")
        assert torch.equal(dk[dst], k[ids]) and torch.equal(dv[dst], v[ids]), "scatter differs"
        rest = [b for b in range(shape[0]) if b not in dst]
        assert bool((dk[rest] == -7).all() and (dv[rest] == -7).all()), "scatter wrote elsewhere"
        ck, cv = torch.full_like(k, -7), torch.full_like(v, -7)
        copy_layer(LayerBlocks(k, v, ids), ck, cv, dst, impl="triton")
        assert torch.equal(ck, dk) and torch.equal(cv, dv), "block copy differs"

# several layers: views of one slab per side, as the engine's pools are (one launch when every
# layer's offset is aligned; the last shape's K -> V offset of 8 x 9 words is not: layer by
# layer), and layers that are separate tensors
for shape, dtype, aligned in (
    ((7, 4, 2, 8), torch.bfloat16, True),
    ((8, 4, 1, 8), torch.float32, True),
    ((8, 3, 1, 6), torch.float32, False),
):
    for slabs in (True, False):
        num_layers = 3
        if slabs:
            src_slab = torch.randn(num_layers, 2, *shape).to(dtype)
            dst_slab = torch.full((num_layers, 2, 9, *shape[1:]), -7.0).to(dtype)
            src = [(src_slab[i, 0], src_slab[i, 1]) for i in range(num_layers)]
            dst = [(dst_slab[i, 0], dst_slab[i, 1]) for i in range(num_layers)]
        else:
            src = [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(3)]
            dst = [tuple(torch.full((9, *shape[1:]), -7.0).to(dtype) for _ in "kv") for _ in "abc"]
        rows = lambda pairs: [(_as_rows(k), _as_rows(v)) for k, v in pairs]
        if slabs:
            one_launch = layers_table(rows(src), rows(dst)) is not None
            assert one_launch == aligned, f"one launch: {one_launch}, expected {aligned}"
        ids = check_block_ids([5, 1, 6], shape[0], "cpu")  # one CheckedIds shared by the layers
        dst_ids = [8, 0, 3]
        want = [(k.clone(), v.clone()) for k, v in dst]
        for (sk, sv), (wk, wv) in zip(src, want):
            copy_layer(LayerBlocks(sk, sv, ids), wk, wv, dst_ids, impl="torch")
        copy_layers([LayerBlocks(k, v, ids) for k, v in src], dst, dst_ids, impl="triton")
        for (k, v), (wk, wv) in zip(dst, want):
            assert torch.equal(k, wk) and torch.equal(v, wv), f"layers copy differs ({slabs=})"
print("ok")
"""


def test_triton_gather_scatter_copy_match_torch_indexing() -> None:
    env = child_env(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
