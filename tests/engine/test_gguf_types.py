"""Each GGUF block type multiplied from its own blocks on our CPU kernels (q4.py, q5.py, q6.py, q8.py):
the packed weight reads back as gguf's own dequantizer gives it, bit for bit, its matmul matches a
float64 reference, merged shards of mixed types stay exact, types without a kernel are dequantized
with one warning; and a tiny Q4_K_M-like file (Q4_K with Q6_K, Q5_K, Q5_1, Q5_0) loads with
quantization "auto" to logits far closer to the dequantized load than the old requantized path."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.weights import formats, routes, rowpack
from engine.weights.blocks import BlockShards, GGUFBlocks
from engine.weights.loader import load_model
from engine.weights.packing import PackedEmbedding, PackedLinear, auto_mode
from engine.weights.q4 import Q4KWeight, Q4Weight
from engine.weights.q5 import Q8MWeight
from engine.weights.q6 import Q6Weight
from engine.weights.q8 import Q8Weight
from engine.weights.routes import concat_rows, pack
from kernels.cpu import ops as cpu_ops
from tests.gguf_helpers import K_QUANTS, NO_KERNEL, _k_quant_blocks, write_gguf
from tests.helpers import PagedHarness

pytestmark = pytest.mark.skipif(not cpu_ops.supported_cpu(), reason="our kernels need an x86 CPU with AVX2")
PROMPT = "the cat sat on the mat with his friend"
# type -> the operand it packs into under "auto", and its bits a weight (formats.FORMS)
FORMS = {"Q4_0": Q4Weight, "Q4_1": Q4Weight, "Q4_K": Q4KWeight, "Q5_0": Q8Weight, "Q5_1": Q8MWeight,
         "Q5_K": Q8MWeight, "Q6_K": Q6Weight, "Q8_0": Q8Weight}


def _blocks(type_name: str, rows: int = 40, cols: int = 512, seed: int = 0) -> GGUFBlocks:
    import gguf

    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name in K_QUANTS + NO_KERNEL:  # gguf cannot write these: random super-blocks, small scales
        return GGUFBlocks(_k_quant_blocks(rows, cols, qtype, rng), type_name, (rows, cols))
    w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    w[:, 7] *= 6  # an outlier column: block scales differ along a row
    return GGUFBlocks(gguf.quants.quantize(w, qtype), type_name, (rows, cols))


def test_scales_that_float16_cannot_hold_are_refused_not_rounded() -> None:
    """Q4_0's offset is -8d: a scale above 65504 / 8 overflows float16, so the file is refused with the
    value, rather than multiplied by an infinite offset."""
    blocks = _blocks("Q4_0", rows=8, cols=64)
    data = blocks.data.copy().reshape(8, 2, 18)
    data[3, 1, 0:2] = np.frombuffer(np.float16(9000.0).tobytes(), dtype=np.uint8)  # d = 9000
    with pytest.raises(ValueError, match="do not fit torch.float16 exactly.*72000"):
        pack(GGUFBlocks(data.reshape(8, 36), "Q4_0", (8, 64)), "int4")


@pytest.fixture(autouse=True)
def _ours(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROSECHAT_QUANT_KERNELS", "rosechat")
    assert cpu_ops.available(), cpu_ops.unavailable_reason()


@pytest.mark.parametrize("type_name", list(FORMS))
def test_each_block_type_is_kept_exactly(type_name: str) -> None:
    blocks = _blocks(type_name)
    ref = blocks.dequantize()  # gguf's own dequantizer
    packed = pack(blocks, auto_mode(type_name))
    assert isinstance(packed, FORMS[type_name])
    assert torch.equal(packed.dequantize(), ref)  # bit for bit: the same products and sums in fp32
    ids = torch.tensor([[3, 1], [39, 3]])
    assert torch.equal(packed.rows(ids, torch.float32), ref[ids])  # an embedding's lookup
    assert packed.nbytes() == formats.resident_bytes(type_name, ref.numel())
    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q6_K", "Q8_0"):  # the file's float16 scales, kept as they are
        assert packed.d.dtype == torch.float16
    if type_name in ("Q4_1", "Q6_K", "Q8_0"):  # the file's bytes, rearranged (Q4_0 adds offsets, Q5_0 a byte a weight)
        assert packed.nbytes() == formats.file_bytes(type_name, ref.numel())
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 7):  # a decode step, a prefill chunk
        x = torch.randn(rows, 512, generator=gen)
        want = x.double() @ ref.double().t()
        assert (packed.linear(x).double() - want).abs().max() < 1e-4 * want.abs().max()  # int16 activations


def test_merged_shards_of_mixed_types_stay_exact_where_one_form_holds_them() -> None:
    cases = [(("Q4_K", "Q4_K", "Q6_K"), Q6Weight),  # Q4_K_M's q, k and v
             (("Q6_K", "Q5_K"), Q6Weight),  # q8m cannot hold Q6_K's scales per 16
             (("Q5_1", "Q4_K"), Q8MWeight),  # gate Q5_1, up Q4_K
             (("Q4_0", "Q5_0", "Q8_0"), Q8MWeight)]
    for types, form in cases:
        shards = concat_rows([_blocks(t, rows=8 * (i + 1), seed=i) for i, t in enumerate(types)])
        assert isinstance(shards, BlockShards)
        packed = pack(shards, "int8")
        assert isinstance(packed, form), types
        assert torch.equal(packed.dequantize(), shards.dequantize()), types
    # no one form: dequantized, then 8-bit blocks by absmax (as every mix was before)
    shards = concat_rows([_blocks("Q4_0", rows=8), _blocks("Q6_K", rows=8)])
    packed = pack(shards, "int8")
    assert isinstance(packed, Q8Weight)
    ref = shards.dequantize()
    step = ref.view(16, -1, 32).abs().amax(-1, keepdim=True) / 127
    assert ((packed.dequantize() - ref).view(16, -1, 32).abs() <= step / 2 + 1e-7).all()


@pytest.mark.parametrize("type_name", NO_KERNEL)
def test_a_type_without_a_kernel_is_dequantized_to_8_bit_blocks(type_name: str) -> None:
    assert auto_mode(type_name) == "int8" and not formats.has_kernel(type_name)
    assert auto_mode("IQ4_XS") == "int8" and auto_mode("F16") == "none"
    blocks = _blocks(type_name)
    ref = blocks.dequantize()
    packed = pack(blocks, auto_mode(type_name))
    assert isinstance(packed, Q8Weight)
    step = ref.view(40, -1, 32).abs().amax(-1, keepdim=True) / 127
    assert ((packed.dequantize() - ref).view(40, -1, 32).abs() <= step / 2 + 1e-7).all()
    # 9 bits a weight where the file holds 2.6 (Q2_K) or 3.4 (Q3_K)
    assert formats.resident_bytes(type_name, 2**20) == 9 * 2**17
    assert formats.file_bytes(type_name, 2**20) < 2**19
    line = formats.no_kernel_warning({type_name: 2**20, "Q4_K": 2**20})
    assert line is not None and type_name in line and "Q4_K" not in line and "MiB" in line
    assert formats.no_kernel_warning({"Q4_K": 2**20, "Q6_K": 10}) is None


K_SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
# Q4_K_M-like: Q4_K with Q6_K v (a mixed qkv) and tied embedding, Q5_K down, Q5_1 gate (a mixed
# gate_up), Q5_0 o
MIX = {"attn_v": "Q6_K", "token_embd": "Q6_K", "ffn_down": "Q5_K", "ffn_gate": "Q5_1", "attn_output": "Q5_0"}


def test_a_q4_k_m_like_file_is_exact_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "q4km.gguf"
    _, tok = write_gguf(path, "llama", qtype="Q4_K", tie=True, tensor_qtypes=MIX, **K_SHAPE)
    dense = load_model(str(path), quantization="none")
    packed = load_model(str(path), quantization="auto")
    layer = packed.model.model.layers[0]
    kinds = {name: type(m.weight).__name__ for name, m in
             [("qkv", layer.self_attn.qkv_proj), ("o", layer.self_attn.o_proj), ("gate_up", layer.mlp.gate_up_proj),
              ("down", layer.mlp.down_proj), ("embed", packed.model.model.embed_tokens)]}
    assert kinds == {"qkv": "Q6MWeight", "o": "Q8HalfWeight", "gate_up": "Q8MWeight", "down": "Q8MWeight",
                     "embed": "Q6Weight"}
    assert isinstance(packed.model.model.embed_tokens, PackedEmbedding)
    ids = tok.encode(PROMPT).ids
    want = PagedHarness(dense).step(prefills=[(0, ids)])
    exact = (PagedHarness(packed).step(prefills=[(0, ids)]) - want).abs().max().item() / want.abs().max().item()
    # the path before: Q5_x / Q6_K (and mixed shards) requantized to 8-bit blocks by absmax
    monkeypatch.setattr(routes, "exact_int8", lambda source: None)
    monkeypatch.setattr(rowpack, "K_EXACT", ())  # no q6k streaming either (rowpack.streamed_class)
    monkeypatch.delitem(rowpack.STREAMED, ("int8", "Q6_K"))
    old = load_model(str(path), quantization="auto", weight_cache=False)  # repacked, not the exact forms cached
    assert not any(isinstance(m.weight, Q6Weight | Q8MWeight) for m in old.model.modules()
                   if isinstance(m, PackedLinear | PackedEmbedding))
    before = (PagedHarness(old).step(prefills=[(0, ids)]) - want).abs().max().item() / want.abs().max().item()
    print(f"max |logit diff| / max |logit|: exact {exact:.1e}, requantized {before:.1e}")
    assert exact < 5e-4 and exact < before / 20, (exact, before)  # measured 1.3e-4 and 2.7e-2
    # greedy decoding: the dequantized load's tokens, through decode.cpp's whole-layer step
    calls = []
    decode_op = cpu_ops.llama_decode
    monkeypatch.setattr(cpu_ops, "llama_decode", lambda *a: calls.append(1) or decode_op(*a))
    outs = [LLMEngine(loaded, EngineConfig(block_size=8, num_blocks=64)).generate(
        [ids], SamplingParams(max_tokens=8, ignore_eos=True))[0].outputs[0].token_ids for loaded in (dense, packed)]
    assert outs[0] == outs[1] and calls


def test_an_untied_q4_k_m_like_file_keeps_its_embedding_and_head_as_the_file_has_them(tmp_path: Path) -> None:
    """Llama 3 8B's layout: a Q4_K token embedding of its own (no dense vocab x hidden floats: 2 GB there) and a
    Q6_K output, both packed in one pass from the file; the logits and greedy tokens are the dequantized load's."""
    path = tmp_path / "untied.gguf"
    mix = {"attn_v": "Q6_K", "ffn_down": "Q6_K", "output": "Q6_K"}
    _, tok = write_gguf(path, "llama", qtype="Q4_K", tie=False, tensor_qtypes=mix, **K_SHAPE)
    dense = load_model(str(path), quantization="none")
    packed = load_model(str(path), quantization="auto", weight_cache=False)
    net, layer = packed.model, packed.model.model.layers[0]
    assert isinstance(net.model.embed_tokens, PackedEmbedding)
    kinds = [type(m.weight).__name__ for m in (net.model.embed_tokens, net.lm_head, layer.self_attn.qkv_proj,
                                               layer.mlp.down_proj)]
    assert kinds == ["Q4KWeight", "Q6Weight", "Q6MWeight", "Q6Weight"]
    assert not [n for n, _ in net.named_parameters() if "embed" in n]  # no dense copy
    from engine.weights.gguf import GGUFModel
    from engine.weights.memory import weight_bytes
    from engine.weights.packing import packed_bytes

    held = packed_bytes(net) + sum(p.nbytes for p in net.parameters())
    estimate = weight_bytes(GGUFModel(path), "auto", 4)  # the memory check's: the embedding packed, not float32
    print(f"held {held}, estimated {estimate}")
    assert abs(estimate - held) < 0.1 * held, (estimate, held)
    ids = tok.encode(PROMPT).ids
    want = PagedHarness(dense).step(prefills=[(0, ids)])
    diff = (PagedHarness(packed).step(prefills=[(0, ids)]) - want).abs().max().item() / want.abs().max().item()
    assert diff < 5e-4, diff  # exact weights: int16 activations only
    outs = [LLMEngine(loaded, EngineConfig(block_size=8, num_blocks=64)).generate(
        [ids], SamplingParams(max_tokens=8, ignore_eos=True))[0].outputs[0].token_ids for loaded in (dense, packed)]
    assert outs[0] == outs[1]


