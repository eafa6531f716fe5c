"""One Triton launch per layer per request: K and V blocks together, gathered into (or
scattered from) one contiguous packed buffer `[2, n, row_words]` (K rows, then V rows).

    gather_blocks(k_rows, v_rows, ids, out)    out[kv, i] = (k_rows | v_rows)[ids[i]]
    scatter_blocks(payload, k_rows, v_rows, ids)  (k_rows | v_rows)[ids[i]] = payload[kv, i]
    copy_blocks(src_k, src_v, src_ids, dst_k, dst_v, dst_ids)
                                               dst_(k|v)[dst_ids[i]] = src_(k|v)[src_ids[i]]:
                                               no packed buffer (a write in place, one pass)
    copy_blocks_layers(src_rows, src_ids, dst_rows, dst_ids, table)
                                               copy_blocks for several layers in one launch
                                               (grid z: the layer; each layer's K and V base
                                               an offset from layer 0's K: layers_table,
                                               built once per set of caches)

`k_rows, v_rows`: `[pool_blocks, row_words]` views of one layer's caches (any element type:
callers pass int64 words); `ids`: int64 block ids on the same device, already checked against
the pool (the kernel does not bounds-check them). Each program moves one slice of one block
row with wide vector loads; the grid is (2 * n, ceil(row_words / BLOCK)).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with torch on x86_64 Linux
    triton = None

ROW_SLICE = 1024  # elements one program moves (8 KiB of int64 words)


def triton_available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _copy_rows(
        k_ptr, v_ptr, ids_ptr, packed_ptr, n, row_words, GATHER: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0)  # [0, n): K rows, [n, 2n): V rows, in packed order
        part = tl.program_id(1)
        is_v = row >= n
        block = tl.load(ids_ptr + (row - n * is_v.to(tl.int32))).to(tl.int64)
        offs = part * BLOCK + tl.arange(0, BLOCK)
        mask = offs < row_words
        cache_offs = block * row_words + offs
        packed_offs = row.to(tl.int64) * row_words + offs
        if GATHER:
            if is_v:
                x = tl.load(v_ptr + cache_offs, mask=mask)
            else:
                x = tl.load(k_ptr + cache_offs, mask=mask)
            tl.store(packed_ptr + packed_offs, x, mask=mask)
        else:
            x = tl.load(packed_ptr + packed_offs, mask=mask)
            if is_v:
                tl.store(v_ptr + cache_offs, x, mask=mask)
            else:
                tl.store(k_ptr + cache_offs, x, mask=mask)

    @triton.jit
    def _copy_rows_between(
        src_k_ptr, src_v_ptr, src_ids_ptr, dst_k_ptr, dst_v_ptr, dst_ids_ptr, n, row_words,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)  # [0, n): K rows, [n, 2n): V rows
        part = tl.program_id(1)
        is_v = row >= n
        i = row - n * is_v.to(tl.int32)
        src = tl.load(src_ids_ptr + i).to(tl.int64) * row_words
        dst = tl.load(dst_ids_ptr + i).to(tl.int64) * row_words
        offs = part * BLOCK + tl.arange(0, BLOCK)
        mask = offs < row_words
        if is_v:
            tl.store(dst_v_ptr + dst + offs, tl.load(src_v_ptr + src + offs, mask=mask), mask=mask)
        else:
            tl.store(dst_k_ptr + dst + offs, tl.load(src_k_ptr + src + offs, mask=mask), mask=mask)

    @triton.jit
    def _copy_layers_between(
        src_ptr, dst_ptr, offsets_ptr, src_ids_ptr, dst_ids_ptr, n, row_words,
        ALIGN: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)  # [0, n): K rows, [n, 2n): V rows
        part = tl.program_id(1)
        layer = tl.program_id(2)
        kv = (row >= n).to(tl.int32)  # 0: K, 1: V
        i = row - n * kv
        # this layer's K or V base, in elements from layer 0's K (src, then dst); the host
        # checked that every offset is a multiple of ALIGN elements
        src_base = tl.multiple_of(tl.load(offsets_ptr + layer * 4 + kv), ALIGN)
        dst_base = tl.multiple_of(tl.load(offsets_ptr + layer * 4 + 2 + kv), ALIGN)
        src = src_base + tl.load(src_ids_ptr + i).to(tl.int64) * row_words
        dst = dst_base + tl.load(dst_ids_ptr + i).to(tl.int64) * row_words
        offs = part * BLOCK + tl.arange(0, BLOCK)
        mask = offs < row_words
        tl.store(dst_ptr + dst + offs, tl.load(src_ptr + src + offs, mask=mask), mask=mask)


OFFSET_ALIGN = 16  # copy_blocks_layers: a layer's base, in elements from layer 0's (vector loads)


def _launch(
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    ids: torch.Tensor,
    packed: torch.Tensor,
    gather: bool,
) -> None:
    if triton is None:
        raise RuntimeError("triton is not installed")
    n, row_words = ids.numel(), k_rows.shape[1]
    if packed.shape != (2 * n, row_words) or k_rows.shape != v_rows.shape:
        raise ValueError(
            f"packed {list(packed.shape)} must be [2 * {n}, {row_words}] and k/v rows alike, "
            f"got k {list(k_rows.shape)}, v {list(v_rows.shape)}"
        )
    if n == 0:
        return
    grid = (2 * n, triton.cdiv(row_words, ROW_SLICE))
    _copy_rows[grid](
        k_rows, v_rows, ids, packed, n, row_words, GATHER=gather, BLOCK=ROW_SLICE, num_warps=4
    )


def gather_blocks(
    k_rows: torch.Tensor, v_rows: torch.Tensor, ids: torch.Tensor, out: torch.Tensor
) -> None:
    """out `[2 * n, row_words]` = K rows `ids`, then V rows `ids` (one launch)."""
    _launch(k_rows, v_rows, ids, out, gather=True)


def scatter_blocks(
    payload: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, ids: torch.Tensor
) -> None:
    """K rows `ids` = payload[:n], V rows `ids` = payload[n:] (one launch; ids distinct)."""
    _launch(k_rows, v_rows, ids, payload, gather=False)


def copy_blocks(
    src_k_rows: torch.Tensor,
    src_v_rows: torch.Tensor,
    src_ids: torch.Tensor,
    dst_k_rows: torch.Tensor,
    dst_v_rows: torch.Tensor,
    dst_ids: torch.Tensor,
) -> None:
    """dst K rows `dst_ids` = src K rows `src_ids`, and V alike (one launch; dst_ids distinct,
    both pools' rows of one width and element type)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    n, row_words = src_ids.numel(), src_k_rows.shape[1]
    shapes = {tuple(t.shape[1:]) for t in (src_k_rows, src_v_rows, dst_k_rows, dst_v_rows)}
    if dst_ids.numel() != n or len(shapes) != 1 or src_k_rows.dtype != dst_k_rows.dtype:
        raise ValueError(
            f"copy_blocks needs as many dst ids as src ids ({dst_ids.numel()} vs {n}) and rows "
            f"of one width and type: src {list(src_k_rows.shape)} {src_k_rows.dtype}, dst "
            f"{list(dst_k_rows.shape)} {dst_k_rows.dtype}"
        )
    if n == 0:
        return
    grid = (2 * n, triton.cdiv(row_words, ROW_SLICE))
    _copy_rows_between[grid](
        src_k_rows, src_v_rows, src_ids, dst_k_rows, dst_v_rows, dst_ids, n, row_words,
        BLOCK=ROW_SLICE, num_warps=4,
    )  # fmt: skip


RowPair = tuple[torch.Tensor, torch.Tensor]  # one layer's K rows and V rows


def layers_table(src_rows: Sequence[RowPair], dst_rows: Sequence[RowPair]) -> torch.Tensor | None:
    """`copy_blocks_layers`' table, on the rows' device: per layer the src K, src V, dst K, dst V
    base in elements from layer 0's K of its side (int64; from host to a CUDA device
    asynchronously, pinned: nothing waits for queued GPU work). None when one is not a multiple
    of OFFSET_ALIGN elements, or the rows differ in width, type or device: copy layer by layer
    then. Build it once per set of caches: the offsets do not change while the caches live."""
    rows = [r for pair in (*src_rows, *dst_rows) for r in pair]
    if len({(r.dtype, r.shape[1], r.device) for r in rows}) != 1:
        return None
    size = rows[0].element_size()
    src0, dst0 = src_rows[0][0].data_ptr(), dst_rows[0][0].data_ptr()
    offsets = []
    for (sk, sv), (dk, dv) in zip(src_rows, dst_rows, strict=True):
        for ptr, base in ((sk, src0), (sv, src0), (dk, dst0), (dv, dst0)):
            delta = ptr.data_ptr() - base
            if delta % (size * OFFSET_ALIGN):
                return None
            offsets.append(delta // size)
    table = torch.tensor(offsets, dtype=torch.int64)
    if rows[0].device.type == "cuda":
        return table.pin_memory().to(rows[0].device, non_blocking=True)
    return table


def copy_blocks_layers(
    src_rows: Sequence[RowPair],
    src_ids: torch.Tensor,
    dst_rows: Sequence[RowPair],
    dst_ids: torch.Tensor,
    table: torch.Tensor,
) -> None:
    """`copy_blocks` for every layer `(src_rows[l] -> dst_rows[l])`, the same ids in each, in
    one launch; `table` from `layers_table(src_rows, dst_rows)` (not None)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    n, row_words = src_ids.numel(), src_rows[0][0].shape[1]
    if dst_ids.numel() != n or table.numel() != 4 * len(src_rows) or len(dst_rows) != len(src_rows):
        raise ValueError(
            f"copy_blocks_layers: {n} src ids, {dst_ids.numel()} dst ids, {len(src_rows)} src "
            f"and {len(dst_rows)} dst layers, {table.numel()} offsets (4 per layer)"
        )
    if n == 0 or not src_rows:
        return
    grid = (2 * n, triton.cdiv(row_words, ROW_SLICE), len(src_rows))
    _copy_layers_between[grid](
        src_rows[0][0], dst_rows[0][0], table, src_ids, dst_ids, n, row_words,
        ALIGN=OFFSET_ALIGN, BLOCK=ROW_SLICE, num_warps=4,
    )  # fmt: skip
