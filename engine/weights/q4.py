"""The 4-bit format ("int4"): GGUF's Q4_0, Q4_1 and Q4_K blocks, or any other weight quantized to
4 bits, as the operand of each route (routes.py picks the route):

- ours (kernels/cpu/quant.cpp; on CUDA packed.GPUBlockWeight, same blocks): nibbles in blocks of 32
  with a scale and a minimum per block, `w = q * d + m` (`q4_from_blocks` -> `Q4Weight`; Q4_0 and Q4_1
  keep the file's float16 d and m: `Q4HalfWeight`), and Q4_K with its own 6-bit sub-block scales and
  float16 super-block ones (`q4k_parts` -> `Q4KWeight`), all exactly;
- torch's (`aten._weight_int4pack_mm_for_cpu`, the CPU fallback): int4 groups of 32 with a scale and a
  zero, `w = (q - 8) * scale + zero` (`int4_from_blocks` -> `Int4Weight`): the same types exactly, only
  the scales round to bf16.

Any other tensor (Q5_x, Q6_K, float) asked for as int4 is quantized by min/max per group of 32
(`quantize_int4`); under quantization "auto" those types keep their own exact forms (q5.py, q6.py).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from engine.weights.blocks import (
    GROUP,
    SUPER,
    GGUFBlocks,
    block_view,
    exact_scales,
    f16_field,
    ggml_nibbles,
    k_scale_min,
)
from engine.weights.packed import COMPUTE_DTYPE, ROW_GROUP, BlockWeight, PackedWeight
from kernels.cpu import ops as cpu_ops
from kernels.cpu import repack as cpu_repack

# GGUF block types that map exactly onto the 4-bit forms, by name (gguf.GGMLQuantizationType)
_INT4_EXACT = ("Q4_0", "Q4_1", "Q4_K")


def _q4_k(data: Tensor, out_f: int, in_f: int) -> tuple[Tensor, Tensor, Tensor]:
    """Q4_K super-blocks (256 weights, 144 bytes: d, dmin, 12 bytes of 6-bit scales and mins for
    8 sub-blocks of 32, 128 bytes of nibbles): sub-block j is `d * sc_j * q - dmin * m_j`.
    Returns (q uint8 [out, in], scale, minimum [out, in/32]): `w = q * scale + minimum`."""
    d, dmin = f16_field(data, 0), f16_field(data, 2)  # [out, supers]
    sc, mn = k_scale_min(data)
    return _q4_k_values(data, out_f, in_f), (d[..., None] * sc).reshape(out_f, -1), (-dmin[..., None] * mn).reshape(
        out_f, -1)


def _q4_k_values(data: Tensor, out_f: int, in_f: int) -> Tensor:
    """Q4_K super-blocks' 4-bit values, uint8 [out, in] (4 chunks of 64: a chunk's low nibbles, then its high)."""
    qs = data[..., 16:144].reshape(*data.shape[:-1], 4, 32)
    return torch.stack((qs & 0x0F, qs >> 4), dim=-2).reshape(out_f, in_f)


# ------------------------------------------------------------ blocks of 32 for kernels/cpu/quant.cpp
def nibbles(q: Tensor) -> Tensor:
    """uint8 [out, in] in 0..15 -> [out, in/2] in GGML's order (per 32: byte j = q[j] | q[j + 16] << 4)."""
    out_f, in_f = q.shape
    g = q.view(out_f, in_f // GROUP, 2, GROUP // 2)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(out_f, in_f // 2)


def q4_from_blocks(blocks: GGUFBlocks) -> tuple[Tensor, Tensor, Tensor] | None:
    """Q4_0 / Q4_1 / Q4_K -> (nibbles uint8 [out, in/2], d, m float32 [out, in/32]), exact:
    `w = q * d + m` per block of 32; None for other types."""
    out_f, in_f = blocks.shape
    if blocks.type_name == "Q4_K":
        q, scale, minimum = _q4_k(torch.from_numpy(np.array(blocks.data)).view(out_f, in_f // 256, -1), out_f, in_f)
        return nibbles(q), scale, minimum
    if blocks.type_name not in ("Q4_0", "Q4_1"):
        return None
    data = torch.from_numpy(np.array(blocks.data)).view(out_f, in_f // GROUP, -1)  # a writable copy
    d = f16_field(data, 0)
    if blocks.type_name == "Q4_0":  # (q - 8) * d
        return data[..., 2:18].reshape(out_f, in_f // 2).contiguous(), d, -8 * d
    return data[..., 4:20].reshape(out_f, in_f // 2).contiguous(), d, f16_field(data, 2)


def q4_parts(source: Tensor | GGUFBlocks) -> tuple[Tensor, Tensor, Tensor]:
    """Rows of a matrix as (GGML-order nibbles, d, m): exact from Q4_0 / Q4_1 / Q4_K blocks, else
    quantized by min/max per group of 32 (through fp32 for other block types)."""
    parts = q4_from_blocks(source) if isinstance(source, GGUFBlocks) else None
    if parts is None:
        q, scale, zero = quantize_int4(source if isinstance(source, Tensor) else source.dequantize())
        parts = nibbles(q), scale, zero - 8 * scale
    return parts


class Q4Weight(BlockWeight):
    """GGUF-style 4-bit blocks: nibbles [out, in/2] in GGML order, d and m [out, in/32]: w = q * d + m.
    The nibbles are kept in the kernel's layout (cpu_ops.pack_q4: block pairs interleaved); d and m
    float32 (Q4_K's d * scale products and min/max quantization need it)."""

    mode = "int4"
    names = ("qs", "d", "m")
    scale_dtype = torch.float32

    def __init__(self, qs: Tensor, d: Tensor, m: Tensor) -> None:
        self.shape = (qs.shape[0], qs.shape[1] * 2)
        self.qs = cpu_ops.pack_q4(qs)
        self.d, self.m = (cpu_ops.pack_scales(exact_scales(s, self.scale_dtype)) for s in (d, m))

    @classmethod
    def allocate(cls, out_f: int, in_f: int) -> Q4Weight:
        groups, blocks = -(-out_f // ROW_GROUP), in_f // GROUP
        return cls.from_tensors((out_f, in_f), {  # the shapes pack_q4 and pack_scales give
            "qs": cls.advise_huge_pages(torch.empty(out_f, (blocks + blocks % 2) * 16, dtype=torch.uint8)),
            "d": torch.empty(groups, blocks, ROW_GROUP, dtype=cls.scale_dtype),
            "m": torch.empty(groups, blocks, ROW_GROUP, dtype=cls.scale_dtype)})

    def one_pass(self, source: Tensor | GGUFBlocks) -> bool:
        return _repacked(source, ("Q4_0", "Q4_1"))

    def write_rows(self, r0: int, source: Tensor | GGUFBlocks) -> None:
        if _write_q4_blocks(self, r0, source):
            return
        qs, d, m = q4_parts(source)
        g0, groups = r0 // ROW_GROUP, -(-qs.shape[0] // ROW_GROUP)
        self.qs[r0 : r0 + qs.shape[0]] = cpu_ops.pack_q4(qs)
        self.d[g0 : g0 + groups] = cpu_ops.pack_scales(exact_scales(d, self.scale_dtype))
        self.m[g0 : g0 + groups] = cpu_ops.pack_scales(exact_scales(m, self.scale_dtype))

    def _matmul(self, x: Tensor) -> Tensor:
        return cpu_ops.q4_linear(x, self.qs, self.d, self.m)

    def rows(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        return cpu_ops.q4_rows(self.qs, self.d, self.m, ids).to(dtype)

    def nbytes(self) -> int:
        return self.qs.nbytes + self.d.nbytes + self.m.nbytes


class Q4KWeight(BlockWeight):
    """GGUF's Q4_K as the file holds it (quant.cpp's q4k): q4's nibbles, each block of 32's 6-bit scale and
    min (uint8), each super-block of 256's float16 d and dmin: w = (d * sc) * q - dmin * mn, the values
    Q4Weight holds as float32 products, in 4.6 bits a weight (the file's 4.5) rather than 6."""

    mode = "int4"
    names = ("qs", "d", "sc")

    def __init__(self, qs: Tensor, dd: Tensor, sc: Tensor) -> None:
        """qs: GGML-order nibbles [out, in/2]; dd: float16 (d, dmin) [out, in/256, 2]; sc: uint8 (sc, mn)
        [out, in/32, 2]."""
        self.shape = (qs.shape[0], qs.shape[1] * 2)
        self.qs, self.d, self.sc = cpu_ops.pack_q4(qs), *(cpu_ops.pack_sub_scales(t.flatten(1)) for t in (dd, sc))

    @classmethod
    def allocate(cls, out_f: int, in_f: int) -> Q4KWeight:
        groups = -(-out_f // ROW_GROUP)
        return cls.from_tensors((out_f, in_f), {  # the shapes pack_q4 and pack_sub_scales give
            "qs": cls.advise_huge_pages(torch.empty(out_f, in_f // 2, dtype=torch.uint8)),
            "d": torch.empty(groups, in_f // SUPER, 2, ROW_GROUP, dtype=torch.float16),
            "sc": torch.empty(groups, in_f // GROUP, 2, ROW_GROUP, dtype=torch.uint8)})

    def one_pass(self, source: Tensor | GGUFBlocks) -> bool:
        return _repacked(source, ("Q4_K",))

    def write_rows(self, r0: int, source: Tensor | GGUFBlocks) -> None:
        if not isinstance(source, GGUFBlocks) or source.type_name != "Q4_K":
            raise ValueError(f"a Q4_K weight packs Q4_K blocks, not {getattr(source, 'type_name', 'floats')}")
        g0, groups = r0 // ROW_GROUP, -(-source.shape[0] // ROW_GROUP)
        if _repacked(source, ("Q4_K",)):  # one pass from the file's bytes (q4k_parts below makes four)
            n = source.shape[0]
            cpu_repack.q4k(block_view(source, 144), self.qs[r0 : r0 + n], self.d[g0 : g0 + groups],
                           self.sc[g0 : g0 + groups])
            return
        qs, dd, sc = q4k_parts(source)
        self.qs[r0 : r0 + qs.shape[0]] = cpu_ops.pack_q4(qs)
        self.d[g0 : g0 + groups] = cpu_ops.pack_sub_scales(dd.flatten(1))
        self.sc[g0 : g0 + groups] = cpu_ops.pack_sub_scales(sc.flatten(1))

    def _matmul(self, x: Tensor) -> Tensor:
        return cpu_ops.q4k_linear(x, self.qs, self.d, self.sc)

    def rows(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        return cpu_ops.q4k_rows(self.qs, self.d, self.sc, ids).to(dtype)

    def nbytes(self) -> int:
        return self.qs.nbytes + self.d.nbytes + self.sc.nbytes


def q4k_parts(blocks: GGUFBlocks) -> tuple[Tensor, Tensor, Tensor]:
    """Q4_K blocks -> (GGML-order nibbles uint8 [out, in/2], float16 (d, dmin) [out, in/256, 2], uint8
    (sc, mn) [out, in/32, 2]), Q4KWeight's operands, as the file has them."""
    out_f, in_f = blocks.shape
    data = block_view(blocks, 144)
    q = _q4_k_values(data, out_f, in_f)
    sc, mn = k_scale_min(data)  # float32 [out, supers, 8]: 0..63
    dd = data[..., 0:4].contiguous().view(torch.float16)  # [out, supers, 2]: d, dmin
    return nibbles(q), dd, torch.stack((sc, mn), dim=-1).to(torch.uint8).reshape(out_f, -1, 2)


class Q4HalfWeight(Q4Weight):
    """Q4_0 and Q4_1 blocks as the file has them: d and m float16, exactly the file's (Q4_0's m = -8d,
    exact too), so a block streams 20 bytes, not 24."""

    scale_dtype = torch.float16


def _repacked(source: Tensor | GGUFBlocks, types: tuple[str, ...]) -> bool:
    """Whether repack.cpp packs `source`: GGUF blocks of `types`, our kernels loaded."""
    return isinstance(source, GGUFBlocks) and source.type_name in types and cpu_repack.available()


def _write_q4_blocks(weight: Q4Weight, r0: int, source: Tensor | GGUFBlocks) -> bool:
    """Q4_0 / Q4_1 rows in whole groups of 8 (and blocks in pairs) straight from the file's bytes into
    pack_q4's and pack_scales' layouts, one strided copy each (what they do in several passes);
    False where the general path must run."""
    if not isinstance(source, GGUFBlocks) or source.type_name not in ("Q4_0", "Q4_1"):
        return False
    n, blocks = source.shape[0], source.shape[1] // GROUP
    if _repacked(source, ("Q4_0", "Q4_1")):  # any rows and blocks, one pass (the copies below: single bytes)
        g0, groups = r0 // ROW_GROUP, -(-n // ROW_GROUP)
        d, m = weight.d[g0 : g0 + groups], weight.m[g0 : g0 + groups]
        cpu_repack.q4(block_view(source, 18 if source.type_name == "Q4_0" else 20), weight.qs[r0 : r0 + n], d, m)
        if source.type_name == "Q4_0" and bool((m.isinf() & d.isfinite()).any()):  # -8d past float16's range
            largest = 8 * d.float().abs().max().item()  # as exact_scales says it
            raise ValueError(f"block scales do not fit {weight.scale_dtype} exactly (largest {largest:g})")
        return True
    if n % ROW_GROUP or blocks % 2:
        return False
    data = block_view(source, 18 if source.type_name == "Q4_0" else 20)
    g0, groups = r0 // ROW_GROUP, n // ROW_GROUP
    first = 2 if source.type_name == "Q4_0" else 4  # where the nibbles start in a block
    # rows (group, row) and blocks (pair, half) -> the kernel's [group, pair, row, byte, half]
    nib = data[..., first : first + 16].unflatten(1, (blocks // 2, 2)).unflatten(0, (groups, ROW_GROUP))
    weight.qs[r0 : r0 + n].view(groups, blocks // 2, ROW_GROUP, 16, 2).copy_(nib.permute(0, 2, 1, 4, 3))
    d = data[..., 0:2].view(torch.float16)[..., 0]  # the file's float16 (f16_field's values)
    m = exact_scales(-8 * d.float(), weight.scale_dtype) if source.type_name == "Q4_0" else data[..., 2:4].view(
        torch.float16)[..., 0]
    for out, scales in ((weight.d, d), (weight.m, m)):  # [rows, blocks] -> [group, blocks, row]
        out[g0 : g0 + groups].copy_(scales.view(groups, ROW_GROUP, blocks).transpose(1, 2))
    return True


# ------------------------------------------------------------ int4 groups of 32 for torch's kernel
def int4_from_blocks(blocks: GGUFBlocks) -> tuple[Tensor, Tensor, Tensor] | None:
    """Q4_0/Q4_1/Q4_K blocks -> (q uint8 [out, in] in 0..15, scale [out, in/32], zero [out, in/32])
    (float32, exact: `w = (q - 8) * scale + zero`); None for other types."""
    if blocks.type_name not in _INT4_EXACT:
        return None
    out_f, in_f = blocks.shape
    if blocks.type_name == "Q4_K":
        data = torch.from_numpy(np.array(blocks.data)).view(out_f, in_f // 256, -1)
        q, scale, minimum = _q4_k(data, out_f, in_f)
        return q, scale, minimum + 8 * scale
    data = torch.from_numpy(np.array(blocks.data)).view(out_f, in_f // GROUP, -1)  # a writable copy
    d = f16_field(data, 0)
    if blocks.type_name == "Q4_0":
        q, zero = ggml_nibbles(data[..., 2:18]), torch.zeros_like(d)
    else:
        q, zero = ggml_nibbles(data[..., 4:20]), f16_field(data, 2) + 8 * d
    return q.reshape(out_f, in_f), d, zero


def quantize_int4(w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Dense [out, in] -> (q uint8 0..15, scale, zero) per group of 32 by min/max."""
    out_f, in_f = w.shape
    g = w.float().reshape(out_f, in_f // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = (hi - lo) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((g - lo[..., None]) / safe[..., None]).clamp_(0, 15).to(torch.uint8)
    return q.reshape(out_f, in_f), scale, lo + 8 * scale


class Int4Weight(PackedWeight):
    mode = "int4"

    def __init__(self, q: Tensor, scale: Tensor, zero: Tensor, keep_rows: bool = False) -> None:
        """q uint8 [out, in] 0..15, scale/zero float [out, in/32]. keep_rows also keeps q in a plain
        nibble layout for row lookups (an embedding: the kernel's packed layout is opaque)."""
        out_f, in_f = q.shape
        self.shape = (out_f, in_f)
        self.row_nibbles = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous() if keep_rows else None
        pad = -out_f % 16  # the kernel's packing takes rows in multiples of 16: zero rows, sliced off
        if pad:
            q = torch.cat((q, q.new_full((pad, in_f), 8)))
            scale, zero = torch.cat((scale, scale.new_zeros(pad, scale.shape[1]))), torch.cat(
                (zero, zero.new_zeros(pad, zero.shape[1])))
        self.padded_rows = out_f + pad
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        # [in/32, out, 2] as the kernel takes it
        self.scales_zeros = torch.stack((scale.t(), zero.t()), dim=-1).to(COMPUTE_DTYPE).contiguous()

    def linear(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(COMPUTE_DTYPE)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, GROUP, self.scales_zeros)
        if self.padded_rows != self.shape[0]:
            out = out[:, : self.shape[0]]
        out = out.to(x.dtype).reshape(*shape[:-1], self.shape[0])
        return out if bias is None else out + bias

    def rows(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        if self.row_nibbles is None:
            raise RuntimeError("this int4 weight was packed without its rows (not an embedding)")
        nib = self.row_nibbles[ids]
        q = torch.stack((nib & 0x0F, nib >> 4), dim=-1).reshape(*ids.shape, self.shape[1]).float()
        sz = self.scales_zeros[:, ids].float()  # [in/32, *ids, 2]
        scale = sz[..., 0].movedim(0, -1).repeat_interleave(GROUP, dim=-1)
        zero = sz[..., 1].movedim(0, -1).repeat_interleave(GROUP, dim=-1)
        return ((q - 8) * scale + zero).to(dtype)

    def nbytes(self) -> int:
        extra = 0 if self.row_nibbles is None else self.row_nibbles.nbytes
        return self.packed.nbytes + self.scales_zeros.nbytes + extra

    def dequantize(self) -> Tensor:
        """fp32 [out, in] as the kernel sees it (for tests): one identity matmul."""
        eye = torch.eye(self.shape[1], dtype=COMPUTE_DTYPE)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP, self.scales_zeros)
        return out[:, : self.shape[0]].float().t()
