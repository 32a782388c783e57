"""Paged attention as the models see it: an attention backend built once per KV pool (metadata
builder + forward), the per-step metadata, and a weightless Attention layer."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
from torch import Tensor, nn

from engine.kv_groups import KVLayout
from kernels import DecodePlan, paged_decode_attention, paged_prefill_attention, write_kv


@dataclass
class AttentionMetadata:
    """Built once per step by the model runner, shared by every layer. Tokens are packed decodes first (one
    per sequence), then the new tokens of each prefill. Slots, block tables and the gather plan are the first
    KV cache group's; a layer of another group reads its group's view (see `view`)."""

    slot_mapping: Tensor  # [T] int64: slot of every new token, -1 = do not write
    num_decode_tokens: int
    decode_block_tables: Tensor  # [num_decodes, max_blocks] int32
    decode_context_lens: Tensor  # [num_decodes] int32, including the token being decoded
    prefill_block_tables: Tensor  # [num_prefills, max_blocks] int32
    prefill_cu_seqlens_q: Tensor  # [num_prefills + 1] int32, offsets into the prefill part
    prefill_context_lens: Tensor  # [num_prefills] int32, cached prefix + new tokens
    backend: AttentionBackend | None = None  # the pool and kernels these tensors index
    # the CPU decodes' gather plan: blocks several decodes start with (a system prompt) are attended once
    decode_plan: DecodePlan | None = None
    group_views: list[AttentionMetadata] | None = None  # per KV cache group (engine/kv_groups.py), when several

    def view(self, group: int) -> AttentionMetadata:
        """The metadata a layer of `group` attends with: its group's slots and block tables."""
        return self.group_views[group] if self.group_views else self

    def with_group(self, **tables) -> AttentionMetadata:
        """Another group's view: these tables (slot_mapping, block tables, decode_plan), the rest shared."""
        return replace(self, group_views=None, **tables)


class DecodeGather(NamedTuple):
    """A decode step's keys as cpu_ops.llama_decode reads them: each sequence's own slots and
    counts, then per shared prefix its member rows (empty: all), blocks and first block (-1: scattered)."""

    slots: Tensor  # [T, L] int64
    counts: Tensor  # [T] int64
    prefix_seqs: list[Tensor]
    prefix_blocks: list[Tensor]
    prefix_first: list[int]


class AttentionBackend:
    """The paged attention of one KV pool, built once: the kernels chosen at start-up and the
    pool's per-layer caches, passed explicitly to every kernel call (never stored on modules)."""

    def __init__(self, k_cache: Tensor, v_cache: Tensor, kernels: str | None, layout: KVLayout | None = None) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache  # [slots, num_blocks, block_size, kv_heads, head_dim]
        self.kernels = kernels  # "torch" / "triton" / None (kernels/ picks by device)
        # without a layout: one group, layer i in slot i (a plain paged cache)
        self.layout = layout or KVLayout.of([None] * k_cache.shape[0])
        self.layers = [(k_cache[s], v_cache[s]) for s in self.layout.layer_slot]

    def metadata(self, **fields) -> AttentionMetadata:
        return AttentionMetadata(backend=self, **fields)

    def decode_gather(self, meta: AttentionMetadata) -> DecodeGather | None:
        """The step's gather plan as a whole-layer decode op takes it, when every token of the step is
        a decode the CPU kernel attends in one chunk (else None)."""
        plan = meta.decode_plan
        if (plan is None or self.kernels == "triton" or self.layout.num_groups > 1 or plan.too_long
                or len(plan.chunks) != 1 or meta.num_decode_tokens != meta.slot_mapping.shape[0]
                or plan.chunks[0].seqs is not None):
            return None
        chunk, empty = plan.chunks[0], torch.empty(0, dtype=torch.long)
        return DecodeGather(chunk.slots.view(chunk.n, chunk.L), chunk.counts,
                            [empty if p.seqs is None else p.seqs for p in plan.prefixes],
                            [p.blocks for p in plan.prefixes],
                            [-1 if p.first_block is None else p.first_block for p in plan.prefixes])

    def forward(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float, meta: AttentionMetadata,
                window: int | None = None, softcap: float | None = None) -> Tensor:
        """Write this step's K/V into their slots, then attend: decodes first, then prefills.
        window: a sliding-window layer's (keys > position - window only; its group's blocks wholly out
        of the window are the null block, which the kernels never attend); softcap: scores = tanh(s / cap) * cap."""
        k_cache, v_cache = self.layers[layer]
        meta = meta.view(self.layout.layer_group[layer])
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        nd = meta.num_decode_tokens
        if nd == q.shape[0]:
            return self._decode(q, k_cache, v_cache, scale, meta, window, softcap)
        if nd == 0:
            return self._prefill(q, k_cache, v_cache, scale, meta, window, softcap)
        out = torch.empty_like(q)
        out[:nd] = self._decode(q[:nd], k_cache, v_cache, scale, meta, window, softcap)
        out[nd:] = self._prefill(q[nd:], k_cache, v_cache, scale, meta, window, softcap)
        return out

    def _decode(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, scale: float, meta: AttentionMetadata,
                window: int | None, softcap: float | None) -> Tensor:
        return paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                                      scale, plan=meta.decode_plan, backend=self.kernels, window=window,
                                      softcap=softcap)

    def _prefill(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, scale: float, meta: AttentionMetadata,
                 window: int | None, softcap: float | None) -> Tensor:
        return paged_prefill_attention(q, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_cu_seqlens_q,
                                       meta.prefill_context_lens, scale, backend=self.kernels, window=window,
                                       softcap=softcap)


class Attention(nn.Module):
    """No weights, no cache: this layer's index into the pool of the metadata's backend, which writes this
    step's K/V into the paged cache, then attends through the block tables."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_idx: int = 0,
                 window: int | None = None, softcap: float | None = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.layer_idx = scale, layer_idx
        self.window = window or None  # sliding window (keys > position - window), None: full attention
        self.softcap = softcap or None  # attention-logit soft-capping (Gemma 2), None: off

    def forward(self, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata) -> Tensor:
        if meta.backend is None:
            raise RuntimeError("metadata without a backend has no k_cache/v_cache: use AttentionBackend.metadata")
        return meta.backend.forward(self.layer_idx, q, k, v, self.scale, meta, self.window, self.softcap)

    def extra_repr(self) -> str:
        extra = f", window={self.window}" if self.window else ""
        extra += f", softcap={self.softcap}" if self.softcap else ""
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"layer={self.layer_idx}{extra}")
