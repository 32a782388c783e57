"""Packed [out, in] matrices that stand where a dense weight stood (engine/quant.py makes them).

Ours (`Q4Weight`, `Q8Weight`): GGUF's blocks of 32, multiplied by kernels/cpu/quant.cpp. torch's
(`Int4Weight`, `Int8Weight`, the CPU fallback): int4 groups of 32 and int8 per row, multiplied by
`aten._weight_int4pack_mm_for_cpu` / `aten._weight_int8pack_mm` with bf16 activations. On CUDA
(`GPUBlockWeight`): the same blocks of 32 in GGML's byte order, multiplied by kernels/triton/quant.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

import kernels
from engine.quant_blocks import GROUP, ggml_nibbles
from kernels.cpu import ops as cpu_ops

COMPUTE_DTYPE = torch.bfloat16  # the activations torch's weight-only CPU kernels are fast with


class PackedWeight:
    """A packed [out, in] matrix standing where a dense weight stood: `linear(x, weight)` in
    engine.models.layers calls `weight.linear(x, bias)`, and an embedding calls `rows(ids)`."""

    mode: str
    shape: tuple[int, int]

    def linear(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        raise NotImplementedError

    def rows(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        raise NotImplementedError

    def nbytes(self) -> int:
        raise NotImplementedError

    # a few tensor-like attributes callers read
    @property
    def dtype(self) -> torch.dtype:
        return COMPUTE_DTYPE

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]


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


def block_rows(q: Tensor, d: Tensor, m: Tensor | None) -> Tensor:
    """fp32 rows of GGML-order blocks of 32: q4 bytes [..., K/2] (byte j of a block: element j low,
    j + 16 high; w = q * d + m) or q8 int8 [..., K] (w = q * d, m None); d, m [..., K/32]."""
    if m is None:
        return (q.view(*q.shape[:-1], -1, GROUP).float() * d[..., None]).flatten(-2)
    w = ggml_nibbles(q.view(*q.shape[:-1], -1, GROUP // 2)).float()
    return (w * d[..., None] + m[..., None]).flatten(-2)


class BlockWeight(PackedWeight):
    """Blocks of 32 multiplied by kernels/cpu/quant.cpp: float32 in and out, whatever the model's dtype."""

    dtype = torch.float32

    def _matmul(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def linear(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        if bias is None and x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous():
            return self._matmul(x)  # a decode step's usual case, without the reshapes
        out = self._matmul(x.reshape(-1, x.shape[-1]).to(torch.float32).contiguous())
        out = out.to(x.dtype).reshape(*x.shape[:-1], self.shape[0])
        return out if bias is None else out + bias

    def dequantize(self) -> Tensor:
        return self.rows(torch.arange(self.shape[0]), torch.float32)


class Q4Weight(BlockWeight):
    """GGUF-style 4-bit blocks: nibbles [out, in/2] in GGML order, d and m [out, in/32]: w = q * d + m.
    The nibbles are kept in the kernel's layout (cpu_ops.pack_q4: block pairs interleaved)."""

    mode = "int4"

    def __init__(self, qs: Tensor, d: Tensor, m: Tensor) -> None:
        self.shape = (qs.shape[0], qs.shape[1] * 2)
        self.qs, self.d, self.m = cpu_ops.pack_q4(qs), cpu_ops.pack_scales(d), cpu_ops.pack_scales(m)

    def _matmul(self, x: Tensor) -> Tensor:
        return cpu_ops.q4_linear(x, self.qs, self.d, self.m)

    def rows(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        return cpu_ops.q4_rows(self.qs, self.d, self.m, ids).to(dtype)

    def nbytes(self) -> int:
        return self.qs.nbytes + self.d.nbytes + self.m.nbytes


class Q8Weight(BlockWeight):
    """8-bit blocks of 32: int8 [out, in], d [out, in/32]: w = q * d. Kept in the kernel's order
    (cpu_ops.pack_q8: each block's halves interleaved)."""

    mode = "int8"

    def __init__(self, qs: Tensor, d: Tensor) -> None:
        self.shape = tuple(qs.shape)
        self.qs, self.d = cpu_ops.pack_q8(qs), cpu_ops.pack_scales(d)

    def _matmul(self, x: Tensor) -> Tensor:
        return cpu_ops.q8_linear(x, self.qs, self.d)

    def rows(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        return cpu_ops.q8_rows(self.qs, self.d, ids).to(dtype)

    def nbytes(self) -> int:
        return self.qs.nbytes + self.d.nbytes


class GPUBlockWeight(PackedWeight):
    """Blocks of 32 on a GPU, multiplied by the Triton kernel (kernels.block_linear) in the
    activations' dtype: int4 nibbles uint8 [out, in/2] in GGML order with w = q * d + m, or int8
    [out, in] with w = q * d; d and m float32 [out, in/32] (exact for every Q4/Q8 block type)."""

    def __init__(self, qs: Tensor, d: Tensor, m: Tensor | None, device: torch.device) -> None:
        self.mode = "int8" if m is None else "int4"
        self.shape = (qs.shape[0], qs.shape[1] * (1 if m is None else 2))
        self.qs = qs.contiguous().to(device)
        self.d = d.float().contiguous().to(device)
        self.m = None if m is None else m.float().contiguous().to(device)

    @property
    def dtype(self) -> torch.dtype:
        return self.d.dtype

    @property
    def device(self) -> torch.device:
        return self.qs.device

    def linear(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        out = kernels.block_linear(x.reshape(-1, x.shape[-1]), self.qs, self.d, self.m)
        out = out.reshape(*x.shape[:-1], self.shape[0])
        return out if bias is None else out + bias

    def rows(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        return block_rows(self.qs[ids], self.d[ids], None if self.m is None else self.m[ids]).to(dtype)

    def nbytes(self) -> int:
        return self.qs.nbytes + self.d.nbytes + (0 if self.m is None else self.m.nbytes)

    def dequantize(self) -> Tensor:
        return self.rows(torch.arange(self.shape[0], device=self.qs.device), torch.float32)
