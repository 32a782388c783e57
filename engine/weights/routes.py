"""Which kernels multiply packed weights on a device (the route), and `pack`: one matrix, GGUF
blocks or dense, made into the operand of that route in the format asked for.

Two packed precisions, "int4" (q4.py) and "int8" (q5.py, q6.py, q8.py), each with three routes:

- **Our CPU kernels** (kernels/cpu/quant.cpp and quant_k.cpp, AVX2 / AVX-512, built at setup or first
  use): every GGUF block type with a kernel is multiplied from its own values, exactly: int4 `w = q * d
  + m` per block of 32 (Q4_0, Q4_1, Q4_K's sub-blocks); int8 q8 `w = q * d` (Q8_0, Q5_0), q8m
  `w = q * d + m` (Q5_1, Q5_K), q6k `w = (d * sc) * q` per 16 with 6-bit q (Q6_K; with m, any mix of
  K-quant shards).
  Float weights are quantized (int8: by absmax per block of 32). Activations are quantized per block
  of 32 to int16 and every block dot product runs on integers, as llama.cpp does (with int8); the
  fp32 activations and results stay fp32 around it.
- **Our Triton kernel on CUDA** (kernels/triton/quant.py): Q4_x and Q8_0 blocks in GGML's byte order,
  dequantized tile by tile in registers and multiplied in the activations' dtype; Q5_x and Q6_K
  requantized to its q8 blocks by absmax per 32 (no exact kernel there yet).
- **torch's weight-only kernels** where ours cannot be built (no compiler, no AVX2: an ARM Mac):
  int4 groups of 32 (`aten._weight_int4pack_mm_for_cpu`; the Q4 types map exactly, only the scales
  round to bf16) and int8 with one scale per row (`aten._weight_int8pack_mm`; Q8_0, Q5_x and Q6_K
  requantized per row: no exact form). Both are fast only with bf16 activations, so the input is cast
  to bf16 around them.

Any other tensor (F32/F16/BF16, or a safetensors weight) is dequantized (or taken as is) and
quantized to the requested form: int4 by min/max per group of 32, int8 by absmax per block or row.
Raw block bytes come from the `gguf` package's reader (`ReaderTensor.data`); `gguf.dequantize` is
only the fallback for types with no exact mapping (and the reference in tests).
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import Tensor

import kernels
from engine.weights.blocks import BlockShards, GGUFBlocks
from engine.weights.packed import ROW_GROUP, BlockWeight, GPUBlockWeight, PackedWeight
from engine.weights.q4 import Int4Weight, Q4Weight, int4_from_blocks, q4_parts, quantize_int4
from engine.weights.q5 import Q8MWeight, q5_0_from_blocks, q8m_from_blocks, q8m_from_shards
from engine.weights.q6 import Q6Weight, q6_from_shards
from engine.weights.q8 import (
    Int8Weight,
    Q8HalfWeight,
    Q8Weight,
    int8_from_blocks,
    q8_from_blocks,
    q8_parts,
    quantize_int8,
)
from engine.weights.rowpack import fill_rows, pack_rows, source_type, streamed_class
from kernels.cpu import ops as cpu_ops

CPU = torch.device("cpu")


def torch_kernels_available() -> bool:
    ops = torch.ops.aten
    return all(hasattr(ops, op) for op in
               ("_weight_int8pack_mm", "_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu"))


def kernels_available(device: torch.device = CPU) -> bool:
    """Some route for packed weights on `device`: on CUDA our Triton kernel (compiled there), on the
    CPU ours or torch's as the fallback."""
    if route(device) == "triton":
        return kernels.triton_status() in ("compiled", "interpreted")
    return cpu_ops.available() or torch_kernels_available()


def route(device: torch.device = CPU) -> str:
    """Which kernels packed weights use on `device`: "triton" (kernels/triton/quant.py) on CUDA; on
    the CPU "rosechat" (kernels/cpu/quant.cpp) where it builds, else "torch".
    ROSECHAT_QUANT_KERNELS=torch picks torch's on the CPU (to compare), =triton the Triton kernel
    (tests run it on the CPU under TRITON_INTERPRET)."""
    forced = os.environ.get("ROSECHAT_QUANT_KERNELS")
    if device.type == "cuda" or forced == "triton":
        return "triton"
    if forced == "torch" or not cpu_ops.available():
        return "torch"
    return "rosechat"


Source = Tensor | GGUFBlocks | BlockShards  # a dense matrix, or GGUF blocks (of one type, or row shards of several)


def _dense(source: Source) -> Tensor:
    return source if isinstance(source, Tensor) else source.dequantize()


