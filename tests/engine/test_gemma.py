"""Gemma 2 / Gemma 3 (and Mistral's sliding window) against transformers, through the paged cache.

Tiny random models (tests/helpers.py TINY_CONFIGS): 4 layers mixing sliding-window (8 tokens) and
global layers, one KV head of head_dim 32, Gemma 2's score and logit soft-capping, Gemma 3's q/k
norms and two RoPE bases (linear scaling on the global ones). Prompts outgrow the window, so a
kernel that attended the whole context would fail. Both a safetensors folder and a GGUF file
(written as llama.cpp writes Gemma: norms stored as 1 + w) are loaded.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.models import Gemma3ForCausalLM
from engine.weights.loader import load_model
from kernels.cpu import ops as cpu_ops
from tests.gguf_helpers import transformers_from_gguf, write_gguf
from tests.helpers import TINY_VOCAB, PagedHarness, reference_logits, reference_model

ATOL = 1e-4
MAX_NEW = 32
ARCHS = ["gemma2", "gemma3"]


@pytest.fixture(autouse=True)
def _one_cpu_thread():
    """Tiny tensors: a second OpenMP thread only adds synchronisation, and on a loaded machine it
    spins waiting for a descheduled partner (the greedy test ran 9x slower with two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _prompts(seed: int, lengths: list[int], vocab: int = TINY_VOCAB) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module", params=ARCHS)
def gemma(request, tiny_model_factory):
    path = tiny_model_factory(request.param)
    return SimpleNamespace(arch=request.param, path=path, loaded=load_model(str(path)), ref=reference_model(path))


def _greedy(ref, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        # no EOS: the engine ignores it too (min_new_tokens would instead forbid it)
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_logits_match_transformers(gemma, backend: str) -> None:
    """A ragged prefill (prompts shorter and longer than the window), a decode step for each, then
    a mixed step: decodes, a chunk after a cached prefix, a new prompt (torch, or Triton on CUDA)."""
    loaded = gemma.loaded
    if backend == "triton":
        pytest.importorskip("triton")
        if torch.cuda.is_available():
            loaded = load_model(str(gemma.path), device="cuda", dtype="float32")
        elif os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the Triton kernels need CUDA or TRITON_INTERPRET=1")
    harness = PagedHarness(loaded, num_blocks=64, block_size=4, backend=backend)
    prompts = dict(enumerate(_prompts(1, [5, 19, 1, 12])))
    logits, offset = harness.step(prefills=list(prompts.items())), 0
    for tokens in prompts.values():
        want = reference_logits(gemma.ref, tokens)
        torch.testing.assert_close(logits[offset:offset + len(tokens)].cpu(), want, atol=ATOL, rtol=0)
        offset += len(tokens)
    nxt = {seq: t[0] for seq, t in zip(prompts, _prompts(2, [1] * 4), strict=True)}
    logits = harness.step(decodes=nxt)
    for i, seq in enumerate(prompts):
        prompts[seq] = prompts[seq] + [nxt[seq]]
        torch.testing.assert_close(logits[i].cpu(), reference_logits(gemma.ref, prompts[seq])[-1], atol=ATOL, rtol=0)
    if backend == "triton" and not torch.cuda.is_available():
        return  # interpreted Triton is slow: the mixed step's kernels are the same two, tested above
    chunk, new = _prompts(3, [6, 11])
    logits = harness.step(decodes={0: 7, 2: 9}, prefills=[(1, chunk), (4, new)]).cpu()
    torch.testing.assert_close(logits[0], reference_logits(gemma.ref, prompts[0] + [7])[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1], reference_logits(gemma.ref, prompts[2] + [9])[-1], atol=ATOL, rtol=0)
    want = reference_logits(gemma.ref, prompts[1] + chunk)[-len(chunk):]
    torch.testing.assert_close(logits[2:8], want, atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[8:], reference_logits(gemma.ref, new), atol=ATOL, rtol=0)


def test_the_window_and_layer_pattern_are_the_configs(gemma, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sliding layers where transformers has them, and attending the whole context instead changes
    the result (so the parity above really checks the window)."""
    layers = gemma.loaded.model.attention_layers()
    assert [a.window for a in layers] == [8 if t == "sliding_attention" else None
                                          for t in gemma.ref.config.layer_types]
    assert {a.softcap for a in layers} == ({0.5} if gemma.arch == "gemma2" else {None})
    assert gemma.loaded.max_model_len == 256  # the window does not cap the context
    tokens = _prompts(4, [24])[0]
    for a in layers:
        monkeypatch.setattr(a, "window", None)
    got = PagedHarness(gemma.loaded).step(prefills=[(0, tokens)])
    assert (got[-1] - reference_logits(gemma.ref, tokens)[-1]).abs().max().item() > 1e-3


def test_greedy_matches_generate_past_the_window(gemma, monkeypatch: pytest.MonkeyPatch) -> None:
    """32 greedy tokens through LLMEngine, several sequences at once sharing a prefix (decode steps
    with shared-prefix groups), each decoding far past the window; the Llama one-call CPU decode
    is never taken."""
    monkeypatch.setattr(cpu_ops, "llama_decode", lambda *a: pytest.fail("Gemma took the Llama decode"))
    common = _prompts(5, [13])[0]
    prompts = [common + tail for tail in _prompts(6, [3, 9])] + _prompts(7, [20])
    engine = LLMEngine(gemma.loaded, EngineConfig(block_size=4, num_blocks=128))
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == _greedy(gemma.ref, prompt, MAX_NEW)


def test_a_bare_gemma3_text_config_is_gemma3(tiny_model_factory, tmp_path: Path) -> None:
    """A config naming no architecture (a bare Gemma3TextConfig saved) goes by model_type gemma3_text."""
    folder = tmp_path / "bare"
    shutil.copytree(tiny_model_factory("gemma3"), folder)
    config = json.loads((folder / "config.json").read_text())
    assert config.pop("architectures") and config["model_type"] == "gemma3_text"
    (folder / "config.json").write_text(json.dumps(config))
    assert isinstance(load_model(str(folder)).model, Gemma3ForCausalLM)


def test_mistral_sliding_window_matches_transformers(tiny_model_factory) -> None:
    """Mistral slides every layer: prompts and decodes past a window of 8 match transformers."""
    path = tiny_model_factory("mistral", sliding_window=8)
    loaded, ref = load_model(str(path)), reference_model(path)
    assert [a.window for a in loaded.model.attention_layers()] == [8, 8] and loaded.max_model_len == 256
    prompt = _prompts(8, [21])[0]
    got = PagedHarness(loaded).step(prefills=[(0, prompt)])
    torch.testing.assert_close(got, reference_logits(ref, prompt), atol=ATOL, rtol=0)
    engine = LLMEngine(loaded, EngineConfig(block_size=4, num_blocks=64))
    out = engine.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == _greedy(ref, prompt, 16)


# ---- GGUF --------------------------------------------------------------------------------------

# (arch, matrix type): F32 loads dense; Q8_0 under quantization "auto" loads packed int8
GGUF_CASES = [("gemma2", "F32"), ("gemma3", "Q8_0")]


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gemma-gguf")


@pytest.mark.parametrize("arch,qtype", GGUF_CASES, ids=[f"{a}-{q}" for a, q in GGUF_CASES])
def test_gguf_matches_the_model_it_was_written_from(gguf_dir: Path, arch: str, qtype: str) -> None:
    """The reference is the model the file was written from, with the weights transformers reads
    back from the file (dequantized, its norms' + 1 undone): transformers' own GGUF config for
    Gemma misses what llama.cpp implies (soft-capping, query scale = head_dim, layer pattern,
    Gemma 3's RoPE scaling), which our loader reads or derives."""
    path = gguf_dir / f"{arch}-{qtype}.gguf"
    # llama.cpp stores no query_pre_attn_scalar: it scales by head_dim, so the original must too
    original, tok = write_gguf(path, arch, qtype=qtype, query_pre_attn_scalar=32)
    original.load_state_dict(transformers_from_gguf(path).state_dict())
    vocab = tok.get_vocab_size()
    prompt = _prompts(9, [22], vocab)[0]
    want = reference_logits(original, prompt)
    dense = load_model(str(path), quantization="none")
    torch.testing.assert_close(PagedHarness(dense).step(prefills=[(0, prompt)]), want, atol=ATOL, rtol=0)
    engine = LLMEngine(dense, EngineConfig(block_size=4, num_blocks=64))
    out = engine.generate([prompt], SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == _greedy(original, prompt, MAX_NEW)

    auto = load_model(str(path))  # "auto": Q8_0 matrices stay packed (int8), F32 ones dense
    packed = type(auto.model.model.layers[0].mlp.down_proj).__name__ == "PackedLinear"
    assert packed == (qtype == "Q8_0")
    got = PagedHarness(auto).step(prefills=[(0, prompt)])
    torch.testing.assert_close(got, want, atol=2e-3 if packed else ATOL, rtol=0)
