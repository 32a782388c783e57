"""Vectorised PyTorch paged attention: the CPU production path and the kernels' reference.

Flash attention in a few large tensor ops. Sequences are grouped into chunks of similar context
length; a chunk walks its query rows in steps, and each step walks the keys up to its last query's
position in block-aligned slices: gather the slice's K/V through the block tables (one
index_select on the pool), batched scores with GQA by reshaping q into [Hkv, G] (K/V are never
repeated), causal/length mask, and an fp32 online softmax across slices. The budgets bound every
intermediate, so a long context never materialises [T, L] scores or one huge gathered copy.

Decode (one query row per sequence) gathers each sequence's keys token by token and runs the fused
CPU flash kernel; a DecodePlan holds what is the same in every layer, and blocks that several
sequences start with are attended once for all of them (cascade attention).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

# Elements of one gathered K+V slice, and of one fp32 score slice. They keep CPU buffers under
# glibc's mmap threshold (32 MiB), past which every allocation page-faults afresh, while leaving
# slices long enough that the per-op overhead is amortised.
KV_BUDGET = 1 << 22
SCORE_BUDGET = 1 << 22


class SharedPrefix(NamedTuple):
    """Decode sequences whose block tables all start with the same physical blocks.

    seqs: [m] int64 batch indices; blocks: [P] int64 block ids, full blocks every one of the
    sequences starts with, its context running past them (the current token is never in them).
    """

    seqs: torch.Tensor
    blocks: torch.Tensor


@dataclass
class _Chunk:
    seqs: torch.Tensor | None  # batch rows, None = all of them in order
    slots: torch.Tensor  # [n * L] pool rows (token slots) to gather
    mask: torch.Tensor  # [n, 1, 1, L] additive: 0 for a sequence's own keys, -inf past them
    n: int
    L: int


@dataclass
class _PrefixGroup:
    seqs: torch.Tensor | None  # batch rows, None = all of them in order
    blocks: torch.Tensor  # [P] the shared blocks
    m: int
    first_block: int | None  # the blocks are first_block, first_block + 1, ...: read in place


@dataclass
class DecodePlan:
    """What a decode batch's attention needs that is the same in every layer (which keys each
    sequence gathers, its mask, the shared-prefix groups): built once per step, not per layer."""

    chunks: list[_Chunk]
    prefixes: list[_PrefixGroup]


def plan_decode(
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    kv_row: int,
    dtype: torch.dtype,
    shared_prefixes: Sequence[SharedPrefix] = (),
) -> DecodePlan:
    """kv_row: Hkv * head_dim; dtype: the queries' (the masks are added to their scores)."""
    B, dev, bs = block_tables.shape[0], block_tables.device, block_size
    ctx = context_lens.tolist()
    everyone = list(range(B))
    skip = [0] * B  # keys each sequence leaves to its shared prefix
    prefixes = []
    for prefix in shared_prefixes:
        members, blocks = prefix.seqs.tolist(), prefix.blocks.tolist()
        for b in members:
            skip[b] = len(blocks) * bs
        # a prompt's blocks, allocated together, are often consecutive in the pool
        first_block = blocks[0] if blocks == list(range(blocks[0], blocks[0] + len(blocks))) else None
        prefixes.append(_PrefixGroup(None if members == everyone else prefix.seqs, prefix.blocks, len(members),
                                     first_block))
    own = [c - k for c, k in zip(ctx, skip)]
    # longest first, as many sequences per chunk as KV_BUDGET holds at the chunk's longest length
    order = sorted(everyone, key=own.__getitem__, reverse=True)
    chunks, i = [], 0
    while i < B:
        L = own[order[i]]
        n = max(1, min(B - i, KV_BUDGET // (L * 2 * kv_row)))
        rows = everyone if n == B else order[i : i + n]
        seqs = None if n == B else torch.tensor(rows, device=dev)
        lens = (context_lens if seqs is None else context_lens.index_select(0, seqs)).long()
        tables = block_tables if seqs is None else block_tables.index_select(0, seqs)
        idx = torch.arange(L, device=dev)[None, :]
        first = torch.tensor([skip[b] for b in rows], device=dev)[:, None] if any(skip[b] for b in rows) else 0
        hidden = idx >= lens[:, None] - first  # past the sequence's own keys
        # Positions past a sequence's length re-read its last token (never garbage or another
        # sequence's slot) and are masked out of the softmax.
        slots = _slots(tables, torch.minimum(idx + first, lens[:, None] - 1), bs)
        mask = torch.zeros(n, 1, 1, L, dtype=dtype, device=dev).masked_fill_(hidden[:, None, None, :], float("-inf"))
        chunks.append(_Chunk(seqs, slots.flatten(), mask, n, L))
        i += n
    return DecodePlan(chunks, prefixes)


def _slots(tables: torch.Tensor, pos: torch.Tensor, bs: int) -> torch.Tensor:
    """Pool slots of token positions [n, L] through block tables [n, max_blocks]."""
    if bs & (bs - 1) == 0:  # shifts and masks: several times faster than // and % on CPU
        shift = bs.bit_length() - 1
        return (tables.long().gather(1, pos >> shift) << shift) | (pos & (bs - 1))
    return tables.long().gather(1, pos // bs) * bs + pos % bs


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    shared_prefixes: Sequence[SharedPrefix] = (),
    plan: DecodePlan | None = None,
) -> torch.Tensor:
    """One query per sequence: gather each sequence's keys token by token and run the fused
    attention kernel, a chunk of sequences at a time (a chunk's gathered K+V within KV_BUDGET).

    A shared prefix is attended once for all its sequences (cascade attention): their queries
    stack into one matrix against the prefix's K/V, read once instead of once per sequence, and
    the result merges with each sequence's own suffix through the log-sum-exp of both parts.
    `plan` (from plan_decode with the same arguments) saves rebuilding the gather per layer.
    """
    B, Hq, D = q.shape
    _, bs, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    if q.dtype != k_cache.dtype or q.dtype not in (torch.float32, torch.float64) or (
        int(context_lens.max()) * 2 * Hkv * D > KV_BUDGET
    ):
        # fp16/bf16 (fp32 math wanted) and very long contexts: the sliced online-softmax path
        return _paged_attention(q, k_cache, v_cache, block_tables, range(B), [1] * B, context_lens.tolist(), scale)
    if plan is None:
        plan = plan_decode(block_tables, context_lens, bs, Hkv * D, q.dtype, shared_prefixes)
    # 2-D rows: index_select copies whole rows then (several times faster than on the 3-D view)
    k_rows, v_rows = k_cache.view(-1, Hkv * D), v_cache.view(-1, Hkv * D)
    out = lse = None
    for c in plan.chunks:
        k = k_rows.index_select(0, c.slots).view(c.n, c.L, Hkv, D).transpose(1, 2)
        v = v_rows.index_select(0, c.slots).view(c.n, c.L, Hkv, D).transpose(1, 2)
        qh = (q if c.seqs is None else q.index_select(0, c.seqs)).view(c.n, Hkv, G, D)  # GQA: a group is a row block
        o, lse_c = _attention_lse(qh, k, v, c.mask, scale)
        if c.seqs is None:
            out, lse = o.reshape(B, Hq, D), lse_c.reshape(B, Hq)
            break
        if out is None:
            out, lse = torch.empty_like(q), torch.empty(B, Hq, dtype=q.dtype, device=q.device)
        out.index_copy_(0, c.seqs, o.reshape(c.n, Hq, D))
        lse.index_copy_(0, c.seqs, lse_c.reshape(c.n, Hq))
    for p in plan.prefixes:
        keys = p.blocks.numel() * bs
        if p.first_block is None:
            kp, vp = k_cache.index_select(0, p.blocks), v_cache.index_select(0, p.blocks)
        else:
            kp, vp = (cache.narrow(0, p.first_block, p.blocks.numel()) for cache in (k_cache, v_cache))
        kp, vp = (t.view(1, keys, Hkv, D).transpose(1, 2) for t in (kp, vp))
        # every query row of every sequence against the one copy of the prefix: [1, Hkv, m*G, D]
        qp = q if p.seqs is None else q.index_select(0, p.seqs)
        op, lse_p = _attention_lse(qp.view(p.m, Hkv, G, D).transpose(0, 1).reshape(1, Hkv, p.m * G, D), kp, vp,
                                   None, scale)
        op = op.view(Hkv, p.m, G, D).transpose(0, 1).reshape(p.m, Hq, D)
        lse_p = lse_p.view(Hkv, p.m, G).transpose(0, 1).reshape(p.m, Hq)
        o_s, lse_s = (out, lse) if p.seqs is None else (out.index_select(0, p.seqs), lse.index_select(0, p.seqs))
        total = torch.logaddexp(lse_p, lse_s)
        merged = op.mul_((lse_p - total).exp_()[..., None]).add_(o_s * (lse_s - total).exp_()[..., None])
        if p.seqs is None:
            out = merged
        else:
            out.index_copy_(0, p.seqs, merged)
    return out


def _attention_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention [..., rows, D] and the log-sum-exp of each row's scores; mask is additive."""
    if q.is_cpu:  # the fused flash kernel returns both
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask, scale=scale)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        s = s + mask
    lse = torch.logsumexp(s, -1)
    return torch.matmul(torch.exp(s - lse[..., None]), v), lse


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    starts, q_lens = cu_seqlens_q[:-1].tolist(), cu_seqlens_q.diff().tolist()
    return _paged_attention(q, k_cache, v_cache, block_tables, starts, q_lens, context_lens.tolist(), scale)


def _paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    starts: Sequence[int],
    q_lens: Sequence[int],
    ctx: Sequence[int],
    scale: float,
) -> torch.Tensor:
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
            if n * ctx[order[i]] * kv_row > KV_BUDGET or n * m2 > 2 * rows2:
                break
            j, rows, m = j + 1, rows2, m2
        seqs = order[i:j]
        _attend_chunk(
            q, k_cache, v_cache, block_tables, seqs, [starts[b] for b in seqs],
            [q_lens[b] for b in seqs], [ctx[b] for b in seqs], m, scale, out,
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
) -> None:
    """Attention for the m (padded) query rows of each of the chunk's sequences, written to out."""
    n, (_, Hq, D), dev = len(seqs), q.shape, q.device
    _, bs, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    ct = torch.promote_types(q.dtype, torch.float32)  # fp32 math for fp16 / bf16
    start, length, keys = (torch.tensor(x, device=dev) for x in (starts, q_lens, ctx))
    tables = block_tables.index_select(0, torch.tensor(seqs, device=dev))
    key_step = max(bs, KV_BUDGET // (n * 2 * Hkv * D) // bs * bs)
    row_step = max(1, SCORE_BUDGET // (n * Hq * min(key_step, max(ctx))))
    for r0 in range(0, m, row_step):
        r1 = min(m, r0 + row_step)
        r = r1 - r0
        # padding rows repeat their sequence's last query, so every row sees key 0
        qi = torch.minimum(torch.arange(r0, r1, device=dev)[None, :], length[:, None] - 1)
        q_idx = start[:, None] + qi
        pos = keys[:, None] - length[:, None] + qi  # absolute position of each query
        # keys past the step's last query are causally invisible to all of it: never read
        k_end = max(c - nq + min(r1, nq) for c, nq in zip(ctx, q_lens, strict=True))
        if k_end <= key_step:  # one slice: the fused kernel, GQA by head index, additive mask
            k, v = _gather_kv(k_cache, v_cache, tables, keys, 0, k_end, ct)
            hidden = torch.arange(k.shape[2], device=dev)[None, None, :] > pos[:, :, None]
            mask = torch.zeros(hidden.shape, dtype=ct, device=dev).masked_fill_(hidden, float("-inf"))
            o = torch.nn.functional.scaled_dot_product_attention(
                q[q_idx].to(ct).transpose(1, 2), k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=True
            )
            out[q_idx] = o.transpose(1, 2).to(out.dtype)  # duplicated padding rows write identical values
            continue
        qh = q[q_idx].to(ct).mul(scale).view(n, r, Hkv, G, D).permute(0, 2, 1, 3, 4).reshape(n, Hkv, r * G, D)
        m_i = l_i = None
        for k0 in range(0, k_end, key_step):
            k, v = _gather_kv(k_cache, v_cache, tables, keys, k0, min(k_end, k0 + key_step), ct)
            hidden = torch.arange(k0, k0 + k.shape[2], device=dev)[None, None, :] > pos[:, :, None]
            s = torch.matmul(qh, k.transpose(2, 3))  # [n, Hkv, r*G, slice]
            s.view(n, Hkv, r, G, -1).masked_fill_(hidden[:, None, :, None, :], float("-inf"))
            # online softmax; the first slice holds key 0 for every row, so m_i is finite after it
            m_new = s.amax(-1) if m_i is None else torch.maximum(m_i, s.amax(-1))
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


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    Hkv, D = k_cache.shape[-2:]
    keep = (slot_mapping >= 0).nonzero().squeeze(1)
    if keep.numel() != slot_mapping.numel():
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    slots = slot_mapping.long()
    # view() (not reshape) so a non-contiguous cache fails loudly instead of writing a copy
    k_cache.view(-1, Hkv, D).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, Hkv, D).index_copy_(0, slots, v.to(v_cache.dtype))


def copy_blocks(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    src: torch.Tensor | Sequence[int],
    dst: torch.Tensor | Sequence[int],
) -> None:
    dim = k_cache.dim() - 4  # 1 with a leading layer dim, else 0
    src_t = torch.as_tensor(src, dtype=torch.long, device=k_cache.device)
    dst_t = torch.as_tensor(dst, dtype=torch.long, device=k_cache.device)
    if src_t.numel() == 0:
        return
    for cache in (k_cache, v_cache):
        # gather first: reads see the old contents even if a dst is also a src
        cache.index_copy_(dim, dst_t, cache.index_select(dim, src_t))
