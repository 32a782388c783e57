"""Triton matmul over packed weights, for CUDA: y = x @ W.T with W in GGUF's own blocks of 32.

    q4: w = q * d + m, q in 0..15, GGML's byte order (byte j of a block: element j in the low
        nibble, element j + 16 in the high one), nibbles uint8 [N, K/2]
    q8: w = q * d, q int8 [N, K]

d and m are float32 [N, K/32]. Each program dequantizes a [BLOCK_N, BLOCK_K] weight tile in
registers and multiplies it with tl.dot, so only the packed bytes cross memory. A tile is taken in
two halves, the first and the second 16 elements of each of its blocks: a q4 byte holds one element
of each half, so its nibbles need no shuffle. Accumulation is fp32; the output takes x's dtype.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _block_linear_kernel(
    x_ptr, qs_ptr, d_ptr, m_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_qn, stride_dn, stride_om,
    Q4: tl.constexpr, HAS_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    half = tl.arange(0, BLOCK_K // 2)  # a tile half's positions: block half // 16, element half % 16
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        block = k0 // 32 + half // 16
        k_lo = k0 + (half // 16) * 32 + half % 16  # the first half's elements; the second's are 16 on
        mask_k = k_lo < K
        mask_w = mask_n[:, None] & mask_k[None, :]
        rows = qs_ptr + offs_n[:, None] * stride_qn
        if Q4:
            byte = tl.load(rows + (k0 // 2 + half)[None, :], mask=mask_w, other=0)
            q_lo, q_hi = byte & 15, byte >> 4
        else:
            q_lo = tl.load(rows + k_lo[None, :], mask=mask_w, other=0)
            q_hi = tl.load(rows + (k_lo + 16)[None, :], mask=mask_w, other=0)
        scales = offs_n[:, None] * stride_dn + block[None, :]
        d = tl.load(d_ptr + scales, mask=mask_w, other=0.0)
        w_lo = q_lo.to(tl.float32) * d
        w_hi = q_hi.to(tl.float32) * d
        if HAS_M:
            m = tl.load(m_ptr + scales, mask=mask_w, other=0.0)
            w_lo += m
            w_hi += m
        mask_x = mask_m[:, None] & mask_k[None, :]
        x_rows = x_ptr + offs_m[:, None] * stride_xm
        x_lo = tl.load(x_rows + k_lo[None, :], mask=mask_x, other=0.0)
        x_hi = tl.load(x_rows + (k_lo + 16)[None, :], mask=mask_x, other=0.0)
        acc += tl.dot(x_lo, tl.trans(w_lo.to(x_lo.dtype)), input_precision=PRECISION)
        acc += tl.dot(x_hi, tl.trans(w_hi.to(x_hi.dtype)), input_precision=PRECISION)
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def block_linear_meta(m: int, dtype: torch.dtype, interpreted: bool = False) -> dict:
    """Launch configuration: tl.dot wants 16 rows at least (a decode's few rows are masked). fp32
    takes exact (not tf32) products, which need smaller tiles to stay in registers. The interpreter
    (no registers, a cost per program and per loop step) gets the largest tiles."""
    if interpreted:
        return dict(BLOCK_M=max(16, min(64, triton.next_power_of_2(m))), BLOCK_N=128, BLOCK_K=128,
                    PRECISION="ieee")
    if dtype == torch.float32:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2, PRECISION="ieee")
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    return dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=2, PRECISION="tf32")


def block_linear(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
                 meta: dict | None = None) -> torch.Tensor:  # fmt: skip
    """x [M, K] (fp16, bf16 or fp32) @ W.T -> [M, N] in x's dtype; W: uint8 q4 nibbles [N, K/2] with d
    and m, or int8 q8 [N, K] with d (m None); d, m float32 [N, K/32]. meta: a launch configuration
    (block_linear_meta's by default)."""
    M, K = x.shape
    N = qs.shape[0]
    q4 = qs.dtype == torch.uint8
    if K % 32 or qs.shape[1] != (K // 2 if q4 else K) or d.shape != (N, K // 32) or (q4 and m is None):
        raise ValueError(f"x [{M}, {K}] does not fit a {'q4' if q4 else 'q8'} weight {tuple(qs.shape)} "
                         f"with scales {tuple(d.shape)}")
    x = x.contiguous()
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    meta = meta or block_linear_meta(M, x.dtype, interpreted=os.environ.get("TRITON_INTERPRET") == "1")
    grid = (triton.cdiv(M, meta["BLOCK_M"]), triton.cdiv(N, meta["BLOCK_N"]))
    _block_linear_kernel[grid](
        x, qs, d, d if m is None else m, out, M, N, K,
        x.stride(0), qs.stride(0), d.stride(0), out.stride(0),
        Q4=q4, HAS_M=m is not None, **meta,
    )  # fmt: skip
    return out
