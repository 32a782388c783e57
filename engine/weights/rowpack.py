"""Packing straight into the final layout: a packed weight's tensors are allocated once, at their
final size, and each checkpoint shard is packed into its own row range as it arrives, a few
thousand rows at a time. No shard is staged, concatenated or copied whole, so a load holds the packed
model plus one chunk's temporaries (issue 28).

The CPU kernels' layouts (kernels/cpu/ops.py) keep rows in groups of 8 (`ROW_GROUP`) and nothing
crosses a group, so rows packed in aligned ranges give the very bytes the whole matrix packed at
once gives (tests/engine/test_rowpack.py checks it).

A format streams when it is registered here for (mode, GGUF type name or "dense"): its class
(a packed.BlockWeight) implements `allocate(out_f, in_f)` and `write_rows(r0, source_rows)`. Any
other source (a type only routes.pack knows, shards of mixed types, torch's or the GPU's route) is
staged and packed whole by routes.pack, as before.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from engine.weights.blocks import GGUFBlocks
from engine.weights.packed import ROW_GROUP, BlockWeight
from engine.weights.q4 import Q4HalfWeight, Q4KWeight, Q4Weight
from engine.weights.q6 import K_EXACT, Q6MWeight, Q6Weight
from engine.weights.q8 import Q8HalfWeight, Q8Weight

CHUNK_ROWS = 1024  # rows converted at a time (a multiple of ROW_GROUP): temporaries of a few MiB
MAPPED_CHUNK_BYTES = 32 << 20  # the file's bytes a one-pass repack takes at a time (its pages then dropped)
DENSE = "dense"  # a float source: a dense tensor (safetensors, or a GGUF F32/F16/BF16 tensor)
FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})

# (mode, source type) -> the class packed into by row ranges, on our CPU kernels' route
STREAMED: dict[tuple[str, str], type[BlockWeight]] = {
    # the file's scales kept as they are (float16; Q4_K's 6-bit ones too); quantized floats' are float32
    ("int4", "Q4_0"): Q4HalfWeight, ("int4", "Q4_1"): Q4HalfWeight, ("int4", "Q4_K"): Q4KWeight,
    ("int4", DENSE): Q4Weight, ("int8", "Q8_0"): Q8HalfWeight, ("int8", DENSE): Q8Weight,
    ("int8", "Q6_K"): Q6Weight,
}


def source_type(source: Tensor | GGUFBlocks | str | None) -> str:
    """A source's key in STREAMED: its GGUF block type, or DENSE (a tensor or a float GGUF type)."""
    if isinstance(source, GGUFBlocks):
        return source.type_name
    if isinstance(source, str):
        return DENSE if source in FLOAT_TYPES else source
    return DENSE


def streamed_class(mode: str, types: list[str]) -> type[BlockWeight] | None:
    """The class a module of shards of `types` packs into by rows, None if it must be packed whole
    (routes.pack: one exact form for mixed shards, or through fp32). Q6_K beside Q4_K / Q5_K shards (Q4_K_M's
    merged qkv) streams too, into q6k with offsets: the form routes.exact_int8 picks for them."""
    kinds = set(types)
    if mode == "int8" and "Q6_K" in kinds and kinds <= set(K_EXACT):
        return Q6Weight if kinds == {"Q6_K"} else Q6MWeight
    if len(kinds) != 1:
        return None
    return STREAMED.get((mode, types[0]))


def row_chunks(rows: int, chunk: int = CHUNK_ROWS) -> Iterator[tuple[int, int]]:
    for start in range(0, rows, chunk):
        yield start, min(rows, start + chunk)


def fill_rows(weight: BlockWeight, r0: int, source: Tensor | GGUFBlocks) -> None:
    """Pack `source` (rows r0.. of the weight's matrix; r0 a multiple of ROW_GROUP) into place, chunk by chunk.
    A one-pass repack of a memory-mapped tensor goes by chunks of about MAPPED_CHUNK_BYTES of the file, each
    mapped in before and dropped after, so the file's pages of one chunk, not of the whole tensor, are
    resident beside the packed weight."""
    if r0 % ROW_GROUP:
        raise ValueError(f"rows from {r0} do not start a group of {ROW_GROUP}")
    pages = source.pages if isinstance(source, GGUFBlocks) else None
    with torch.no_grad():
        rows = int(source.shape[0])
        chunk = CHUNK_ROWS
        if weight.one_pass(source):
            row_bytes = max(int(source.data.shape[1]), 1)
            chunk = max(rows, 1) if pages is None else max(ROW_GROUP, MAPPED_CHUNK_BYTES // row_bytes // ROW_GROUP
                                                           * ROW_GROUP)
        for start, end in row_chunks(rows, chunk):
            if pages is not None:
                pages.populate(start, end)
            part = source.rows(slice(start, end)) if isinstance(source, GGUFBlocks) else source[start:end]
            weight.write_rows(r0 + start, part)
            if pages is not None:
                pages.drop(start, end)


def pack_rows(cls: type[BlockWeight], source: Tensor | GGUFBlocks) -> BlockWeight:
    """One whole matrix packed as `cls` by row chunks."""
    weight = cls.allocate(int(source.shape[0]), int(source.shape[1]))
    fill_rows(weight, 0, source)
    return weight


__all__ = ["CHUNK_ROWS", "DENSE", "MAPPED_CHUNK_BYTES", "STREAMED", "fill_rows", "pack_rows", "row_chunks",
           "source_type", "streamed_class"]
