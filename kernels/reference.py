"""Vectorised PyTorch paged attention: the CPU production path and the kernels' reference.

Work is cut into tiles (a run of one sequence's queries). Tiles are sorted by how many keys they
need and packed into chunks under a memory budget; each chunk gathers its K/V blocks through the
block table and runs one batched masked softmax in fp32 (GQA by reshaping q, never copying K/V).
Decode is the special case of one query per sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Elements of gathered K/V plus scores per chunk: keeps huge batches / contexts from
# materialising everything at once, while small batches still run as one chunk.
CHUNK_BUDGET = 1 << 25


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    B = q.shape[0]
    ctx = context_lens.tolist()
    # one query per sequence at position ctx - 1
    return _paged_attention(q, k_cache, v_cache, block_tables, list(range(B)), [1] * B, ctx, scale)


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
    q_starts: Sequence[int],
    q_lens: Sequence[int],
    ctx_lens: Sequence[int],
    scale: float,
) -> torch.Tensor:
    T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    out = torch.empty_like(q)
    if T == 0:
        return out
    # tile = (seq, first token in q, n queries, absolute position of the first query)
    tiles: list[tuple[int, int, int, int]] = []
    for b, (s, n, c) in enumerate(zip(q_starts, q_lens, ctx_lens, strict=True)):
        step = max(1, (CHUNK_BUDGET // max(c, 1) - 2 * Hkv * D) // Hq)
        for i in range(0, n, step):
            tiles.append((b, s + i, min(step, n - i), c - n + i))
    # longest first, so each chunk pads to a similar key length
    tiles.sort(key=lambda t: t[3] + t[2], reverse=True)
    i = 0
    while i < len(tiles):
        n_keys, m = tiles[i][3] + tiles[i][2], tiles[i][2]
        j = i + 1
        while j < len(tiles):
            m2 = max(m, tiles[j][2])
            if (j + 1 - i) * n_keys * (2 * Hkv * D + Hq * m2) > CHUNK_BUDGET:
                break
            m, j = m2, j + 1
        _attend_chunk(q, k_cache, v_cache, block_tables, tiles[i:j], m, n_keys, scale, out)
        i = j
    return out


def _attend_chunk(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    tiles: list[tuple[int, int, int, int]],
    m: int,
    n_keys: int,
    scale: float,
    out: torch.Tensor,
) -> None:
    _, Hq, D = q.shape
    _, bs, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    dev = q.device
    n = len(tiles)
    seq, start, length, pos0 = torch.tensor(tiles, device=dev).unbind(1)
    ar = torch.arange(m, device=dev)
    valid_q = ar[None, :] < length[:, None]  # [n, m]
    # padding queries repeat the tile's last query, so no row is fully masked
    qi = torch.minimum(ar[None, :], length[:, None] - 1)
    q_idx = start[:, None] + qi
    pos = pos0[:, None] + qi  # [n, m] absolute positions
    keys_end = pos0 + length  # keys [0, keys_end) may be read

    # gather whole blocks; table entries past a tile's blocks are padding, point them at block 0
    nb = -(-n_keys // bs)
    L = nb * bs
    bt = block_tables.index_select(0, seq)[:, :nb].long()
    need = -(-keys_end // bs)
    bt = torch.where(torch.arange(nb, device=dev)[None, :] < need[:, None], bt, 0)
    k = k_cache.index_select(0, bt.flatten()).view(n, L, Hkv, D)
    v = v_cache.index_select(0, bt.flatten()).view(n, L, Hkv, D)
    key_ok = torch.arange(L, device=dev)[None, :] < keys_end[:, None]  # [n, L]
    if not bool(key_ok.all()):
        # slots past the context hold garbage (maybe NaN): 0 * NaN would leak through p @ v
        v.view(n * L, Hkv * D).index_fill_(0, (~key_ok).flatten().nonzero().squeeze(1), 0)

    ct = torch.promote_types(q.dtype, torch.float32)
    qh = q.index_select(0, q_idx.flatten()).view(n, m, Hkv, G, D).to(ct) * scale
    qh = qh.permute(0, 2, 1, 3, 4).reshape(n, Hkv, m * G, D)
    s = torch.matmul(qh, k.to(ct).permute(0, 2, 3, 1))  # [n, Hkv, m*G, L]
    causal = torch.arange(L, device=dev)[None, None, :] <= pos[:, :, None]  # [n, m, L]
    s.view(n, Hkv, m, G, L).masked_fill_(~causal[:, None, :, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    o = torch.matmul(p, v.to(ct).transpose(1, 2))  # [n, Hkv, m*G, D]
    o = o.view(n, Hkv, m, G, D).permute(0, 2, 1, 3, 4).reshape(n, m, Hq, D)
    if m == 1 or bool(valid_q.all()):
        out.index_copy_(0, q_idx.flatten(), o.reshape(n * m, Hq, D).to(out.dtype))
    else:
        out.index_copy_(0, q_idx[valid_q], o[valid_q].to(out.dtype))


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
