"""kernels/cpu/layers.cpp (the fused float32 layers of a CPU step) against float64 references, and
the model with them against the model without them (ATen ops, ROSECHAT_CPU_LAYERS=torch)."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.cpu import ops as cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.supported_cpu(), reason="the kernels need an x86 CPU with AVX2")
gen = torch.Generator().manual_seed(0)


@pytest.fixture(autouse=True, scope="module")
def built() -> None:
    assert cpu_ops.available(), cpu_ops.unavailable_reason()  # on x86 a failed build fails the tests


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen)


def close(got: torch.Tensor, want: torch.Tensor, tol: float = 2e-6) -> None:
    assert got.dtype == torch.float32
    err = (got.double() - want).abs().max().item()
    assert err <= tol * max(1.0, want.abs().max().item()), err


def rms_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("n", [576, 37])  # a tail past the 8-lane loops
def test_rms_norm_and_the_fused_residual_add(n: int) -> None:
    x, res, w = randn(5, n), randn(5, n), randn(n)
    close(cpu_ops.rms_norm(x, w, 1e-5), rms_ref(x, w, 1e-5))
    want_res = res.double() + x.double()
    cpu_ops.add_rms_norm_(x, res, w, 1e-5)
    close(res, want_res)
    close(x, rms_ref(want_res, w, 1e-5))


def test_rotary_in_place_on_strided_views_of_one_projection() -> None:
    T, Hq, Hk, D = 3, 4, 2, 20  # D/2 = 10: one vector and a tail
    qkv = randn(T, (Hq + 2 * Hk) * D)
    q = qkv[:, : Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D : (Hq + Hk) * D].view(T, Hk, D)
    v_before = qkv[:, (Hq + Hk) * D :].clone()
    angles = randn(T, 1, D // 2)
    cos, sin = angles.cos(), angles.sin()

    def ref(x: torch.Tensor) -> torch.Tensor:
        a, b = x.double().chunk(2, dim=-1)
        c, s = cos.double(), sin.double()
        return torch.cat((a * c - b * s, b * c + a * s), dim=-1)

    want_q, want_k = ref(q), ref(k)
    cpu_ops.rotary_(q, k, cos, sin)
    close(q, want_q)
    close(k, want_k)
    assert torch.equal(qkv[:, (Hq + Hk) * D :], v_before)  # v untouched


def test_silu_mul() -> None:
    x = randn(3, 2 * 45) * 6  # large |x|: exp's range
    g, u = x.double().chunk(2, dim=-1)
    close(cpu_ops.silu_mul(x), g * torch.sigmoid(g) * u, tol=1e-6)


def test_write_kv_skips_minus_one_and_checks_the_slot_range() -> None:
    blocks, bs, Hkv, D = 3, 4, 2, 8
    k_cache, v_cache = torch.zeros(blocks, bs, Hkv, D), torch.zeros(blocks, bs, Hkv, D)
    kv = randn(3, 2 * Hkv * D)
    k, v = kv[:, : Hkv * D].view(3, Hkv, D), kv[:, Hkv * D :].view(3, Hkv, D)  # strided rows
    cpu_ops.write_kv(k, v, k_cache, v_cache, torch.tensor([5, -1, 11]))
    flat_k, flat_v = k_cache.view(-1, Hkv, D), v_cache.view(-1, Hkv, D)
    assert torch.equal(flat_k[5], k[0]) and torch.equal(flat_k[11], k[2])
    assert torch.equal(flat_v[5], v[0]) and torch.equal(flat_v[11], v[2])
    assert int((flat_k.abs().sum((1, 2)) > 0).sum()) == 2  # the -1 row wrote nothing
    with pytest.raises(RuntimeError, match="past the cache"):
        cpu_ops.write_kv(k, v, k_cache, v_cache, torch.tensor([0, 1, blocks * bs]))


# GQA (3 query heads a KV head: the values weighed for three at once; 4 = 3 + 1, 10 = 3 + 2), MHA,
# and head sizes with tails after 32-column passes and 8-column vectors
@pytest.mark.parametrize("Hq, Hkv, D", [(6, 2, 16), (3, 3, 12), (9, 3, 64), (8, 2, 40), (10, 2, 100), (7, 7, 31)])
def test_decode_attention_reads_each_sequence_own_slots(Hq: int, Hkv: int, D: int) -> None:
    S, n, L = 80, 4, 17
    k_rows, v_rows = randn(S, Hkv * D), randn(S, Hkv * D)
    q = randn(n, Hq, D)
    slots = torch.randperm(S, generator=gen)[: n * L].view(n, L).contiguous()
    counts = torch.tensor([17, 1, 9, 8])  # keys 8 at a time, with tails; past a count no slot is read
    scale = 1 / math.sqrt(D)
    out, lse = cpu_ops.decode_attention(q, k_rows, v_rows, slots, counts, scale)
    assert out.shape == (n, Hq, D) and lse.shape == (n, Hq)
    G = Hq // Hkv
    for i in range(n):
        own = slots[i, : counts[i]]
        k = k_rows[own].double().view(-1, Hkv, D)
        v = v_rows[own].double().view(-1, Hkv, D)
        for h in range(Hq):
            s = k[:, h // G] @ q[i, h].double() * scale
            close(out[i, h], torch.softmax(s, 0) @ v[:, h // G], tol=1e-6)
            close(lse[i, h], torch.logsumexp(s, 0), tol=1e-6)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_ops.decode_attention(q, k_rows, v_rows, slots + S, counts, scale)
    with pytest.raises(RuntimeError, match="keys of"):
        cpu_ops.decode_attention(q, k_rows, v_rows, slots, torch.tensor([0, 1, 1, 1]), scale)


def test_decode_attention_over_long_sequences_merges_its_parts() -> None:
    """Past 256 keys a sequence's keys are attended in parts of 256 (its KV heads alone left a thread idle)
    merged by their log-sum-exp: a float64 softmax over all of them; one of 256 keys or fewer, a single part, gives
    the bits it gives alone, in any batch (batch invariance)."""
    Hq, Hkv, D, S = 9, 3, 64, 3000
    k_rows, v_rows = randn(S, Hkv * D), randn(S, Hkv * D)
    counts = torch.tensor([1300, 256, 257, 1025, 40])
    n, L = len(counts), int(counts.max())
    q = randn(n, Hq, D)
    slots = torch.stack([torch.randperm(S, generator=gen)[:L] for _ in range(n)]).contiguous()
    scale = 1 / math.sqrt(D)
    out, lse = cpu_ops.decode_attention(q, k_rows, v_rows, slots, counts, scale)
    for i in range(n):
        own = slots[i, : counts[i]]
        k, v = k_rows[own].double().view(-1, Hkv, D), v_rows[own].double().view(-1, Hkv, D)
        for h in range(Hq):
            s = k[:, h // 3] @ q[i, h].double() * scale
            close(out[i, h], torch.softmax(s, 0) @ v[:, h // 3], tol=1e-5)
            close(lse[i, h], torch.logsumexp(s, 0), tol=1e-5)
    for i in range(n):  # each alone: the same bits as in the batch
        alone = cpu_ops.decode_attention(q[i : i + 1], k_rows, v_rows, slots[i : i + 1, : counts[i]].contiguous(),
                                         counts[i : i + 1], scale)
        assert torch.equal(alone[0][0], out[i]) and torch.equal(alone[1][0], lse[i])


def test_the_model_gives_the_same_logits_with_and_without_the_fused_layers(tmp_path, monkeypatch) -> None:
    """The engine with the fused layers and with ATen's: the same prefill logits within float32
    rounding, and the same greedy tokens from decodes over a shared prefix (the cascade path)."""
    from engine import EngineConfig, LLMEngine, SamplingParams, load_model
    from tests.helpers import make_tiny_model

    loaded = load_model(make_tiny_model(tmp_path / "tiny", "llama", seed=3))
    prompt = list(range(3, 23))

    def run() -> tuple[list[list[int]], torch.Tensor]:
        engine = LLMEngine(loaded, EngineConfig(model="tiny", block_size=4, num_blocks=64))
        logits = engine.score(prompt)
        outs = engine.generate([prompt, prompt[:-1] + [7], prompt[:9]], SamplingParams(max_tokens=8, ignore_eos=True))
        return [list(o.outputs[0].token_ids) for o in outs], logits

    fused_tokens, fused_logits = run()
    monkeypatch.setattr(cpu_ops, "fused_layers", False)
    aten_tokens, aten_logits = run()
    assert fused_tokens == aten_tokens
    assert (fused_logits - aten_logits).abs().max().item() < 1e-4 * fused_logits.abs().max().item()


def test_a_decode_step_in_one_call_equals_the_module_path_bit_for_bit(tmp_path, monkeypatch) -> None:
    """decode.cpp runs the module path's kernels in its order: the logits of every step are equal,
    with or without shared prefixes, and it serves every decode-only step."""
    from engine import EngineConfig, LLMEngine, SamplingParams, load_model, model_runner
    from engine.attention import AttentionBackend
    from tests.gguf_helpers import write_gguf

    path = tmp_path / "tiny.gguf"
    write_gguf(path, "llama", qtype="Q4_0", embed_qtype="Q8_0")  # q4 layers, a q8 tied head
    loaded = load_model(path, quantization="auto")
    shared = list(range(3, 135))  # 33 blocks of 4
    calls = []
    decode_op = cpu_ops.llama_decode
    monkeypatch.setattr(cpu_ops, "llama_decode", lambda *a: calls.append(1) or decode_op(*a))

    def run(prompts: list[list[int]], n: int = 1) -> tuple[list[torch.Tensor], list[list[int]]]:
        logits = []
        compute = type(loaded.model).compute_logits
        monkeypatch.setattr(loaded.model, "compute_logits", lambda h: logits.append(compute(loaded.model, h)) or
                            logits[-1])
        # plain decode steps, one row per sequence (a speculative check's rows take the same call, counted apart)
        engine = LLMEngine(loaded, EngineConfig(model="tiny", block_size=4, num_blocks=64, speculative_config=None))
        engine.generate([shared], SamplingParams(max_tokens=1))  # its blocks in the prefix cache
        logits.clear()
        outs = engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True, n=n))
        return logits, [list(o.outputs[0].token_ids) for o in outs]

    gathers = []
    real_gather = AttentionBackend.decode_gather
    # scattered: read every prefix through its block list, as when its blocks are not consecutive
    mode = {"scattered": False}

    def record(self, meta):
        g = real_gather(self, meta)
        if g is not None and mode["scattered"]:
            g = g._replace(prefix_first=[-1] * len(g.prefix_first))
        gathers.append(g)
        return g

    monkeypatch.setattr(AttentionBackend, "decode_gather", record)
    monkeypatch.setattr(model_runner, "MIN_SHARED_KEYS", 64)  # a 33-block prefix shared by two rows qualifies
    monkeypatch.setattr(model_runner, "MIN_SAVED_KEYS", 64)
    cases = [([list(range(3, 14))], 1, 0), ([list(range(3, 14)), list(range(20, 31))], 1, 0),
             ([shared], 3, 3),  # three samples over the prompt's blocks: a prefix of every row
             ([shared + [5, 6], list(range(40, 50)), shared + [7, 8]], 1, 2)]  # cached blocks two rows of three share
    for (prompts, n, members), scattered in [(case, False) for case in cases] + [(cases[2], True), (cases[3], True)]:
        mode["scattered"] = scattered
        calls.clear()
        gathers.clear()
        one_call = run(prompts, n)
        assert len(calls) == 5  # every decode step, one call (the first token comes from the prefill)
        prefix_rows = {len(p) or len(g.counts) for g in gathers if g is not None for p in g.prefix_seqs}
        assert prefix_rows == ({members} if members else set())
        monkeypatch.setattr(cpu_ops, "whole_layers", False)
        modules = run(prompts, n)
        monkeypatch.setattr(cpu_ops, "whole_layers", True)
        assert one_call[1] == modules[1]
        assert all(torch.equal(a, b) for a, b in zip(one_call[0], modules[0], strict=True))


def test_the_one_call_decode_is_a_plug_in_the_kernels_choose(tmp_path) -> None:
    """A model describes its layers; the kernels take a decoder they cover (packed Llama layers) and
    say why they refuse the others (Qwen2's qkv bias, Qwen3's q/k norms, dense weights)."""
    from engine import load_model
    from kernels.cpu.fused_decode import DecoderSpec, FusedDecoder, unsupported
    from tests.gguf_helpers import write_gguf

    def decoder(arch: str, quantization: str, qtype: str = "Q4_0"):
        path = tmp_path / f"{arch}-{qtype}.gguf"
        if not path.exists():
            write_gguf(path, arch, qtype=qtype, embed_qtype="Q8_0")
        model = load_model(path, quantization=quantization).model.model
        spec = model.layers[0].spec()
        return model._fused(), unsupported(DecoderSpec([spec], model.norm.weight, spec.eps, 1.0, 1, 1))

    fused, why = decoder("llama", "auto")
    assert isinstance(fused, FusedDecoder) and why is None
    for arch, quantization, reason in [("qwen2", "auto", "has biases"), ("qwen3", "auto", "has q/k norms"),
                                       ("llama", "none", "not in our packed blocks")]:
        fused, why = decoder(arch, quantization)
        assert fused is None and reason in why, (arch, why)
