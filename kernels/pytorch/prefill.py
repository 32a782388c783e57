"""PyTorch paged prefill attention: causal flash attention in a few large tensor ops.

Sequences are grouped into chunks of similar context length; a chunk walks its query rows in
steps, and each step walks the keys up to its last query's position in block-aligned slices:
gather the slice's K/V through the block tables (one index_select on the pool), batched scores
with GQA by reshaping q into [Hkv, G] (K/V are never repeated), causal/length mask, and an fp32
online softmax across slices. The budgets (kernels.pytorch.budget) bound every intermediate, so a
long context never materialises [T, L] scores or one huge gathered copy. Decode falls back to
this path (sliced_attention, one query row per sequence) for fp16/bf16 and very long contexts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.pytorch import budget as torch_budget


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
    """Packed new tokens q: [T, Hq, D] (sequence b's at cu_seqlens_q[b]:cu_seqlens_q[b+1], the last
    of its context_lens[b] positions) against their paged K/V, causally. Returns [T, Hq, D].
    window: a query at position p sees keys > p - window only; softcap: scores = tanh(s / cap) * cap."""
    starts, q_lens = cu_seqlens_q[:-1].tolist(), cu_seqlens_q.diff().tolist()
    return sliced_attention(q, k_cache, v_cache, block_tables, starts, q_lens, context_lens.tolist(), scale,
                            window, softcap)


def sliced_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    starts: Sequence[int],
    q_lens: Sequence[int],
    ctx: Sequence[int],
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Sequence b's q_lens[b] query rows q[starts[b]:], the last of its ctx[b] positions, causally
    against its paged K/V: chunks of sequences, each in row steps and key slices within the budgets.
    window / softcap: as paged_prefill_attention's (None: full attention, raw scores)."""
    out = torch.empty_like(q)
    kv_row = 2 * k_cache.shape[2] * k_cache.shape[3]
    # longest context first; a chunk grows while one K/V slice of all its sequences fits the
    # budget at full length and padding at most doubles its query rows
    order = sorted((b for b in range(len(ctx)) if q_lens[b] > 0), key=lambda b: ctx[b], reverse=True)
    i = 0
    while i < len(order):
        j, rows, m = i + 1, q_lens[order[i]], q_lens[order[i]]
        while j < len(order):
            n, m2, rows2 = j + 1 - i, max(m, q_lens[order[j]]), rows + q_lens[order[j]]
            if n * ctx[order[i]] * kv_row > torch_budget.KV_BUDGET or n * m2 > 2 * rows2:
                break
            j, rows, m = j + 1, rows2, m2
        seqs = order[i:j]
        _attend_chunk(
            q, k_cache, v_cache, block_tables, seqs, [starts[b] for b in seqs],
            [q_lens[b] for b in seqs], [ctx[b] for b in seqs], m, scale, out, window, softcap,
        )  # fmt: skip
        i = j
    return out


