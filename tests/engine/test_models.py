"""Own model implementations against transformers, through the paged KV cache.

Each case saves a tiny random transformers model, loads it with engine.weights.load_model, and compares
logits of (a) a ragged batch packed as one prefill, (b) one decode step for every sequence and
(c) a mixed step (decodes + a chunked-prefill continuation + a new prompt) with transformers'
forward over the same tokens (fp32).
"""

from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch

from engine.attention import Attention, AttentionMetadata
from engine.models import MODEL_REGISTRY, get_model_class
from engine.models.layers import rope_inv_freq, rope_parameters
from engine.weights.loader import load_model
from tests.helpers import TINY_VOCAB, PagedHarness, reference_logits, reference_model

ATOL = 1e-4

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

# case -> (arch, config overrides, save kwargs)
CASES = {
    # GQA 3, explicit head_dim 48 (not hidden/heads), llama3 RoPE, untied head, all biases, 3+ shards
    "llama-gqa3-hd48-llama3-bias-sharded": (
        "llama",
        dict(hidden_size=192, num_attention_heads=6, num_key_value_heads=2, head_dim=48,
             attention_bias=True, mlp_bias=True, tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE),
        dict(max_shard_size="300KB"),
    ),
    # SmolLM-like: head_dim 64, MQA, tied head, rope_theta 1e5 with linear scaling
    "llama-mqa-hd64-tied-linear": (
        "llama",
        dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
             rope_parameters={"rope_type": "linear", "rope_theta": 100000.0, "factor": 2.0}),
        {},
    ),
    # qkv bias, head_dim 80, tied, YaRN
    "qwen2-hd80-tied-yarn": (
        "qwen2",
        dict(hidden_size=320, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
             rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                              "original_max_position_embeddings": 64}),
        {},
    ),
    # per-head q/k RMSNorm, GQA 3, head_dim 64 from the config (hidden/heads would be 32), untied
    "qwen3-qknorm-gqa3-hd64": (
        "qwen3",
        dict(hidden_size=192, num_attention_heads=6, num_key_value_heads=2, head_dim=64,
             tie_word_embeddings=False),
        {},
    ),
    "mistral-mha": (
        "mistral",
        dict(num_attention_heads=4, num_key_value_heads=4, rope_parameters={"rope_type": "default",
                                                                            "rope_theta": 1e6}),
        {},
    ),
    # fused qkv / gate_up checkpoint tensors, untied, a window of 8 that the prompts outgrow
    "phi3-gqa-window8": ("phi3", dict(sliding_window=8), {}),
    "gpt2-tied": ("gpt2", dict(tie_word_embeddings=True), {}),
    "gpt2-untied-inverse-layer-scale": (
        "gpt2", dict(tie_word_embeddings=False, scale_attn_by_inverse_layer_idx=True, n_inner=96), {}
    ),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tiny_model_factory):
    arch, overrides, save_kwargs = CASES[request.param]
    path = tiny_model_factory(arch, **overrides, **save_kwargs)
    return SimpleNamespace(name=request.param, path=path, loaded=load_model(str(path)), ref=reference_model(path))


