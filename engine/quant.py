"""Packed quantized weights: GGUF blocks repacked once at load and multiplied as they are.

Two packed precisions, "int4" and "int8", each with three routes:

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
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

import kernels
from engine.defaults import QUANTIZATIONS
from engine.packed_weights import GPUBlockWeight, Int4Weight, Int8Weight, PackedWeight, Q4Weight, Q8Weight
from engine.quant_blocks import (  # noqa: F401  (re-exported: the packing API lives here)
    GROUP,
    GGUFBlocks,
    int4_from_blocks,
    int8_from_blocks,
    nibbles,
    q4_from_blocks,
    q8_from_blocks,
    quantize_int4,
    quantize_int8,
    quantize_q8,
)
from kernels.cpu import ops as cpu_ops

MODES = QUANTIZATIONS  # what load_model accepts (engine/defaults.py resolves "auto")
CPU = torch.device("cpu")

# the precision class a file's tensor keeps under quantization="auto"
_AUTO_CLASS = {"Q4_0": "int4", "Q4_1": "int4", "Q4_K": "int4", "Q5_0": "int8", "Q5_1": "int8",
               "Q5_K": "int8", "Q6_K": "int8", "Q8_0": "int8"}


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


def auto_mode(type_name: str) -> str:
    """The packed form a GGUF tensor type keeps under quantization="auto" ("none" for float types)."""
    return _AUTO_CLASS.get(type_name, "none")


def _dense(source: Tensor | GGUFBlocks) -> Tensor:
    return source.dequantize() if isinstance(source, GGUFBlocks) else source


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
    blocks = source if isinstance(source, GGUFBlocks) else None
    if mode == "int4":
        parts = q4_from_blocks(blocks) if blocks else None
        if parts is None:
            q, scale, zero = quantize_int4(_dense(source))
            parts = nibbles(q), scale, zero - 8 * scale
        return Q4Weight(*parts) if where == "rosechat" else GPUBlockWeight(*parts, device)
    qs, d = (q8_from_blocks(blocks) if blocks else None) or quantize_q8(_dense(source))
    return Q8Weight(qs, d) if where == "rosechat" else GPUBlockWeight(qs, d, None, device)


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


# ---------------------------------------------------------------------------------- modules
class PackedLinear(nn.Module):
    """A Linear (or MergedLinear) whose weight is packed. Shards arrive one by one at load
    (`load_shard`); `finish()` packs them once, after which only the packed form is kept."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: Tensor | None, mode: str,
                 device: torch.device = CPU) -> None:  # fmt: skip
        super().__init__()
        self.device = device  # where finish() puts the packed weight
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.out_features = sum(output_sizes)
        self.mode = mode
        self.bias = bias  # a Parameter moved over from the dense module (or None)
        self.weight: PackedWeight | None = None
        self._shards: dict[int, Tensor | GGUFBlocks] = {}

    def shard_rows(self, shard: int) -> tuple[int, int]:
        return sum(self.output_sizes[:shard]), self.output_sizes[shard]

    def load_shard(self, shard: int | None, source: Tensor | GGUFBlocks) -> None:
        index = 0 if shard is None else shard
        rows = self.output_sizes[index] if shard is not None else self.out_features
        if tuple(source.shape) != (rows, self.in_features):
            raise ValueError(f"has shape {tuple(source.shape)}, expected {(rows, self.in_features)}")
        self._shards[index] = source.detach().clone() if isinstance(source, Tensor) else source

    def missing_shards(self) -> list[int]:
        if self.weight is not None:
            return []
        count = len(self.output_sizes) if len(self.output_sizes) > 1 else 1
        return [i for i in range(count) if i not in self._shards]

    def finish(self, keep_rows: bool = False) -> None:
        if self.weight is None:
            parts = [self._shards[i] for i in sorted(self._shards)]
            self.weight = pack(parts[0] if len(parts) == 1 else concat_rows(parts), self.mode, keep_rows, self.device)
            self._shards = {}

    def forward(self, x: Tensor) -> Tensor:
        return self.weight.linear(x, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}"


