"""Which kernels multiply packed weights on a device (the route), and `pack`: one matrix, GGUF
blocks or dense, made into the operand of that route in the format asked for.

Two packed precisions, "int4" (q4.py) and "int8" (q8.py), each with three routes:

- **Our CPU kernels** (kernels/cpu/quant.cpp, AVX2, built at first use): weights stay in GGUF's own
  blocks of 32, `w = q * d + m` (q4: Q4_0, Q4_1 and Q4_K's sub-blocks exactly) or `w = q * d` (q8:
  Q8_0 exactly; Q5_x, Q6_K and float weights requantized by absmax per block of 32). Activations
  are quantized per block of 32 to int16 and every block dot product runs on integers, as
  llama.cpp does (with int8); the fp32 activations and results stay fp32 around it.
- **Our Triton kernel on CUDA** (kernels/triton/quant.py): the same blocks in GGML's byte order,
  dequantized tile by tile in registers and multiplied in the activations' dtype.
- **torch's weight-only kernels** where ours cannot be built (no compiler, no AVX2: an ARM Mac):
  int4 groups of 32 (`aten._weight_int4pack_mm_for_cpu`; the Q4 types map exactly, only the scales
  round to bf16) and int8 with one scale per row (`aten._weight_int8pack_mm`; Q8_0 requantized per
  row). Both are fast only with bf16 activations, so the input is cast to bf16 around them.

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
from engine.weights.blocks import GGUFBlocks
from engine.weights.packed import GPUBlockWeight, PackedWeight
from engine.weights.q4 import Int4Weight, Q4Weight, int4_from_blocks, q4_parts, quantize_int4
from engine.weights.q8 import Int8Weight, Q8Weight, int8_from_blocks, q8_parts, quantize_int8
from engine.weights.rowpack import pack_rows
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


def pack(source: Tensor | GGUFBlocks, mode: str, keep_rows: bool = False, device: torch.device = CPU,
         ) -> PackedWeight:  # fmt: skip
    """One [out, in] matrix (dense, or GGUF blocks) packed as `mode` ("int4" or "int8") on `device`
    for our kernels, or torch's where ours are unavailable: exact from the block types that map,
    anything else through fp32."""
    if mode not in ("int4", "int8"):
        raise ValueError(f"cannot pack as {mode!r}: int4 or int8")
    where = route(device)
    if where == "torch":
        return _pack_for_torch(source, mode, keep_rows)
    if where == "rosechat":  # by row chunks, into tensors allocated once (rowpack.py)
        return pack_rows(Q4Weight if mode == "int4" else Q8Weight, source)
    if mode == "int4":
        return GPUBlockWeight(*q4_parts(source), device)
    return GPUBlockWeight(*q8_parts(source), None, device)


def _pack_for_torch(source: Tensor | GGUFBlocks, mode: str, keep_rows: bool) -> PackedWeight:
    """torch's forms: exact from Q4_0/Q4_1/Q4_K (int4), per-row requantized from Q8_0 (int8)."""
    if mode == "int4":
        parts = int4_from_blocks(source) if isinstance(source, GGUFBlocks) else None
        if parts is None:
            dense = source.dequantize() if isinstance(source, GGUFBlocks) else source
            parts = quantize_int4(dense)
        return Int4Weight(*parts, keep_rows=keep_rows)
    if mode == "int8":
        parts8 = int8_from_blocks(source) if isinstance(source, GGUFBlocks) else None
        if parts8 is None:
            dense = source.dequantize() if isinstance(source, GGUFBlocks) else source
            parts8 = quantize_int8(dense)
        return Int8Weight(*parts8)


def concat_rows(parts: list[Tensor | GGUFBlocks]) -> Tensor | GGUFBlocks:
    """Stack shards (q, k, v; gate, up) along the output dim: blocks stay blocks when all are one type."""
    if all(isinstance(p, GGUFBlocks) for p in parts) and len({p.type_name for p in parts}) == 1:
        data = np.concatenate([p.data for p in parts], axis=0)
        return GGUFBlocks(data, parts[0].type_name, (data.shape[0], parts[0].shape[1]))
    return torch.cat([p.dequantize() if isinstance(p, GGUFBlocks) else p.float() for p in parts], dim=0)
