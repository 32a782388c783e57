"""Triton paged prefill attention: causal flash attention of packed new tokens over paged K/V.

One program per (query tile, query head). Tiles of all sequences are numbered without a device
sync: sequence b owns tile ids [cu[b] // BLOCK_M + b, cu[b+1] // BLOCK_M + b + 1), found in the
kernel by binary search over cu_seqlens_q; surplus ids exit at once. K/V are read block by block
through the block table, from position 0 (the cached prefix) up to the tile's last query, by the
tile loop shared with decode (kernels.triton.tiles).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.tiles import attend_kv_tiles


@triton.jit
def _find_seq(cu_ptr, tile, num_seqs, BLOCK_M: tl.constexpr):
    # last b with cu[b] // BLOCK_M + b <= tile
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(cu_ptr + mid) // BLOCK_M + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, cu_ptr, ctx_ptr, out_ptr,
    num_seqs,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_btb,
    stride_ot, stride_oh,
    scale_log2, window, softcap_log2,
    G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    h = tl.program_id(1)
    b = _find_seq(cu_ptr, tile, num_seqs, BLOCK_M)
    q_start = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_start
    m0 = (tile - (q_start // BLOCK_M + b)) * BLOCK_M
    if m0 >= q_len:
        return
    ctx = tl.load(ctx_ptr + b)
    kvh = h // G

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < q_len
    mask_d = offs_d < D
    pos = ctx - q_len + offs_m  # absolute position of each query
    q = tl.load(
        q_ptr + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )

    bt_row = bt_ptr + b * stride_btb
    # keys past the tile's last query are causally invisible to the whole tile: never loaded;
    # padding rows (offs_m >= q_len) see keys up to kv_end only, so no row is all -inf
    kv_end = tl.minimum(ctx - q_len + m0 + BLOCK_M, ctx)
    kv_start = ctx * 0
    if HAS_WINDOW:  # keys before the tile's first query's window are invisible to the whole tile
        kv_start = tl.maximum(ctx - q_len + m0 - window + 1, 0)
    acc, _, l_i = attend_kv_tiles(
        q, bt_row, k_ptr, v_ptr, kvh,
        stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh,
        kv_start, kv_end, pos, scale_log2, window, softcap_log2,
        BLOCK_M, D, BS, BLOCK_N, BLOCK_D, True, PRECISION, HAS_WINDOW, HAS_SOFTCAP,
    )  # fmt: skip

    if HAS_WINDOW:  # a padding row past the context may see no key at all: not stored, but no 0 / 0
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
    acc = acc / l_i[:, None]
    o_ptrs = out_ptr + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def prefill_meta(group: int, head_dim: int, block_size: int, dtype: torch.dtype,
                 window: bool = False, softcap: bool = False) -> dict:
    """Constexprs and launch options. Tiles shrink as head_dim grows so that the kernel compiles
    without register spills on sm_80 / sm_90 (see kernels.triton.compile_check); fp32 (no tensor cores,
    IEEE dots) gets smaller tiles still."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    if dtype.itemsize == 2:
        # d=256 (Gemma) at 32 rows spilled on sm_80 and, with window and softcap, on sm_90 under Triton 3.6
        block_m, block_n, warps = min(128, 8192 // block_d) if block_d <= 128 else 16, min(64, 4096 // block_d), 8
    else:
        block_m, block_n = 32, 32 if block_d <= 64 else 16
        warps = 4 if block_d <= 128 else 8
    return dict(
        G=group, D=head_dim, BS=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        PRECISION="ieee" if dtype == torch.float32 else "tf32",  # no silent tf32 for fp32 inputs
        HAS_WINDOW=window, HAS_SOFTCAP=softcap,
        num_warps=warps, num_stages=2,
    )  # fmt: skip


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """window: a query at position p sees keys > p - window only; softcap: scores = tanh(s / cap) * cap."""
    T, Hq, D = q.shape
    _, bs, Hkv, _ = k_cache.shape
    assert Hq % Hkv == 0 and D <= 256, (Hq, Hkv, D)
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    B = context_lens.shape[0]
    out = torch.empty_like(q)
    if T == 0 or B == 0:
        return out
    meta = prefill_meta(Hq // Hkv, D, bs, q.dtype, bool(window), bool(softcap))
    # T // BLOCK_M + B bounds the tile count of any split of T tokens into B sequences
    grid = (T // meta["BLOCK_M"] + B, Hq)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out,
        B,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        scale * 1.4426950408889634,  # log2(e): softmax in base 2
        window or 0, (softcap or 0.0) * 1.4426950408889634,
        **meta,
    )  # fmt: skip
    return out
