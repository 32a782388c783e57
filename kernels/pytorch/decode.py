"""PyTorch paged decode attention: one new query per sequence, the CPU production path.

Each sequence's keys are gathered token by token (one index_select on the pool) and run through
the fused CPU flash kernel, a chunk of sequences at a time. A DecodePlan holds what is the same in
every layer of a step (which slots each sequence gathers, its mask, the shared-prefix groups), so
it is built once per step. Blocks that several sequences start with are attended once for all of
them (cascade attention). fp16/bf16 and very long contexts take the sliced prefill path instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kernels.pytorch import budget as torch_budget
from kernels.pytorch.prefill import sliced_attention


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
    counts: torch.Tensor  # [n] int64: each sequence's own keys (the first of its L slots)
    n: int
    L: int
    dtype: torch.dtype  # the queries'

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        """[n, 1, 1, L] additive: 0 for a sequence's own keys, -inf past them (the unfused path's, made
        at its first layer: the fused kernel reads counts instead)."""
        past = torch.arange(self.L, device=self.counts.device)[None, :] >= self.counts[:, None]
        mask = torch.zeros(self.n, 1, 1, self.L, dtype=self.dtype, device=self.counts.device)
        return mask.masked_fill_(past[:, None, None, :], float("-inf"))


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
    too_long: bool  # some context's K+V is past KV_BUDGET: the sliced path instead


def plan_decode(
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    kv_row: int,
    dtype: torch.dtype,
    shared_prefixes: Sequence[SharedPrefix] = (),
) -> DecodePlan:
    """The step's decode gather plan, shared by every layer. kv_row: Hkv * head_dim; dtype: the
    queries' (the masks are added to their scores)."""
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
        prefixes.append(
            _PrefixGroup(None if members == everyone else prefix.seqs, prefix.blocks, len(members), first_block)
        )
    own = [c - k for c, k in zip(ctx, skip)]
    # longest first, as many sequences per chunk as KV_BUDGET holds at the chunk's longest length
    order = sorted(everyone, key=own.__getitem__, reverse=True)
    chunks, i = [], 0
    while i < B:
        L = own[order[i]]
        n = max(1, min(B - i, torch_budget.KV_BUDGET // (L * 2 * kv_row)))
        rows = everyone if n == B else order[i : i + n]
        seqs = None if n == B else torch.tensor(rows, device=dev)
        lens = (context_lens if seqs is None else context_lens.index_select(0, seqs)).long()
        tables = block_tables if seqs is None else block_tables.index_select(0, seqs)
        idx = torch.arange(L, device=dev)[None, :]
        first = torch.tensor([skip[b] for b in rows], device=dev)[:, None] if any(skip[b] for b in rows) else 0
        counts = (lens[:, None] - first)[:, 0]  # each sequence's own keys
        # Positions past a sequence's length re-read its last token (never garbage or another
        # sequence's slot) and are masked out of the softmax.
        slots = _slots(tables, torch.minimum(idx + first, lens[:, None] - 1), bs)
        chunks.append(_Chunk(seqs, slots.flatten(), counts, n, L, dtype))
        i += n
    return DecodePlan(chunks, prefixes, max(ctx, default=0) * 2 * kv_row > torch_budget.KV_BUDGET)


def _slots(tables: torch.Tensor, pos: torch.Tensor, bs: int) -> torch.Tensor:
    """Pool slots of token positions [n, L] through block tables [n, max_blocks]."""
    if bs & (bs - 1) == 0:  # shifts and masks: several times faster than // and % on CPU
        shift = bs.bit_length() - 1
        return (tables.long().gather(1, pos >> shift) << shift) | (pos & (bs - 1))
    return tables.long().gather(1, pos // bs) * bs + pos % bs


# (q [n, Hq, D], k_rows, v_rows [slots, Hkv * D], slots [n, L], counts [n], scale) -> (out, lse)
OwnAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float],
                        tuple[torch.Tensor, torch.Tensor]]


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    shared_prefixes: Sequence[SharedPrefix] = (),
    plan: DecodePlan | None = None,
    own_attention: OwnAttention | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query per sequence: gather each sequence's keys token by token and run the fused
    attention kernel, a chunk of sequences at a time (a chunk's gathered K+V within KV_BUDGET).
    `own_attention` (kernels/__init__.py passes our C++ kernel's where it runs) takes a chunk's own
    keys in place through its slots instead: no gathered copy, no mask.

    A shared prefix is attended once for all its sequences (cascade attention): their queries
    stack into one matrix against the prefix's K/V, read once instead of once per sequence, and
    the result merges with each sequence's own suffix through the log-sum-exp of both parts.
    `plan` (from plan_decode with the same arguments) saves rebuilding the gather per layer.
    A sliding window (keys > position - window only) or score soft-capping takes the sliced path,
    which reads the block tables itself (the plan's shared prefixes would need per-sequence masks).
    """
    B, Hq, D = q.shape
    _, bs, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    if window and not softcap and int(context_lens.max()) <= window:
        window = None  # every key is in the window (a short chat): the fast paths below apply
    if window or softcap:
        return sliced_attention(q, k_cache, v_cache, block_tables, range(B), [1] * B, context_lens.tolist(), scale,
                                window, softcap)
    if (
        q.dtype != k_cache.dtype
        or q.dtype not in (torch.float32, torch.float64)
        or (plan.too_long if plan is not None else int(context_lens.max()) * 2 * Hkv * D > torch_budget.KV_BUDGET)
    ):
        # fp16/bf16 (fp32 math wanted) and very long contexts: the sliced online-softmax path
        return sliced_attention(q, k_cache, v_cache, block_tables, range(B), [1] * B, context_lens.tolist(), scale)
    if plan is None:
        plan = plan_decode(block_tables, context_lens, bs, Hkv * D, q.dtype, shared_prefixes)
    # 2-D rows: index_select copies whole rows then (several times faster than on the 3-D view)
    k_rows, v_rows = k_cache.view(-1, Hkv * D), v_cache.view(-1, Hkv * D)
    out = lse = None
    for c in plan.chunks:
        qc = q if c.seqs is None else q.index_select(0, c.seqs)
        if own_attention is not None:
            o, lse_c = own_attention(qc.contiguous(), k_rows, v_rows, c.slots.view(c.n, c.L), c.counts, scale)
        else:
            k = k_rows.index_select(0, c.slots).view(c.n, c.L, Hkv, D).transpose(1, 2)
            v = v_rows.index_select(0, c.slots).view(c.n, c.L, Hkv, D).transpose(1, 2)
            o, lse_c = _attention_lse(qc.view(c.n, Hkv, G, D), k, v, c.mask, scale)  # GQA: a group is a row block
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
        op, lse_p = _attention_lse(
            qp.view(p.m, Hkv, G, D).transpose(0, 1).reshape(1, Hkv, p.m * G, D), kp, vp, None, scale
        )
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
    if q.is_cpu:
        # The private aten op behind CPU SDPA: the one fused kernel that also returns the lse,
        # which merging a shared prefix with each sequence's own part needs (public SDPA drops it).
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask, scale=scale)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        s = s + mask
    lse = torch.logsumexp(s, -1)
    return torch.matmul(torch.exp(s - lse[..., None]), v), lse