def _compare(got: torch.Tensor, want: torch.Tensor, what: str) -> float:
    assert got.shape == want.shape, what
    assert got.dtype == torch.float32
    diff = (got.cpu() - want).abs().max().item()
    assert diff < ATOL, f"{what}: max |logit diff| {diff:.2e}"
    return diff


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_matches_transformers(case, backend):
    loaded = case.loaded
    if backend == "triton":
        pytest.importorskip("triton")
        if torch.cuda.is_available():
            loaded = load_model(str(case.path), device="cuda", dtype="float32")
        elif os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the Triton kernels need CUDA or TRITON_INTERPRET=1")
    gen = torch.Generator().manual_seed(1)
    rand = lambda n: torch.randint(0, TINY_VOCAB, (n,), generator=gen).tolist()
    harness = PagedHarness(loaded, num_blocks=64, block_size=4, backend=backend)
    prompts = {0: rand(5), 1: rand(17), 2: rand(1), 3: rand(9)}
    max_diff = 0.0

    # (a) ragged batch, one packed prefill
    logits = harness.step(prefills=list(prompts.items()))
    offset = 0
    for seq, tokens in prompts.items():
        want = reference_logits(case.ref, tokens)
        max_diff = max(max_diff, _compare(logits[offset : offset + len(tokens)], want, f"prefill seq {seq}"))
        offset += len(tokens)
    assert offset == logits.shape[0]

    # (b) one decode step for every sequence
    nxt = {seq: rand(1)[0] for seq in prompts}
    logits = harness.step(decodes=nxt)
    for i, seq in enumerate(prompts):
        prompts[seq] = prompts[seq] + [nxt[seq]]
        want = reference_logits(case.ref, prompts[seq])[-1]
        max_diff = max(max_diff, _compare(logits[i], want, f"decode seq {seq}"))

    # (c) mixed: decodes of seqs 0 and 2, seq 1 continues with a 6-token chunk, seq 4 is new
    nxt = {0: rand(1)[0], 2: rand(1)[0]}
    chunk, new = rand(6), rand(7)
    logits = harness.step(decodes=nxt, prefills=[(1, chunk), (4, new)])
    for i, seq in enumerate(nxt):
        prompts[seq] = prompts[seq] + [nxt[seq]]
        want = reference_logits(case.ref, prompts[seq])[-1]
        max_diff = max(max_diff, _compare(logits[i], want, f"mixed decode {seq}"))
    want_chunk = reference_logits(case.ref, prompts[1] + chunk)[-len(chunk) :]
    max_diff = max(max_diff, _compare(logits[2:8], want_chunk, "mixed chunked prefill"))
    max_diff = max(max_diff, _compare(logits[8:], reference_logits(case.ref, new), "mixed new prefill"))
    print(f"{case.name} [{backend}]: max |logit diff| {max_diff:.2e}")


def test_loaded_model_description(case):
    cfg = json.loads((case.path / "config.json").read_text())
    lm = case.loaded
    heads = cfg.get("num_attention_heads", cfg.get("n_head"))
    assert lm.num_layers == cfg.get("num_hidden_layers", cfg.get("n_layer")) == len(lm.model.attention_layers())
    assert lm.num_kv_heads == cfg.get("num_key_value_heads", heads)
    assert lm.head_dim == (cfg.get("head_dim") or cfg.get("hidden_size", cfg.get("n_embd")) // heads)
    assert not lm.is_demo and lm.name == case.path.name
    assert lm.eos_token_ids and lm.eos_token_ids[0] == cfg["eos_token_id"]
    # a tied model has no lm_head of its own; an untied one does
    assert (getattr(lm.model, "lm_head", None) is None) == cfg["tie_word_embeddings"]


def test_sharded_checkpoint_was_sharded(tiny_model_factory):
    arch, overrides, save_kwargs = CASES["llama-gqa3-hd48-llama3-bias-sharded"]
    path = tiny_model_factory(arch, **overrides, **save_kwargs)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2


def test_attention_without_backend_raises():
    attn = Attention(4, 2, 8, 8**-0.5)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(1, dtype=torch.int64),
        num_decode_tokens=1,
        decode_block_tables=torch.zeros(1, 1, dtype=torch.int32),
        decode_context_lens=torch.ones(1, dtype=torch.int32),
        prefill_block_tables=torch.zeros(0, 1, dtype=torch.int32),
        prefill_cu_seqlens_q=torch.zeros(1, dtype=torch.int32),
        prefill_context_lens=torch.zeros(0, dtype=torch.int32),
    )
    with pytest.raises(RuntimeError, match="k_cache"):
        attn(torch.zeros(1, 4, 8), torch.zeros(1, 2, 8), torch.zeros(1, 2, 8), meta)


def test_registry_rejects_unknown_architecture():
    config = SimpleNamespace(architectures=["BertForMaskedLM"])
    with pytest.raises(ValueError, match="BertForMaskedLM") as info:
        get_model_class(config)
    for name in MODEL_REGISTRY:
        assert name in str(info.value)
    with pytest.raises(ValueError, match="supported"):
        get_model_class(SimpleNamespace(architectures=None))


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 100000.0, "factor": 4.0},
        LLAMA3_ROPE,
        {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 512},
        {"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0, "original_max_position_embeddings": 256,
         "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16},
    ],
    ids=lambda p: p["rope_type"],
)
def test_rope_matches_transformers(params):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=2048,
                         rope_parameters=dict(params))
    want_scale = 1.0
    if params["rope_type"] == "default":
        want = 1.0 / (params["rope_theta"] ** (torch.arange(0, 64, 2).float() / 64))
    else:
        want, want_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")
    got, scale = rope_inv_freq(rope_parameters(config), 64, config.max_position_embeddings)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(want_scale)


