"""Vectorised PyTorch paged attention: the CPU production path and the kernels' reference.

Each chunk of work gathers its sequences' K/V whole blocks at a time through the block table
(one index_select on the pool), pads to the longest, and runs one batched masked softmax in fp32
(GQA by reshaping q into [Hkv, G], never repeating K/V). Chunks are sized by a memory budget:
decode chunks the batch; prefill cuts long prompts into query tiles and packs tiles of similar
key length together.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Elements of gathered K/V plus scores per chunk: bounds memory on huge batches / contexts, and
# keeps CPU buffers under glibc's mmap threshold (32 MiB), past which every call page-faults.
CHUNK_BUDGET = 1 << 22


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    B, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    out = torch.empty_like(q)
    if B == 0:
        return out
    # sequences per chunk so that gathered K/V + scores stay within the budget
    step = max(1, CHUNK_BUDGET // (int(context_lens.max()) * (2 * Hkv * D + Hq)))
    for b in range(0, B, step):
        lens = context_lens[b : b + step]
        pos = (lens - 1)[:, None]  # the one query sits at the last position
        o = _attend(q[b : b + step, None], k_cache, v_cache, block_tables[b : b + step], lens, pos, scale)
        out[b : b + step] = o[:, 0]
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    out = torch.empty_like(q)
    kv_row = 2 * Hkv * D
    # tile = (seq, first token in q, n queries, keys it needs): long prompts are cut so one
    # tile's scores fit the budget; a later slice of a prompt also needs more keys
    tiles: list[tuple[int, int, int, int]] = []
    starts, q_lens, ctx_lens = cu_seqlens_q[:-1].tolist(), cu_seqlens_q.diff().tolist(), context_lens.tolist()
    for b, (s, n, c) in enumerate(zip(starts, q_lens, ctx_lens, strict=True)):
        step = max(1, (CHUNK_BUDGET // max(c, 1) - kv_row) // Hq)
        for i in range(0, n, step):
            m = min(step, n - i)
            tiles.append((b, s + i, m, c - n + i + m))
    # longest first, so the tiles packed into a chunk pad to similar lengths
    tiles.sort(key=lambda t: t[3], reverse=True)
    i = 0
    while i < len(tiles):
        n_keys, m, j = tiles[i][3], tiles[i][2], i + 1
        while j < len(tiles) and (j + 1 - i) * n_keys * (kv_row + Hq * max(m, tiles[j][2])) <= CHUNK_BUDGET:
            m, j = max(m, tiles[j][2]), j + 1
        seq, start, length, keys = torch.tensor(tiles[i:j], device=q.device).unbind(1)
        # padding queries repeat their tile's last query, so no score row is fully masked
        qi = torch.minimum(torch.arange(m, device=q.device)[None, :], length[:, None] - 1)
        q_idx = start[:, None] + qi
        pos = keys[:, None] - length[:, None] + qi  # absolute position of each query
        o = _attend(
            q.index_select(0, q_idx.flatten()).view(j - i, m, Hq, D),
            k_cache,
            v_cache,
            block_tables.index_select(0, seq),
            keys,
            pos,
            scale,
        )
        out[q_idx] = o.to(out.dtype)  # duplicated padding rows write the same values
        i = j
    return out


def _attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    key_lens: torch.Tensor,
    pos: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q: [n, m, Hq, D] at absolute positions pos: [n, m], each row attending causally to keys
    [0, key_lens) of its table's sequence. Returns [n, m, Hq, D] in q's dtype."""
    n, m, Hq, D = q.shape
    _, bs, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    dev = q.device
    nb = -(-int(key_lens.max()) // bs)
    L = nb * bs
    # table entries past a sequence's blocks are padding (any value): point them at block 0
    bt = tables[:, :nb].long()
    bt = bt.masked_fill(torch.arange(nb, device=dev)[None, :] * bs >= key_lens[:, None], 0)
    k = k_cache.index_select(0, bt.flatten()).view(n, L, Hkv, D)
    v = v_cache.index_select(0, bt.flatten()).view(n, L, Hkv, D)
    past_end = torch.arange(L, device=dev)[None, :] >= key_lens[:, None]  # [n, L]
    if bool(past_end.any()):
        # those slots hold garbage (maybe NaN) and 0 * NaN would leak through p @ v
        v.view(n * L, Hkv * D).index_fill_(0, past_end.flatten().nonzero().squeeze(1), 0)

    ct = torch.promote_types(q.dtype, torch.float32)  # fp32 math for fp16/bf16 inputs
    qh = q.to(ct).mul(scale).view(n, m, Hkv, G, D).permute(0, 2, 1, 3, 4).reshape(n, Hkv, m * G, D)
    # [n, Hkv, L, D] copies whole rows; matmul then reads it transposed for free (a permute
    # straight to [n, Hkv, D, L] would make it copy element by element)
    k = k.to(ct).transpose(1, 2).contiguous()
    s = torch.matmul(qh, k.transpose(2, 3))  # [n, Hkv, m*G, L]
    hidden = torch.arange(L, device=dev)[None, None, :] > pos[:, :, None]  # [n, m, L]: causal + length
    s.view(n, Hkv, m, G, L).masked_fill_(hidden[:, None, :, None, :], float("-inf"))
    o = torch.matmul(torch.softmax(s, dim=-1), v.to(ct).transpose(1, 2))  # [n, Hkv, m*G, D]
    return o.view(n, Hkv, m, G, D).permute(0, 2, 1, 3, 4).reshape(n, m, Hq, D).to(q.dtype)


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
