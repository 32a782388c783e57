"""The online-softmax tile loop that the Triton decode and prefill kernels share.

One call walks key positions [start, end) of one sequence in BLOCK_N tiles: each tile's K and V
rows are loaded through the block table (masked, so table entries and slots past `end` are never
touched), scored against the caller's query rows in the log2 domain, and folded into a running
max, sum and fp32 accumulator. Triton inlines it, so each kernel compiles as if written out.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_kv_tiles(
    q, bt_row, k_ptr, v_ptr, kvh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    start, end, pos, scale_log2, window, softcap_log2,
    ROWS: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr = False, HAS_SOFTCAP: tl.constexpr = False,
):  # fmt: skip
    """q: [ROWS, BLOCK_D] query rows of KV head kvh, zero past D; bt_row: the sequence's block
    table row. CAUSAL: row r sees keys up to pos[r] only (pos is ignored otherwise), and with
    HAS_WINDOW only keys > pos[r] - window. HAS_SOFTCAP: scores become tanh(s / cap) * cap
    (softcap_log2 = cap * log2(e), the cap in the log2 domain). Returns
    (acc, m_i, l_i): the unnormalised output [ROWS, BLOCK_D] fp32, and each row's running max and
    sum in the log2 domain (an empty range leaves m_i at -inf and l_i at 0)."""
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        blk = tl.load(bt_row + offs_n // BS, mask=mask_n, other=0).to(tl.int64)
        slot = offs_n % BS
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(
            k_ptr + blk[:, None] * stride_kb + slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [ROWS, N], log2 domain
        if HAS_SOFTCAP:  # tanh(x) = 1 - 2 / (e^2x + 1): saturates to +-1 without overflow
            s = softcap_log2 * (1.0 - 2.0 / (tl.exp2(s * (2.8853900817779268 / softcap_log2)) + 1.0))
        if CAUSAL:
            visible = mask_n[None, :] & (offs_n[None, :] <= pos[:, None])
            if HAS_WINDOW:
                visible = visible & (offs_n[None, :] > pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        else:
            s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if HAS_WINDOW:  # a row may see no key of this tile yet: keep its max finite (no -inf - -inf)
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        v = tl.load(
            v_ptr + blk[:, None] * stride_vb + slot[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i