def pack(source: Source, mode: str, keep_rows: bool = False, device: torch.device = CPU) -> PackedWeight:
    """One [out, in] matrix (dense, or GGUF blocks) packed as `mode` ("int4" or "int8") on `device`
    for our kernels, or torch's where ours are unavailable: exact from the block types that map,
    anything else through fp32."""
    if mode not in ("int4", "int8"):
        raise ValueError(f"cannot pack as {mode!r}: int4 or int8")
    where = route(device)
    if where == "torch":
        return _pack_for_torch(source, mode, keep_rows)
    q8_0 = isinstance(source, GGUFBlocks) and source.type_name == "Q8_0"  # streamed as q8 below
    if where == "rosechat" and mode == "int8" and not q8_0 and (exact := exact_int8(source)) is not None:
        return exact
    if isinstance(source, BlockShards):  # mixed types with no exact form: through fp32
        source = source.dequantize()
    if where == "rosechat":  # by row chunks, into tensors allocated once (rowpack.py)
        return pack_rows(streamed_class(mode, [source_type(source)]) or (Q4Weight if mode == "int4" else Q8Weight),
                         source)
    if mode == "int4":
        return GPUBlockWeight(*q4_parts(source), device)
    return GPUBlockWeight(*q8_parts(source), None, device)


def exact_int8(source: Source) -> BlockWeight | None:
    """Our CPU kernels' exact 8-bit form of GGUF blocks: Q8_0 and Q5_0 as q8, Q6_K as q6k, Q5_1, Q5_K
    (and Q4 types asked for as int8) as q8m; shards of mixed types as q8m or q6k where one holds them
    all (Q4_K q, k and Q6_K v: q6k). None for anything else (float, the types without a kernel)."""
    if isinstance(source, GGUFBlocks):
        if (plain := q8_from_blocks(source) or q5_0_from_blocks(source)) is not None:
            return Q8HalfWeight(*plain)  # both keep the file's float16 scales
        if source.type_name == "Q6_K":  # in one pass from the file's bytes (Q6Weight.write_rows)
            return pack_rows(Q6Weight, source)
        parts = q8m_from_blocks(source)
        return None if parts is None else Q8MWeight(*parts)
    if isinstance(source, BlockShards):
        if (parts := q8m_from_shards(source)) is not None:
            return Q8MWeight(*parts)
        if (streamed := _streamed_shards(source)) is not None:
            return streamed
        if (k_parts := q6_from_shards(source)) is not None:
            return Q6Weight.of(*k_parts)
    return None


def _streamed_shards(shards: BlockShards) -> BlockWeight | None:
    """Shards of one streamed class (rowpack.streamed_class: Q6_K beside Q4_K rows) packed into their row
    ranges, each in one pass; None where a shard does not start a row group (then q6_from_shards stacks them)."""
    cls = streamed_class("int8", [p.type_name for p in shards.parts])
    starts = np.cumsum([0] + [p.shape[0] for p in shards.parts[:-1]])
    if cls is None or any(int(r0) % ROW_GROUP for r0 in starts):
        return None
    weight = cls.allocate(*shards.shape)
    for r0, part in zip(starts, shards.parts, strict=True):
        fill_rows(weight, int(r0), part)
    return weight


def _pack_for_torch(source: Source, mode: str, keep_rows: bool) -> PackedWeight:
    """torch's forms: exact from Q4_0/Q4_1/Q4_K (int4), per-row requantized from Q8_0 (int8); any other
    type (Q5_x, Q6_K: no exact form in torch's kernels) through fp32, as for a float weight."""
    if mode == "int4":
        parts = int4_from_blocks(source) if isinstance(source, GGUFBlocks) else None
        return Int4Weight(*(parts or quantize_int4(_dense(source))), keep_rows=keep_rows)
    parts8 = int8_from_blocks(source) if isinstance(source, GGUFBlocks) else None
    return Int8Weight(*(parts8 or quantize_int8(_dense(source))))


def concat_rows(parts: list[Tensor | GGUFBlocks]) -> Source:
    """Stack shards (q, k, v; gate, up) along the output dim: blocks stay blocks when all are one type,
    and shards of mixed types when all are blocks (pack finds one exact form for them, or dequantizes)."""
    if all(isinstance(p, GGUFBlocks) for p in parts):
        if len({p.type_name for p in parts}) > 1:
            return BlockShards(parts)
        data = np.concatenate([p.data for p in parts], axis=0)
        return GGUFBlocks(data, parts[0].type_name, (data.shape[0], parts[0].shape[1]))
    return torch.cat([p.dequantize() if isinstance(p, GGUFBlocks) else p.float() for p in parts], dim=0)
