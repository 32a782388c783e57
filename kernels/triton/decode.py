"""Triton paged decode attention: GQA-grouped, split-K ("flash decoding", vLLM v2).

Stage 1 runs one program per (sequence, KV head, split): it loads each K/V tile once for all the
query heads sharing that KV head (group padded to >= 16 rows so tl.dot can use tensor cores) and
keeps an online softmax in fp32 (the tile loop shared with prefill, kernels.triton.tiles). With one
split it writes the output directly; otherwise each split writes a normalised partial and its
log-sum-exp, and stage 2 merges the splits.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.triton.tiles import attend_kv_tiles

MIN_SPLIT_TOKENS = 256  # below this a split's fixed cost outweighs the extra parallelism
MAX_SPLITS = 64


@triton.jit
def _decode_stage1(
    q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, out_ptr, part_ptr, lse_ptr,
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_btb,
    stride_ob, stride_oh,
    scale_log2, num_splits, window, softcap_log2,
    G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b)
    lo = _first_key(ctx, window, HAS_WINDOW)
    # splits are whole BLOCK_N tiles; short sequences leave their trailing splits empty
    split_len = tl.cdiv(tl.cdiv(ctx - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * split_len
    end = tl.minimum(start + split_len, ctx)
    if start >= end:
        return

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < G
    mask_d = offs_d < D
    heads = kvh * G + offs_g
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_g[:, None] & mask_d[None, :],
        other=0.0,
    )

    bt_row = bt_ptr + b * stride_btb
    acc, m_i, l_i = attend_kv_tiles(
        q, bt_row, k_ptr, v_ptr, kvh,
        stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh,
        start, end, 0, scale_log2, window, softcap_log2,
        BLOCK_G, D, BS, BLOCK_N, BLOCK_D, False, PRECISION, False, HAS_SOFTCAP,
    )  # fmt: skip

    acc = acc / l_i[:, None]
    out_mask = mask_g[:, None] & mask_d[None, :]
    if not SPLIT:
        o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # partials: [B, Hq, NUM_SPLITS, D] fp32, lse: [B, Hq, NUM_SPLITS] (log2 domain)
        row = (b * (G * tl.num_programs(1)) + heads) * num_splits + split
        tl.store(part_ptr + row[:, None] * D + offs_d[None, :], acc, mask=out_mask)
        tl.store(lse_ptr + row, m_i + tl.log2(l_i), mask=mask_g)


@triton.jit
def _first_key(ctx, window, HAS_WINDOW: tl.constexpr):
    """The first key the decoding query (position ctx - 1) sees: with a window, the last `window` keys only."""
    if HAS_WINDOW:
        return tl.maximum(ctx - window, 0)
    return ctx * 0


@triton.jit
def _decode_merge(
    part_ptr, lse_ptr, ctx_ptr, out_ptr,
    stride_ob, stride_oh,
    num_splits, window,
    D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    ctx = tl.load(ctx_ptr + b)
    n_keys = ctx - _first_key(ctx, window, HAS_WINDOW)
    split_len = tl.cdiv(tl.cdiv(n_keys, num_splits), BLOCK_N) * BLOCK_N
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    # empty splits wrote nothing: their buffer rows are garbage, mask them out
    mask_s = (offs_s < num_splits) & (offs_s * split_len < n_keys)
    mask_d = offs_d < D
    row = (b * tl.num_programs(1) + h) * num_splits + offs_s
    lse = tl.load(lse_ptr + row, mask=mask_s, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    w = w / tl.sum(w, 0)
    part = tl.load(part_ptr + row[:, None] * D + offs_d[None, :], mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    o = tl.sum(part * w[:, None], 0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=mask_d)


def stage1_meta(group: int, head_dim: int, block_size: int, split: bool, dtype: torch.dtype,
                window: bool = False, softcap: bool = False) -> dict:
    """Constexprs and launch options of stage 1 (the split count itself is a runtime argument, so
    varying batches don't trigger recompiles). About 32 K (or V) elements per thread per tile:
    compiles without register spills on sm_80 / sm_90 for head_dim <= 256 in fp16, bf16 and fp32
    (see kernels.triton.compile_check)."""
    elem = dtype.itemsize
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n = 32 if elem == 2 or block_d <= 128 else 16
    return dict(
        G=group, D=head_dim, BS=block_size, SPLIT=split,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=block_n,
        PRECISION="ieee" if dtype == torch.float32 else "tf32",  # no silent tf32 for fp32 inputs
        HAS_WINDOW=window, HAS_SOFTCAP=softcap,
        num_warps=4 if block_n * block_d * elem <= 8192 else 8, num_stages=2,
    )  # fmt: skip


def merge_meta(head_dim: int, num_splits: int, block_n: int, has_window: bool = False) -> dict:
    return dict(
        D=head_dim, BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_N=block_n, HAS_WINDOW=has_window, num_warps=4,
    )  # fmt: skip


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: just enough to exercise the split path on long contexts


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Enough programs to fill the GPU twice over, each split at least MIN_SPLIT_TOKENS long."""
    want = triton.cdiv(2 * _num_sms(device), batch * num_kv_heads)
    return max(1, min(want, triton.cdiv(max_context, MIN_SPLIT_TOKENS), MAX_SPLITS))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """window: the query sees the last `window` keys only; softcap: scores = tanh(s / cap) * cap."""
    B, Hq, D = q.shape
    _, bs, Hkv, _ = k_cache.shape
    assert Hq % Hkv == 0 and D <= 256, (Hq, Hkv, D)
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    out = torch.empty_like(q)
    if B == 0:
        return out
    if num_splits is None:
        # the table width bounds every context without a device sync
        num_splits = choose_num_splits(B, Hkv, min(block_tables.shape[1] * bs, window or 1 << 62), q.device)
    meta = stage1_meta(Hq // Hkv, D, bs, num_splits > 1, q.dtype, bool(window), bool(softcap))
    if num_splits > 1:
        part = torch.empty(B, Hq, num_splits, D, dtype=torch.float32, device=q.device)
        lse = torch.empty(B, Hq, num_splits, dtype=torch.float32, device=q.device)
    else:
        part = lse = out  # unused
    _decode_stage1[(B, Hkv, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part, lse,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        scale * 1.4426950408889634,  # log2(e): softmax in base 2
        num_splits, window or 0, (softcap or 0.0) * 1.4426950408889634,
        **meta,
    )  # fmt: skip
    if num_splits > 1:
        _decode_merge[(B, Hq)](
            part, lse, context_lens, out,
            out.stride(0), out.stride(1),
            num_splits, window or 0,
            **merge_meta(D, num_splits, meta["BLOCK_N"], bool(window)),
        )  # fmt: skip
    return out
