"""GGUF blocks as integers, for engine/quant.py to pack.

Two targets. Our CPU kernels (kernels/cpu/quant.cpp) take blocks of 32 as GGUF has them: q4 nibbles
with a scale and a minimum per block (Q4_0, Q4_1 and Q4_K's sub-blocks exactly), q8 with a scale
per block (Q8_0 exactly; Q5_x / Q6_K and float weights requantized per block of 32). torch's own
weight-only kernels (the fallback) take int4 groups of 32 (the Q4 types exactly) and int8 with one
scale per row (Q8_0 requantized per row)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

GROUP = 32  # int4 group size: one GGUF Q4_0/Q4_1/Q8_0 block
_CHUNK_ROWS = 4096  # rows requantized at a time
# GGUF block types that map exactly onto a packed form, by name (gguf.GGMLQuantizationType)
_INT4_EXACT = ("Q4_0", "Q4_1", "Q4_K")
_INT8_NATIVE = ("Q8_0",)


@dataclass
class GGUFBlocks:
    """One quantized GGUF matrix as its raw blocks: `data` uint8 [rows, row bytes], `type_name`
    the GGMLQuantizationType name, `shape` (out, in) as torch's Linear holds it."""

    data: np.ndarray
    type_name: str
    shape: tuple[int, int]

    @property
    def qtype(self) -> Any:
        import gguf

        return gguf.GGMLQuantizationType[self.type_name]

    def dequantize(self) -> Tensor:
        """fp32 [out, in] through gguf's own dequantizer."""
        from gguf import dequantize

        array = np.asarray(dequantize(self.data, self.qtype), dtype=np.float32).reshape(self.shape)
        return torch.from_numpy(array if array.flags.writeable else array.copy())

    def rows(self, index: np.ndarray | slice) -> GGUFBlocks:
        data = self.data[index]
        return GGUFBlocks(data, self.type_name, (data.shape[0], self.shape[1]))


def _f16(data: Tensor, start: int) -> Tensor:
    """fp16 field at byte `start` of every block of `data` [..., blocks, bytes], as float32."""
    return data[..., start : start + 2].contiguous().view(torch.float16)[..., 0].float()


def ggml_nibbles(qs: Tensor) -> Tensor:
    """GGML's 4-bit layout: byte j holds element j (low nibble) and element j + 16 (high)."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _q4_k(data: Tensor, out_f: int, in_f: int) -> tuple[Tensor, Tensor, Tensor]:
    """Q4_K super-blocks (256 weights, 144 bytes: d, dmin, 12 bytes of 6-bit scales and mins for
    8 sub-blocks of 32, 128 bytes of nibbles): sub-block j is `d * sc_j * q - dmin * m_j`.
    Returns (q uint8 [out, in], scale, minimum [out, in/32]): `w = q * scale + minimum`."""
    d, dmin = _f16(data, 0), _f16(data, 2)  # [out, supers]
    sc_bytes = data[..., 4:16].to(torch.int32)
    low, high = sc_bytes[..., 0:4], sc_bytes[..., 4:8]
    extra = sc_bytes[..., 8:12]
    # llama.cpp's get_scale_min_k4: 6-bit scale and min of sub-blocks 0-3, then 4-7
    sc = torch.cat((low & 63, (extra & 0x0F) | ((low >> 6) << 4)), dim=-1).float()
    mn = torch.cat((high & 63, (extra >> 4) | ((high >> 6) << 4)), dim=-1).float()
    qs = data[..., 16:144].reshape(*data.shape[:-1], 4, 32)  # 4 chunks of 64 weights
    q = torch.stack((qs & 0x0F, qs >> 4), dim=-2).reshape(out_f, in_f)  # chunk i: low nibbles, then high
    return q, (d[..., None] * sc).reshape(out_f, -1), (-dmin[..., None] * mn).reshape(out_f, -1)


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
    d = _f16(data, 0)
    if blocks.type_name == "Q4_0":
        q, zero = ggml_nibbles(data[..., 2:18]), torch.zeros_like(d)
    else:
        q, zero = ggml_nibbles(data[..., 4:20]), _f16(data, 2) + 8 * d
    return q.reshape(out_f, in_f), d, zero


def int8_from_blocks(blocks: GGUFBlocks) -> tuple[Tensor, Tensor] | None:
    """Q8_0 blocks -> (int8 [out, in], scale [out]) requantized per row; None for other types."""
    if blocks.type_name not in _INT8_NATIVE:
        return None
    out_f, in_f = blocks.shape
    data = torch.from_numpy(np.array(blocks.data)).view(out_f, in_f // GROUP, -1)  # a writable copy
    d = _f16(data, 0)  # [out, blocks]
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


def quantize_int4(w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Dense [out, in] -> (q uint8 0..15, scale, zero) per group of 32 by min/max."""
    out_f, in_f = w.shape
    g = w.float().reshape(out_f, in_f // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = (hi - lo) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((g - lo[..., None]) / safe[..., None]).clamp_(0, 15).to(torch.uint8)
    return q.reshape(out_f, in_f), scale, lo + 8 * scale


def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """Dense [out, in] -> (int8, scale [out]) by absmax per row."""
    w = w.float()
    scale = w.abs().amax(-1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(w / safe[:, None]).clamp_(-127, 127).to(torch.int8), scale


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
    d = _f16(data, 0)
    if blocks.type_name == "Q4_0":  # (q - 8) * d
        return data[..., 2:18].reshape(out_f, in_f // 2).contiguous(), d, -8 * d
    return data[..., 4:20].reshape(out_f, in_f // 2).contiguous(), d, _f16(data, 2)


def q8_from_blocks(blocks: GGUFBlocks) -> tuple[Tensor, Tensor] | None:
    """Q8_0 -> (int8 [out, in], d float32 [out, in/32]), exact; None for other types."""
    if blocks.type_name not in _INT8_NATIVE:
        return None
    out_f, in_f = blocks.shape
    data = torch.from_numpy(np.array(blocks.data)).view(out_f, in_f // GROUP, -1)
    return data[..., 2:34].reshape(out_f, in_f).contiguous().view(torch.int8), _f16(data, 0)


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