def _attend_chunk(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seqs: list[int],
    starts: list[int],
    q_lens: list[int],
    ctx: list[int],
    m: int,
    scale: float,
    out: torch.Tensor,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """Attention for the m (padded) query rows of each of the chunk's sequences, written to out."""
    n, (_, Hq, D), dev = len(seqs), q.shape, q.device
    _, bs, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    ct = torch.promote_types(q.dtype, torch.float32)  # fp32 math for fp16 / bf16
    start, length, keys = (torch.tensor(x, device=dev) for x in (starts, q_lens, ctx))
    tables = block_tables.index_select(0, torch.tensor(seqs, device=dev))
    key_step = max(bs, torch_budget.KV_BUDGET // (n * 2 * Hkv * D) // bs * bs)
    row_step = max(1, torch_budget.SCORE_BUDGET // (n * Hq * min(key_step, max(ctx))))
    for r0 in range(0, m, row_step):
        r1 = min(m, r0 + row_step)
        r = r1 - r0
        # padding rows repeat their sequence's last query, so every row sees key 0
        qi = torch.minimum(torch.arange(r0, r1, device=dev)[None, :], length[:, None] - 1)
        q_idx = start[:, None] + qi
        pos = keys[:, None] - length[:, None] + qi  # absolute position of each query
        # keys past the step's last query are causally invisible to all of it: never read
        k_end = max(c - nq + min(r1, nq) for c, nq in zip(ctx, q_lens, strict=True))
        # with a window, keys before the step's first query's window are invisible to all of it
        k_start = 0
        if window:
            k_start = max(0, min(c - nq + min(r0, nq - 1) for c, nq in zip(ctx, q_lens)) - window + 1) // bs * bs
        if k_end - k_start <= key_step and not softcap:  # one slice: the fused kernel, GQA by head, additive mask
            k, v = _gather_kv(k_cache, v_cache, tables, keys, k_start, k_end, ct)
            hidden = _hidden(torch.arange(k_start, k_start + k.shape[2], device=dev), pos, window)
            mask = torch.zeros(hidden.shape, dtype=ct, device=dev).masked_fill_(hidden, float("-inf"))
            o = torch.nn.functional.scaled_dot_product_attention(
                q[q_idx].to(ct).transpose(1, 2), k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=True
            )
            out[q_idx] = o.transpose(1, 2).to(out.dtype)  # duplicated padding rows write identical values
            continue
        qh = q[q_idx].to(ct).mul(scale).view(n, r, Hkv, G, D).permute(0, 2, 1, 3, 4).reshape(n, Hkv, r * G, D)
        m_i = l_i = None
        for k0 in range(k_start, k_end, key_step):
            k, v = _gather_kv(k_cache, v_cache, tables, keys, k0, min(k_end, k0 + key_step), ct)
            hidden = _hidden(torch.arange(k0, k0 + k.shape[2], device=dev), pos, window)
            s = torch.matmul(qh, k.transpose(2, 3))  # [n, Hkv, r*G, slice]
            if softcap:
                s = torch.tanh(s / softcap).mul_(softcap)
            s.view(n, Hkv, r, G, -1).masked_fill_(hidden[:, None, :, None, :], float("-inf"))
            # online softmax; the first slice holds key 0 for every row, so m_i is finite after it
            # (with a window a row may see nothing in it: its max is taken as 0 until it does)
            m_new = s.amax(-1) if m_i is None else torch.maximum(m_i, s.amax(-1))
            if window:
                m_new = m_new.masked_fill(m_new == float("-inf"), 0.0)
            p = torch.exp(s - m_new[..., None])
            if m_i is None:
                l_i, acc = p.sum(-1), torch.matmul(p, v)
            else:
                alpha = torch.exp(m_i - m_new)
                l_i = l_i * alpha + p.sum(-1)
                acc = acc * alpha[..., None] + torch.matmul(p, v)
            m_i = m_new
        o = acc / l_i[..., None]  # [n, Hkv, r*G, D]
        out[q_idx] = o.view(n, Hkv, r, G, D).permute(0, 2, 1, 3, 4).reshape(n, r, Hq, D).to(out.dtype)


def _hidden(key_pos: torch.Tensor, pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[n, r, keys] True where a key is invisible to a query: in its future, or (window) out of it."""
    hidden = key_pos[None, None, :] > pos[:, :, None]
    if window:
        hidden |= key_pos[None, None, :] <= pos[:, :, None] - window
    return hidden


def _gather_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    key_lens: torch.Tensor,
    k0: int,
    k1: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys [k0, k1) (k0 block-aligned) of each table's sequence as K, V: [n, Hkv, slice, D] in
    dtype, the slice rounded up to whole blocks; V at or past each sequence's length is zero."""
    _, bs, Hkv, D = k_cache.shape
    n, dev = tables.shape[0], tables.device
    b0, b1 = k0 // bs, -(-k1 // bs)
    L = (b1 - b0) * bs
    # table entries past a sequence's blocks are padding (any value): point them at block 0
    idx = tables[:, b0:b1].long()
    idx = idx.masked_fill(torch.arange(b0, b1, device=dev)[None, :] * bs >= key_lens[:, None], 0).flatten()
    k = k_cache.index_select(0, idx).view(n, L, Hkv, D).transpose(1, 2)
    v = v_cache.index_select(0, idx).view(n, L, Hkv, D).transpose(1, 2)
    if k.dtype != dtype or (n > 1 and Hkv > 1):
        # one pass that converts and lays heads out as batches: matmul can then read K
        # transposed for free, instead of copying [n, Hkv] batches element by element
        k = torch.empty(n, Hkv, L, D, dtype=dtype, device=dev).copy_(k)
        v = torch.empty(n, Hkv, L, D, dtype=dtype, device=dev).copy_(v)
    past_end = torch.arange(k0, k0 + L, device=dev)[None, :] >= key_lens[:, None]  # [n, L]
    if bool(past_end.any()):
        # those slots hold garbage (maybe NaN): NaN scores or 0 * NaN in p @ v would leak through the mask
        k.masked_fill_(past_end[:, None, :, None], 0)
        v.masked_fill_(past_end[:, None, :, None], 0)
    return k, v