def test_a_file_with_a_type_without_a_kernel_warns_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "q3k.gguf"
    write_gguf(path, "llama", qtype="Q4_K", tensor_qtypes={"ffn_down": "Q3_K", "attn_output": "Q2_K"}, **K_SHAPE)
    with caplog.at_level(logging.WARNING, logger="engine.weights.packing"):
        loaded = load_model(str(path), quantization="auto")
    lines = [r.getMessage() for r in caplog.records if "no kernel" in r.getMessage()]
    assert len(lines) == 1 and "Q2_K, Q3_K" in lines[0], lines
    assert isinstance(loaded.model.model.layers[0].mlp.down_proj.weight, Q8Weight)


def test_a_mapped_tensor_is_repacked_chunk_by_chunk_its_pages_dropped_as_it_goes(monkeypatch) -> None:
    """A one-pass repack of a memory-mapped tensor maps each chunk's file pages in, packs it, and drops them
    (rowpack.fill_rows): the whole tensor's pages are never resident beside its packed copy; same bytes."""
    from engine.weights.blocks import FilePages
    from engine.weights.rowpack import pack_rows

    calls: list[tuple[str, int, int]] = []
    blocks = _blocks("Q6_K", rows=61)  # 2 super-blocks of 210 bytes a row
    blocks.pages = FilePages(lambda a, b: calls.append(("in", a, b)), lambda a, b: calls.append(("out", a, b)))
    monkeypatch.setattr(rowpack, "MAPPED_CHUNK_BYTES", 16 * 420)  # 16 rows a chunk
    got = pack_rows(Q6Weight, blocks)
    spans = [(0, 16), (16, 32), (32, 48), (48, 61)]
    assert calls == [(kind, a, b) for a, b in spans for kind in ("in", "out")]
    want = pack_rows(Q6Weight, GGUFBlocks(blocks.data, "Q6_K", blocks.shape))  # no pages: one pass, whole
    assert all(torch.equal(t, want.tensors()[k]) for k, t in got.tensors().items())


def test_a_file_loaded_in_small_mapped_chunks_gives_the_same_logits(tmp_path: Path, monkeypatch) -> None:
    from engine.weights import gguf as gguf_module

    path = tmp_path / "chunks.gguf"
    _, tok = write_gguf(path, "llama", qtype="Q4_K", tie=False, tensor_qtypes={"attn_v": "Q6_K", "output": "Q6_K"},
                        **K_SHAPE)
    ids = tok.encode(PROMPT).ids
    want = PagedHarness(load_model(str(path), quantization="auto", weight_cache=False)).step(prefills=[(0, ids)])
    monkeypatch.setattr(gguf_module, "_POPULATE_WHOLE", 0)  # every tensor mapped in by chunks
    monkeypatch.setattr(rowpack, "MAPPED_CHUNK_BYTES", 4096)
    got = PagedHarness(load_model(str(path), quantization="auto", weight_cache=False)).step(prefills=[(0, ids)])
    assert torch.equal(got, want)