class PackedEmbedding(nn.Module):
    """An embedding table kept packed: lookups dequantize only the rows asked for; a tied head
    multiplies by the same packed weight (`linear(hidden, embed.weight)`)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, mode: str, dtype: torch.dtype,
                 device: torch.device = CPU) -> None:  # fmt: skip
        super().__init__()
        self.device = device
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.mode = mode
        self.out_dtype = dtype
        self.weight: PackedWeight | None = None
        self._source: Tensor | GGUFBlocks | None = None

    def load_shard(self, shard: int | None, source: Tensor | GGUFBlocks) -> None:
        if tuple(source.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"has shape {tuple(source.shape)}, expected {(self.num_embeddings, self.embedding_dim)}")
        self._source = source.detach().clone() if isinstance(source, Tensor) else source

    def missing_shards(self) -> list[int]:
        return [0] if self.weight is None and self._source is None else []

    def finish(self, keep_rows: bool = True) -> None:
        if self.weight is None:
            self.weight = pack(self._source, self.mode, keep_rows=True, device=self.device)
            self._source = None

    def forward(self, ids: Tensor) -> Tensor:
        return self.weight.rows(ids, self.out_dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, mode={self.mode}"


def packed_modules(model: nn.Module) -> dict[str, PackedLinear | PackedEmbedding]:
    return {name: m for name, m in model.named_modules() if isinstance(m, (PackedLinear, PackedEmbedding))}


def swap_in_packed(model: nn.Module, modes: dict[str, str], dtype: torch.dtype, device: torch.device = CPU) -> None:
    """Replace the Linear / MergedLinear / Embedding modules named in `modes` (module name ->
    "int4" | "int8") by packed ones for `device`, before any weight is allocated (the model is on meta)."""
    from engine.models.layers import MergedLinear

    for name, mode in modes.items():
        if mode not in ("int4", "int8"):
            continue
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, leaf)
        if isinstance(old, nn.Embedding):
            new: nn.Module = PackedEmbedding(old.num_embeddings, old.embedding_dim, mode, dtype, device)
        elif isinstance(old, nn.Linear):
            if old.in_features % GROUP:
                continue  # groups of 32 do not fit: stays dense
            sizes = old.output_sizes if isinstance(old, MergedLinear) else [old.out_features]
            new = PackedLinear(old.in_features, sizes, old.bias, mode, device)
        else:
            raise TypeError(f"{name} is a {type(old).__name__}: only linear layers and embeddings can be packed")
        setattr(parent, leaf, new)


def packable_modules(model: nn.Module) -> list[str]:
    """The module names a packed load may replace: every linear layer and the token embedding(s)
    of a tied model (the head multiplies by it); position embeddings stay dense."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module.in_features % GROUP == 0:
            names.append(name)
        elif isinstance(module, nn.Embedding) and name.endswith(("embed_tokens", "wte")):
            if module.embedding_dim % GROUP == 0:
                names.append(name)
    return names


def release_freed_memory() -> None:
    """Hand memory freed during packing (the int32 and fp32 temporaries) back to the OS: glibc
    keeps freed heap pages otherwise, and they count as resident."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # not glibc
        pass


def drop_mapped_pages(array: Any, start: int = 0, length: int | None = None) -> None:
    """Let the OS drop the pages of a memory-mapped file read during loading (gguf's reader maps
    the whole file), all of them or the bytes [start, start + length) of the mapping: they are clean
    and count as resident until dropped; a later read faults them back in from the file (the map
    is read-only: nothing written is lost)."""
    import mmap

    mapping = getattr(array, "_mmap", None)
    if mapping is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    first = start - start % mmap.PAGESIZE  # madvise takes whole pages: the neighbours' may go too
    end = len(mapping) if length is None else min(len(mapping), start + length)
    if end <= first:
        return
    try:
        mapping.madvise(mmap.MADV_DONTNEED, first, end - first)
    except (OSError, ValueError):
        pass


def packed_bytes(model: nn.Module) -> int:
    return sum(m.weight.nbytes() for m in packed_modules(model).values() if m.weight is not None)


def matmul_weight_cost(model: nn.Module, vocab_size: int, itemsize: int) -> tuple[int, int]:
    """(params, bytes) of the weights one decode token multiplies: every linear and, when the head is
    tied, the embedding matrix; packed weights stream their packed bytes, dense ones `itemsize` each."""
    weights = [m.weight for m in model.modules() if isinstance(m, nn.Linear | PackedLinear)]
    if getattr(model, "lm_head", None) is None:
        weights.append(next(m.weight for m in model.modules()
                            if isinstance(m, nn.Embedding | PackedEmbedding) and m.weight.shape[0] == vocab_size))
    packed = [w for w in weights if isinstance(w, PackedWeight)]
    dense = [w for w in weights if not isinstance(w, PackedWeight)]
    params = sum(w.numel() for w in weights)
    return params, sum(w.nbytes() for w in packed) + sum(w.numel() for w in dense) * itemsize


__all__ = [
    "GGUFBlocks",
    "GPUBlockWeight",
    "Int4Weight",
    "Int8Weight",
    "MODES",
    "PackedEmbedding",
    "PackedLinear",
    "PackedWeight",
    "Q4Weight",
    "Q8Weight",
    "auto_mode",
    "kernels_available",
    "matmul_weight_cost",
    "pack",
    "packable_modules",
    "packed_bytes",
    "packed_modules",
    "quantize_int4",
    "quantize_int8",
    "quantize_q8",
    "route",
    "swap_in_packed",
]
