"""Paged-attention kernels: Triton kernels and a vectorised PyTorch path (the CPU default).

Every entry point takes ``backend``: "triton", "torch", or None (Triton when the tensors are on
CUDA and Triton is installed, the PyTorch path otherwise). Triton is imported only when used.
Modules, one per backend and job: triton_decode / torch_decode, triton_prefill / torch_prefill,
triton_cache / torch_cache; torch_budget bounds the PyTorch path's intermediates. A decode step's
whole decoder in one CPU call is a plug-in the models ask for: `fused_decoder(DecoderSpec)`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch

from kernels.cpu import ops as cpu_ops
from kernels.cpu.fused_decode import DecoderSpec, FusedDecoder, LayerSpec, fused_decoder
from kernels.pytorch import cache as torch_cache
from kernels.pytorch import decode as torch_decode
from kernels.pytorch import prefill as torch_prefill
from kernels.pytorch.decode import DecodePlan, SharedPrefix, plan_decode

__all__ = [
    "DecodePlan",
    "DecoderSpec",
    "FusedDecoder",
    "LayerSpec",
    "SharedPrefix",
    "block_linear",
    "copy_blocks",
    "fused_decoder",
    "paged_decode_attention",
    "paged_prefill_attention",
    "plan_decode",
    "triton_status",
    "write_kv",
]


def triton_status() -> str:
    """'compiled', 'interpreted' or 'unavailable' (for the banner and the bench)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "unavailable"

    if os.environ.get("TRITON_INTERPRET") == "1":
        return "interpreted"
    return "compiled" if torch.cuda.is_available() else "available (no CUDA: interpreter only)"


@functools.cache
def _triton_compiles() -> bool:
    return triton_status() == "compiled"


def _use_triton(t: torch.Tensor, backend: str | None) -> bool:
    if backend == "triton":
        return True
    if backend == "torch":
        return False
    if backend is not None:
        raise ValueError(f"unknown attention backend {backend!r} (expected 'triton' or 'torch')")
    return t.is_cuda and _triton_compiles()


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    shared_prefixes: Sequence[SharedPrefix] = (),
    plan: DecodePlan | None = None,
    backend: str | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One new query per sequence against its paged K/V.

    q: [B, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]; block_tables: [B, max_blocks]
    int32; context_lens: [B] int32 (>= 1, counting the current token). Returns [B, Hq, D].
    shared_prefixes: groups of sequences starting with the same blocks; the CPU path reads those
    blocks once per group (the result is the same; the Triton kernel reads them per sequence).
    plan: the PyTorch path's per-step gather plan (plan_decode), shared by every layer.
    window: sliding-window attention, keys > position - window only (None or 0: all keys);
    softcap: attention-logit soft-capping, scores = tanh(s / softcap) * softcap (None or 0: off).
    """
    if _use_triton(q, backend):
        from kernels.triton.decode import paged_decode_attention as impl

        return impl(q, k_cache, v_cache, block_tables, context_lens, scale, window=window, softcap=softcap)
    own = cpu_ops.decode_attention if cpu_ops.use_fused(q) else None  # our C++ kernel where it runs
    return torch_decode.paged_decode_attention(
        q, k_cache, v_cache, block_tables, context_lens, scale, shared_prefixes, plan, own, window, softcap
    )


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    backend: str | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of packed new tokens over their sequences' paged K/V (cached prefix included).

    q: [T, Hq, D], sequence b's tokens at cu_seqlens_q[b]:cu_seqlens_q[b+1]; they are the last
    q_len_b of context_lens[b] positions, and their K/V are already in the cache. Returns [T, Hq, D].
    window, softcap: as paged_decode_attention's.
    """
    if _use_triton(q, backend):
        from kernels.triton.prefill import paged_prefill_attention as impl
    else:
        impl = torch_prefill.paged_prefill_attention
    return impl(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, window=window, softcap=softcap)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    backend: str | None = None,
) -> None:
    """Store k, v: [T, Hkv, D] into one layer's cache at slot_mapping: [T] int64 (-1 = skip)."""
    if _use_triton(k, backend):
        from kernels.triton.cache import write_kv as impl
    else:
        impl = torch_cache.write_kv
        D = k_cache.shape[-1]
        if (cpu_ops.use_fused(k_cache) and k.dtype == v.dtype == torch.float32 and k.stride(1) == v.stride(1) == D
                and k.stride(2) == v.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()):
            slot_mapping, impl = slot_mapping.long(), cpu_ops.write_kv  # ours: one pass, -1 slots skipped inside
    impl(k, v, k_cache, v_cache, slot_mapping)


def copy_blocks(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    src: torch.Tensor | Sequence[int],
    dst: torch.Tensor | Sequence[int],
    *,
    backend: str | None = None,
) -> None:
    """Copy whole blocks src[i] -> dst[i] (copy-on-write), in every layer if the caches carry a
    leading layer dim [L, num_blocks, ...]. A dst block must not also be a src."""
    if _use_triton(k_cache, backend):
        from kernels.triton.cache import copy_blocks as impl
    else:
        impl = torch_cache.copy_blocks
    impl(k_cache, v_cache, src, dst)


def block_linear(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ W.T with W packed in blocks of 32 (q4: uint8 nibbles [N, K/2] in GGML order, w = q * d
    + m; q8: int8 [N, K], w = q * d): the Triton kernel (kernels/triton/quant.py), for CUDA."""
    from kernels.triton.quant import block_linear as impl

    return impl(x, qs, d, m)
