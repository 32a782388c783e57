"""A load's repack (kernels/cpu/repack.cpp): GGUF blocks written straight into the kernels' layouts give the
very bytes the torch packing functions give (ops.pack_q4, pack_q8, pack_scales, pack_sub_scales through each
format's constructor), so the weight cache's layout is unchanged: every block type it handles, a last group
of fewer than 8 rows, an odd number of blocks, one thread and two."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.weights.blocks import GGUFBlocks
from engine.weights.q4 import Q4HalfWeight, Q4KWeight, Q4Weight, q4_from_blocks, q4k_parts
from engine.weights.q6 import Q6MWeight, Q6Weight, q6_from_blocks
from engine.weights.q8 import Q8HalfWeight, Q8Weight, q8_from_blocks
from engine.weights.rowpack import pack_rows
from kernels.cpu import ops as cpu_ops
from kernels.cpu import repack as cpu_repack

pytestmark = pytest.mark.skipif(not cpu_ops.supported_cpu(), reason="the kernels need an x86 CPU with AVX2")

_LAYOUT = {"Q4_0": (32, 18, (0,)), "Q4_1": (32, 20, (0, 2)), "Q8_0": (32, 34, (0,)), "Q4_K": (256, 144, (0, 2)),
           "Q5_K": (256, 176, (0, 2)), "Q6_K": (256, 210, (208,))}


@pytest.fixture(autouse=True, scope="module")
def built() -> None:
    assert cpu_ops.available(), cpu_ops.unavailable_reason()


def _blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> GGUFBlocks:
    """Random bytes, with finite float16 scales (and minimums) where the type keeps them."""
    weights, size, scale_at = _LAYOUT[type_name]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows, cols // weights, size), dtype=np.uint8)
    for at in scale_at:
        values = (rng.standard_normal((rows, cols // weights)) * 1e-2).astype(np.float16)
        data[..., at : at + 2] = values.view(np.uint8).reshape(rows, cols // weights, 2)
    return GGUFBlocks(data.reshape(rows, -1), type_name, (rows, cols))


def _reference(cls: type, source: GGUFBlocks):
    if cls is Q4KWeight:
        return Q4KWeight(*q4k_parts(source))
    if cls in (Q6Weight, Q6MWeight):  # Q6_K, or Q4_K / Q5_K rows with offsets
        q, d, sc, m = q6_from_blocks(source)
        return cls(q, d, sc, torch.zeros(q.shape[0], q.shape[1] // 32) if m is None and cls is Q6MWeight else m)
    return cls(*(q4_from_blocks(source) if source.type_name.startswith("Q4") else q8_from_blocks(source)))


CASES = [(Q4HalfWeight, "Q4_0"), (Q4HalfWeight, "Q4_1"), (Q4Weight, "Q4_0"), (Q4Weight, "Q4_1"),
         (Q8HalfWeight, "Q8_0"), (Q8Weight, "Q8_0"), (Q4KWeight, "Q4_K"), (Q6Weight, "Q6_K"), (Q6MWeight, "Q6_K"),
         (Q6MWeight, "Q4_K"), (Q6MWeight, "Q5_K")]


SHAPES = [(64, 512), (2056 + 3, 256), (5, 256), (24, 96)]  # 96: 3 blocks of 32 (no K-quant row is that wide)


@pytest.mark.parametrize("cls, type_name, rows, cols", [(c, t, r, k) for c, t in CASES for r, k in SHAPES
                                                        if k % _LAYOUT[t][0] == 0])
@pytest.mark.parametrize("threads", [1, 2])
def test_repack_gives_the_torch_packing_bytes(cls: type, type_name: str, rows: int, cols: int, threads: int) -> None:
    source = _blocks(type_name, rows, cols, seed=rows + cols)
    torch.set_num_threads(threads)
    got, want = pack_rows(cls, source), _reference(cls, source)
    for name, tensor in want.tensors().items():
        mine = got.tensors()[name]
        assert mine.dtype == tensor.dtype and mine.shape == tensor.shape, name
        assert torch.equal(mine.view(torch.uint8), tensor.view(torch.uint8)), name  # bytes: -0.0 and NaN too


def test_the_torch_copies_give_the_same_bytes(monkeypatch) -> None:
    """Where the ops are not there (no kernels), each format's own strided copies pack the same bytes."""
    cases = [(cls, _blocks(t, 64, 512, seed=i)) for i, (cls, t) in enumerate(CASES)]
    fast = [pack_rows(cls, source) for cls, source in cases]
    monkeypatch.setattr(cpu_repack, "available", lambda: False)
    for (cls, source), got in zip(cases, fast):
        slow = pack_rows(cls, source)
        assert all(torch.equal(t, slow.tensors()[k]) for k, t in got.tensors().items()), cls


def test_q4_0_offsets_past_float16_are_refused() -> None:
    """-8d overflows float16 where |d| > 8191.875: refused as the torch path refuses it, not stored as inf."""
    source = _blocks("Q4_0", 8, 64)
    source.data[3, 0:2] = np.frombuffer(np.float16(9000.0).tobytes(), np.uint8)
    with pytest.raises(ValueError, match="do not fit"):
        pack_rows(Q4HalfWeight, source)
    assert torch.equal(pack_rows(Q4Weight, source).tensors()["m"], _reference(Q4Weight, source).m)  # float32 holds it


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K"])
def test_q6k_repack_reads_back_as_gguf_dequantizes(type_name: str) -> None:
    """q6k (and its offsets, for Q4_K / Q5_K rows) repacked in one pass holds the gguf package's values,
    bit for bit; a last group of 3 rows."""
    source = _blocks(type_name, 19, 512, seed=7)
    packed = pack_rows(Q6Weight if type_name == "Q6_K" else Q6MWeight, source)
    assert torch.equal(packed.dequantize(), source.dequantize())


def test_q4_k_rows_need_offsets() -> None:
    with pytest.raises(ValueError, match="need offsets"):
        pack_rows(Q6Weight, _blocks("Q4_K", 8, 256))


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q6_K", "Q5_K"), ("Q6_K", "Q6_K")])
def test_mixed_k_shards_stream_into_one_q6k_weight(types: tuple[str, ...]) -> None:
    """Q4_K_M's merged qkv (Q4_K q, k, Q6_K v): each shard repacked into its rows gives the bytes of the shards
    stacked and packed whole (q6_from_shards); a last shard of 5 rows."""
    from engine.weights.blocks import BlockShards
    from engine.weights.q6 import q6_from_shards
    from engine.weights.routes import concat_rows, pack

    parts = [_blocks(t, 16 * (i + 1) if i < len(types) - 1 else 5, 256, seed=i) for i, t in enumerate(types)]
    shards = concat_rows(parts)
    got = pack(shards, "int8")
    if isinstance(shards, BlockShards):
        q, d, sc, m = q6_from_shards(shards)
        want = (Q6Weight if m is None else Q6MWeight)(q, d, sc, m)
    else:  # one type: stacked blocks
        want = _reference(Q6Weight, shards)
    assert type(got) is type(want)
    for name, tensor in want.tensors().items():
        assert torch.equal(got.tensors()[name].view(torch.uint8), tensor.view(torch.uint8)), name
