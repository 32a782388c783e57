"""Paged attention as the models see it: per-step metadata and a weightless Attention layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from kernels import DecodePlan, paged_decode_attention, paged_prefill_attention, write_kv


@dataclass
class AttentionMetadata:
    """Built once per step by the model runner and shared by every layer.

    Tokens are packed decodes first (one per sequence), then the new tokens of each prefill.
    """

    slot_mapping: Tensor  # [T] int64: slot of every new token, -1 = do not write
    num_decode_tokens: int
    decode_block_tables: Tensor  # [num_decodes, max_blocks] int32
    decode_context_lens: Tensor  # [num_decodes] int32, including the token being decoded
    prefill_block_tables: Tensor  # [num_prefills, max_blocks] int32
    prefill_cu_seqlens_q: Tensor  # [num_prefills + 1] int32, offsets into the prefill part
    prefill_context_lens: Tensor  # [num_prefills] int32, cached prefix + new tokens
    backend: str | None = None  # "torch" / "triton" / None (auto)
    # CPU attention's gather plan for the decodes, built once per step; it attends the blocks that
    # several decodes start with (a system prompt, a forked history) once for all of them
    decode_plan: DecodePlan | None = None


class Attention(nn.Module):
    """Writes this step's K/V into the paged cache, then attends through the block tables.

    Holds no weights. `k_cache` / `v_cache` are this layer's views `[num_blocks, block_size,
    num_kv_heads, head_dim]` of the engine's pool; the model runner assigns them.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.k_cache: Tensor | None = None
        self.v_cache: Tensor | None = None

    def forward(self, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata) -> Tensor:
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError(
                "Attention layer has no KV cache: the model runner must assign k_cache/v_cache "
                "(see model.attention_layers()) before the first forward"
            )
        write_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        num_decode = meta.num_decode_tokens
        if num_decode == q.shape[0]:
            return self._decode(q, meta)
        if num_decode == 0:
            return self._prefill(q, meta)
        out = torch.empty_like(q)
        out[:num_decode] = self._decode(q[:num_decode], meta)
        out[num_decode:] = self._prefill(q[num_decode:], meta)
        return out

    def _decode(self, q: Tensor, meta: AttentionMetadata) -> Tensor:
        return paged_decode_attention(
            q,
            self.k_cache,
            self.v_cache,
            meta.decode_block_tables,
            meta.decode_context_lens,
            self.scale,
            plan=meta.decode_plan,
            backend=meta.backend,
        )

    def _prefill(self, q: Tensor, meta: AttentionMetadata) -> Tensor:
        return paged_prefill_attention(
            q,
            self.k_cache,
            self.v_cache,
            meta.prefill_block_tables,
            meta.prefill_cu_seqlens_q,
            meta.prefill_context_lens,
            self.scale,
            backend=meta.backend,
        )

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