def test_rope_parameters_reads_both_config_layouts():
    v4 = SimpleNamespace(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    v5 = SimpleNamespace(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5})
    bare = SimpleNamespace(rope_theta=1234.0, rope_scaling=None)
    assert rope_parameters(v4) == rope_parameters(v5) == {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}
    assert rope_parameters(bare) == {"rope_type": "default", "rope_theta": 1234.0}
    with pytest.raises(ValueError, match="dynamic"):
        rope_inv_freq({"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, 64, 128)


@pytest.mark.parametrize("rows", [1, 8, 200])
def test_linear_matches_float64_and_follows_weight_updates(rows):
    """The CPU path packs the weight once for oneDNN: same result as a float64 matmul, and an in-place
    update of the weight (what loading does) is seen by the next call, not the stale packed copy."""
    from engine.models.layers import linear

    gen = torch.Generator().manual_seed(rows)
    w, b, x = torch.randn(96, 80, generator=gen), torch.randn(96, generator=gen), torch.randn(rows, 80, generator=gen)
    for _ in range(2):
        out = linear(x, w, b)
        ref = x.double() @ w.double().t() + b.double()
        torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-5)
        with torch.no_grad():
            w.mul_(-0.5)
    with torch.inference_mode():
        torch.testing.assert_close(linear(x, w).double(), x.double() @ w.double().t(), atol=1e-4, rtol=1e-5)


def test_weights_loaded_after_a_forward_replace_the_packed_copies(tmp_path):
    """CPU linears keep a packed copy of each weight: loading another checkpoint into a model that
    has already run must reach every projection and the head, not leave them on the old copies."""
    from engine.weights.checkpoint import load_weights
    from tests.helpers import make_tiny_model

    a, b = make_tiny_model(tmp_path / "a", "llama", seed=1), make_tiny_model(tmp_path / "b", "llama", seed=2)
    model_a, model_b = load_model(str(a)).model, load_model(str(b)).model
    x = torch.randn(5, model_a.config.hidden_size)
    layer_a, layer_b = model_a.model.layers[0], model_b.model.layers[0]
    with torch.inference_mode():
        before = layer_a.mlp(x), model_a.compute_logits(x)  # packs a's weights
        load_weights(model_a, b)
        after, want = (layer_a.mlp(x), model_a.compute_logits(x)), (layer_b.mlp(x), model_b.compute_logits(x))
    assert not torch.allclose(before[0], want[0])
    for got, ref in zip(after, want):
        torch.testing.assert_close(got, ref)


def test_phi3_longrope_and_partial_rotary_are_refused_by_name(tiny_model_factory):
    """Phi-3's 128k models switch RoPE factor sets with each forward's length (transformers'
    longrope), Phi-4-mini rotates part of each head: both refused by name, not run with the wrong
    frequencies."""
    half = 128 // 4 // 2
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * half,
            "long_factor": [2.0] * half, "original_max_position_embeddings": 64}
    with pytest.raises(ValueError, match="rope_type 'longrope'"):
        load_model(str(tiny_model_factory("phi3", rope_parameters=rope)))
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        load_model(str(tiny_model_factory("phi3", partial_rotary_factor=0.75)))


def test_phi3_fused_checkpoint_loads_packed_and_names_a_missing_tensor(tiny_model_factory, tmp_path):
    """The fused qkv_proj / gate_up_proj tensors go whole into packed int8 weights (one shard each), and a
    checkpoint without one is refused naming it."""
    from safetensors.torch import load_file, save_file

    from engine.weights.checkpoint import WeightLoadError

    path = tiny_model_factory("phi3")
    tokens = list(range(5, 30))
    dense = PagedHarness(load_model(str(path), quantization="none")).step(prefills=[(0, tokens)])
    packed = load_model(str(path), quantization="int8")
    assert type(packed.model.model.layers[0].self_attn.qkv_proj).__name__ == "PackedLinear"
    got = PagedHarness(packed).step(prefills=[(0, tokens)])
    assert (got - dense).abs().max().item() < 0.05 * dense.abs().max().item()
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.mlp.gate_up_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.mlp\.gate_up_proj\.weight"):
        load_model(str(broken), quantization="none")
