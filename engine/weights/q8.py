"""The 8-bit format ("int8"): GGUF's Q8_0 blocks, or any other weight quantized to 8 bits, as the
operand of each route (routes.py picks the route):

- ours (kernels/cpu/quant.cpp; on CUDA packed.GPUBlockWeight, same blocks): int8 in blocks of 32 with
  a scale per block, `w = q * d` (`q8_from_blocks` -> `Q8Weight`): Q8_0 exactly; anything else (Q5_x,
  Q6_K, float) requantized by absmax per block of 32 (`quantize_q8`);
- torch's (`aten._weight_int8pack_mm`, the CPU fallback): int8 with one scale per row (`Int8Weight`):
  Q8_0 requantized per row (`int8_from_blocks`), anything else by absmax per row (`quantize_int8`).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from engine.weights.blocks import GROUP, GGUFBlocks, block_view, exact_scales, f16_field
from engine.weights.packed import COMPUTE_DTYPE, ROW_GROUP, BlockWeight, PackedWeight
from kernels.cpu import ops as cpu_ops
from kernels.cpu import repack as cpu_repack

_CHUNK_ROWS = 4096  # rows requantized at a time
# GGUF block types that map exactly onto the 8-bit blocks, by name (gguf.GGMLQuantizationType)
_INT8_NATIVE = ("Q8_0",)


# ------------------------------------------------------------ blocks of 32 for kernels/cpu/quant.cpp
def q8_from_blocks(blocks: GGUFBlocks) -> tuple[Tensor, Tensor] | None:
    """Q8_0 -> (int8 [out, in], d float32 [out, in/32]), exact; None for other types."""
    if blocks.type_name not in _INT8_NATIVE:
        return None
    out_f, in_f = blocks.shape
    data = torch.from_numpy(np.array(blocks.data)).view(out_f, in_f // GROUP, -1)
    return data[..., 2:34].reshape(out_f, in_f).contiguous().view(torch.int8), f16_field(data, 0)


def q8_parts(source: Tensor | GGUFBlocks) -> tuple[Tensor, Tensor]:
    """Rows of a matrix as (int8, d): exact from Q8_0 blocks, else by absmax per block of 32."""
    parts = q8_from_blocks(source) if isinstance(source, GGUFBlocks) else None
    return parts or quantize_q8(source if isinstance(source, Tensor) else source.dequantize())


def quantize_q8(w: Tensor) -> tuple[Tensor, Tensor]:
    """Dense [out, in] -> (int8, d [out, in/32]) by absmax per block of 32 (as GGUF's Q8_0)."""
    out_f, in_f = w.shape
    qs = torch.empty(out_f, in_f, dtype=torch.int8)
    d = torch.empty(out_f, in_f // GROUP)
    for start in range(0, out_f, _CHUNK_ROWS):  # by rows: the fp32 temporaries stay small
        g = w[start : start + _CHUNK_ROWS].float().reshape(-1, in_f // GROUP, GROUP)
        scale = g.abs().amax(-1) / 127
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        qs[start : start + _CHUNK_ROWS] = torch.round(g / safe[..., None]).clamp_(-127, 127).to(torch.int8).flatten(1)
        d[start : start + _CHUNK_ROWS] = scale
    return qs, d


class Q8Weight(BlockWeight):
    """8-bit blocks of 32: int8 [out, in], d [out, in/32]: w = q * d. Kept in the kernel's order
    (cpu_ops.pack_q8: each block's halves interleaved)."""

    mode = "int8"
    names = ("qs", "d")
    scale_dtype = torch.float32  # absmax scales of float weights need it

    def __init__(self, qs: Tensor, d: Tensor) -> None:
        self.shape = tuple(qs.shape)
        self.qs, self.d = cpu_ops.pack_q8(qs), cpu_ops.pack_scales(exact_scales(d, self.scale_dtype))

    @classmethod
    def allocate(cls, out_f: int, in_f: int) -> Q8Weight:
        return cls.from_tensors((out_f, in_f), {  # the shapes pack_q8 and pack_scales give
            "qs": cls.advise_huge_pages(torch.empty(out_f, in_f, dtype=torch.int8)),
            "d": torch.empty(-(-out_f // ROW_GROUP), in_f // GROUP, ROW_GROUP, dtype=cls.scale_dtype)})

    def one_pass(self, source: Tensor | GGUFBlocks) -> bool:
        return isinstance(source, GGUFBlocks) and source.type_name == "Q8_0" and cpu_repack.available()

    def write_rows(self, r0: int, source: Tensor | GGUFBlocks) -> None:
        if self.one_pass(source):
            n, g0 = source.shape[0], r0 // ROW_GROUP  # one pass (the copies below move single bytes)
            cpu_repack.q8(block_view(source, 34), self.qs[r0 : r0 + n], self.d[g0 : g0 - (-n // ROW_GROUP)])
            return
        if isinstance(source, GGUFBlocks) and source.type_name == "Q8_0" and source.shape[0] % ROW_GROUP == 0:
            # straight from the file's bytes into pack_q8's and pack_scales' layouts, one strided copy each
            data = block_view(source, 34)
            n, blocks = source.shape[0], source.shape[1] // GROUP
            groups, g0 = n // ROW_GROUP, r0 // ROW_GROUP
            q = data[..., 2:34].view(torch.int8).unflatten(2, (2, 16)).unflatten(0, (groups, ROW_GROUP))
            self.qs[r0 : r0 + n].view(groups, blocks, ROW_GROUP, 16, 2).copy_(q.permute(0, 2, 1, 4, 3))
            d = data[..., 0:2].view(torch.float16)[..., 0]
            self.d[g0 : g0 + groups].copy_(d.view(groups, ROW_GROUP, blocks).transpose(1, 2))
            return
        qs, d = q8_parts(source)
        self.qs[r0 : r0 + qs.shape[0]] = cpu_ops.pack_q8(qs)
        self.d[r0 // ROW_GROUP : r0 // ROW_GROUP + -(-qs.shape[0] // ROW_GROUP)] = cpu_ops.pack_scales(
            exact_scales(d, self.scale_dtype))

    def _matmul(self, x: Tensor) -> Tensor:
        return cpu_ops.q8_linear(x, self.qs, self.d)

    def rows(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        return cpu_ops.q8_rows(self.qs, self.d, ids).to(dtype)

    def nbytes(self) -> int:
        return self.qs.nbytes + self.d.nbytes


class Q8HalfWeight(Q8Weight):
    """Q8_0 (and Q5_0) blocks as the file has them: d float16, exactly the file's: 34 bytes a block."""

    scale_dtype = torch.float16


# ------------------------------------------------------------ int8 rows for torch's kernel
def int8_from_blocks(blocks: GGUFBlocks) -> tuple[Tensor, Tensor] | None:
    """Q8_0 blocks -> (int8 [out, in], scale [out]) requantized per row; None for other types."""
    if blocks.type_name not in _INT8_NATIVE:
        return None
    out_f, in_f = blocks.shape
    data = torch.from_numpy(np.array(blocks.data)).view(out_f, in_f // GROUP, -1)  # a writable copy
    d = f16_field(data, 0)  # [out, blocks]
    q = data[..., 2:34].contiguous().view(torch.int8)  # [out, blocks, 32]
    row_scale = (d.abs() * q.abs().amax(-1).float()).amax(-1) / 127  # max |w| of each row / 127
    safe = torch.where(row_scale > 0, row_scale, torch.ones_like(row_scale))
    # Rows whose blocks all share one scale come back exactly (a ratio of 1 keeps q).
    ratio = d / safe[:, None]
    requant = torch.empty(out_f, in_f // GROUP, GROUP, dtype=torch.int8)
    for start in range(0, out_f, _CHUNK_ROWS):  # by rows: the fp32 temporaries stay small (a 49k-row head)
        rows = slice(start, start + _CHUNK_ROWS)
        requant[rows] = torch.round(q[rows].float() * ratio[rows, :, None]).clamp_(-127, 127).to(torch.int8)
    return requant.reshape(out_f, in_f), row_scale


def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """Dense [out, in] -> (int8, scale [out]) by absmax per row."""
    w = w.float()
    scale = w.abs().amax(-1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(w / safe[:, None]).clamp_(-127, 127).to(torch.int8), scale


class Int8Weight(PackedWeight):
    mode = "int8"

    def __init__(self, q: Tensor, scale: Tensor) -> None:
        self.shape = tuple(q.shape)
        self.q = q.contiguous()
        self.scale_f32 = scale.float().contiguous()  # row lookups are exact in fp32
        self.scale = scale.to(COMPUTE_DTYPE).contiguous()

    def linear(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(COMPUTE_DTYPE)
        out = torch.ops.aten._weight_int8pack_mm(x2, self.q, self.scale)
        out = out.to(x.dtype).reshape(*shape[:-1], self.shape[0])
        return out if bias is None else out + bias

    def rows(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        return (self.q[ids].float() * self.scale_f32[ids].unsqueeze(-1)).to(dtype)

    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes + self.scale_f32.nbytes

    def dequantize(self) -> Tensor:
        return self.q.float() * self.scale.float()[:, None]
