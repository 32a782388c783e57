"""Sampler: per-row parameters in one vectorised batch, checked against straightforward references."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from engine.sampler import (
    Sampler,
    SamplingTensors,
    apply_repetition_penalty,
    apply_top_k_top_p,
    make_generator,
)
from engine.sequence import SamplingParams

sampler = Sampler()
# CUDA generators and kernels differ from the CPU ones, so check there too when a GPU is present.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(autouse=True, params=["kernel", "torch"])
def sampler_path(request, monkeypatch) -> str:
    """Every test runs on both routes: the C++ sample_rows (where this CPU has our kernels) and torch's ops."""
    from kernels.cpu import ops as cpu_ops

    if request.param == "kernel":
        if not cpu_ops.supported_cpu():
            pytest.skip(f"no CPU kernels here: {cpu_ops.unavailable_reason()}")
        assert cpu_ops.available(), cpu_ops.unavailable_reason()
    else:
        monkeypatch.setattr(cpu_ops, "use_fused", lambda t: False)
    return request.param


def sample(logits, params, generators=None, seen=None):
    generators = generators if generators is not None else [None] * len(params)
    st = SamplingTensors.build(params, generators, logits.device)
    return sampler(logits, st, seen)


def test_greedy_is_argmax_and_fast_path_leaves_logits_alone():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    before = logits.clone()
    st = SamplingTensors.build([SamplingParams()] * 6, [None] * 6, "cpu")
    assert st.all_greedy and not (st.do_top_k or st.do_top_p or st.do_min_p or st.do_penalties)
    out = sampler(logits, st)
    assert out.dtype == torch.int64 and out.shape == (6,)
    assert torch.equal(out, logits.argmax(-1))
    assert torch.equal(logits, before)


@pytest.mark.parametrize("temperature", [0.05, 1.0, 3.0, 100.0])
def test_top_k_1_is_greedy_at_any_temperature(temperature):
    torch.manual_seed(1)
    logits = torch.randn(8, 100)
    params = [SamplingParams(temperature=temperature, top_k=1)] * 8
    for _ in range(5):
        assert torch.equal(sample(logits, params), logits.argmax(-1))


def test_tiny_top_p_keeps_only_the_top_token():
    torch.manual_seed(2)
    logits = torch.randn(8, 100) * 0.1  # nearly flat: without the filter draws would vary a lot
    params = [SamplingParams(temperature=1.0, top_p=1e-6)] * 8
    for _ in range(5):
        assert torch.equal(sample(logits, params), logits.argmax(-1))


def reference_top_k_top_p(row: list[float], k: int, p: float) -> set[int]:
    """Tokens kept for one row: the k best, then the smallest best-first set with mass >= p."""
    order = sorted(range(len(row)), key=lambda i: -row[i])
    if k:
        order = order[:k]
    m = max(row[i] for i in order)
    weights = [math.exp(row[i] - m) for i in order]
    total, mass, kept = sum(weights), 0.0, []
    for i, w in zip(order, weights):
        kept.append(i)
        mass += w / total
        if mass >= p:
            break
    return set(kept)


def test_top_k_top_p_masks_match_reference():
    torch.manual_seed(3)
    rows = 24
    logits = torch.randn(rows, 40) * 2
    top_ks = torch.tensor([[0, 1, 5, 17, 40, 100][i % 6] for i in range(rows)])
    top_ps = torch.tensor([[1.0, 0.9, 0.5, 0.2][i % 4] for i in range(rows)])
    for ks, ps in [(top_ks, None), (None, top_ps), (top_ks, top_ps)]:
        masked = apply_top_k_top_p(logits, ks, ps)
        for r in range(rows):
            k = int(ks[r]) if ks is not None else 0
            p = float(ps[r]) if ps is not None else 1.0
            kept = set(torch.nonzero(masked[r] > float("-inf")).flatten().tolist())
            assert kept == reference_top_k_top_p(logits[r].tolist(), k, p), (r, k, p)
            assert torch.equal(masked[r][list(kept)], logits[r][list(kept)])  # kept logits untouched


def test_min_p_filters_tokens_below_the_fraction_of_the_top_one():
    probs = torch.tensor([0.5, 0.3, 0.12, 0.06, 0.02])
    logits = probs.log().expand(4000, -1).contiguous()
    params = [SamplingParams(temperature=1.0, min_p=0.2)] * 4000  # threshold 0.1: tokens 0-2 survive
    torch.manual_seed(4)
    counts = torch.bincount(sample(logits, params), minlength=5)
    assert counts[3] == 0 and counts[4] == 0
    kept = probs[:3] / probs[:3].sum()
    assert torch.allclose(counts[:3] / 4000, kept, atol=0.03)


def reference_repetition_penalty(logits: torch.Tensor, seen: list[list[int]], penalties: list[float]):
    out = logits.clone()
    for r, (ids, p) in enumerate(zip(seen, penalties)):
        for t in set(ids):
            v = out[r, t].item()
            out[r, t] = v / p if v > 0 else v * p
    return out


def test_repetition_penalty_matches_per_row_reference():
    torch.manual_seed(5)
    logits = torch.randn(5, 30) * 3
    seen = [[1, 2, 2, 7, 29], [], [0, 0, 0], list(range(0, 30, 3)) + [3, 6], [5, 4]]
    penalties = [1.3, 2.0, 0.7, 1.1, 1.0]
    got = apply_repetition_penalty(logits, seen, torch.tensor(penalties))
    assert torch.allclose(got, reference_repetition_penalty(logits, seen, penalties))
    # Through the sampler: greedy rows pick the argmax of the penalised logits (HF semantics).
    params = [SamplingParams(repetition_penalty=p) for p in penalties]
    st = SamplingTensors.build(params, [None] * 5, "cpu")
    assert st.all_greedy and st.do_penalties
    expected = reference_repetition_penalty(logits, seen, penalties).argmax(-1)
    assert torch.equal(sampler(logits, st, seen), expected)
    with pytest.raises(ValueError):
        sampler(logits, st, None)


def test_repetition_penalty_steers_away_from_a_repeated_token():
    logits = torch.tensor([[2.0, 1.9, -1.0]])
    out = sample(logits, [SamplingParams(repetition_penalty=1.5)], seen=[[0]])
    assert out.item() == 1


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# 99.99th percentile of chi-square with 5 degrees of freedom: a correct sampler fails ~1 in 10^4 seeds.
CHI2_DF5_LIMIT = 25.7


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_sampling_matches_softmax(temperature, device):
    base = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
    draws = 20000
    logits = base.expand(draws, -1).contiguous().to(device)
    target = torch.softmax(base / temperature, -1)
    torch.manual_seed(6)
    counts = torch.bincount(sample(logits, [SamplingParams(temperature=temperature)] * draws), minlength=6).cpu()
    assert chi_square(counts.double(), target.double()) < CHI2_DF5_LIMIT
    # A wrong temperature is rejected by the same test, so it has power.
    wrong = torch.softmax(base / (temperature * 1.3), -1)
    assert chi_square(counts.double(), wrong.double()) > CHI2_DF5_LIMIT


def test_seeded_rows_sample_the_same_distribution():
    base = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
    draws = 3000
    logits = base.expand(draws, -1).contiguous()
    gens = [make_generator(1234, i, "cpu") for i in range(draws)]
    counts = torch.bincount(sample(logits, [SamplingParams(temperature=1.0)] * draws, gens), minlength=6)
    assert chi_square(counts.double(), torch.softmax(base, -1).double()) < CHI2_DF5_LIMIT


def run_steps(rows: list[tuple[SamplingParams, torch.Generator | None]], logits_per_step, steps=12):
    params = [p for p, _ in rows]
    gens = [g for _, g in rows]
    return torch.stack([sample(logits_per_step(s, len(rows)), params, gens) for s in range(steps)], 1)


@pytest.mark.parametrize("device", DEVICES)
def test_same_seed_same_tokens_whatever_the_batch(device):
    vocab = 1000
    step_logits = [torch.randn(vocab, generator=torch.Generator().manual_seed(s)) for s in range(12)]
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=7)

    def logits_for(position):
        # The seeded row's logits at `position`, random logits elsewhere.
        def build(step, batch):
            out = torch.randn(batch, vocab, device=device)
            out[position] = step_logits[step]
            return out

        return build

    alone = run_steps([(seeded, make_generator(7, 0, device))], logits_for(0))[0]
    torch.manual_seed(99)  # the default generator's state must not matter either
    batch = [
        (SamplingParams(temperature=0.8), None),
        (SamplingParams(), None),  # greedy
        (seeded, make_generator(7, 0, device)),
        (SamplingParams(temperature=1.0, seed=8), make_generator(8, 0, device)),
    ]
    mixed = run_steps(batch, logits_for(2))[2]
    assert torch.equal(alone, mixed)
    assert len(set(alone.tolist())) > 3  # really sampled, not a constant


def test_sample_index_gives_a_distinct_deterministic_stream():
    assert make_generator(None, 0, "cpu") is None
    vocab = 1000
    torch.manual_seed(10)
    fixed = torch.randn(vocab)
    rows = [(SamplingParams(temperature=1.0, seed=3), make_generator(3, i, "cpu")) for i in (0, 1, 0)]
    out = run_steps(rows, lambda step, batch: fixed.expand(batch, -1).contiguous())
    assert torch.equal(out[0], out[2])
    assert not torch.equal(out[0], out[1])
    other_seed = run_steps([(rows[0][0], make_generator(4, 0, "cpu"))], lambda s, b: fixed[None])[0]
    assert not torch.equal(out[0], other_seed)


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_greedy_and_sampled_rows(device):
    torch.manual_seed(11)
    logits = torch.randn(6, 200, device=device) * 0.3  # flat enough that sampled rows rarely hit the argmax
    params = [SamplingParams(temperature=0.0 if r % 2 == 0 else 1.0) for r in range(6)]
    gens = [make_generator(5, r, device) if r == 3 else None for r in range(6)]
    outs = torch.stack([sample(logits, params, gens) for _ in range(10)])
    greedy = logits.argmax(-1)
    for r in range(6):
        if r % 2 == 0:
            assert (outs[:, r] == greedy[r]).all()
        else:
            assert len(set(outs[:, r].tolist())) > 3


def test_build_flags_ignore_greedy_rows_and_only_mark_needed_stages():
    params = [
        SamplingParams(top_k=5, top_p=0.5, min_p=0.1),  # greedy: its filters are irrelevant
        SamplingParams(temperature=0.7, seed=1),
    ]
    st = SamplingTensors.build(params, [make_generator(0, 0, "cpu"), make_generator(1, 0, "cpu")], "cpu")
    assert not (st.do_top_k or st.do_top_p or st.do_min_p or st.do_penalties)
    assert st.any_greedy and not st.all_greedy and not st.any_unseeded
    assert st.generators[0] is None and st.generators[1] is not None
    assert st.temperatures.tolist() == pytest.approx([1.0, 0.7])
    st = SamplingTensors.build([SamplingParams(temperature=1.0, top_k=3)], [None], "cpu")
    assert st.do_top_k and not st.do_top_p and st.any_unseeded


@pytest.mark.parametrize("kernel", [True, False], ids=["cpu-kernel", "two-stage"])
def test_argmax_matches_torch_including_ties_and_nan(kernel: bool, monkeypatch) -> None:
    from engine import sampler
    from kernels.cpu import ops as cpu_ops

    if kernel:  # as in tests/kernels: only a CPU without AVX2 goes without; on x86 a failed build fails
        if not cpu_ops.supported_cpu():
            pytest.skip("the kernels need an x86 CPU with AVX2")
        assert cpu_ops.available(), cpu_ops.unavailable_reason()
    monkeypatch.setattr(cpu_ops, "use_fused", lambda t: kernel)
    g = torch.Generator().manual_seed(0)
    for vocab in (3, 1000, 4099, 49152, 50257):
        x = torch.randn(13, vocab, generator=g)
        x[3, 1] = x[3, vocab - 1] = x[3].max() + 1  # a tie: the first index wins, as in torch
        x[5, :] = 0.0  # all equal
        x[6, :] = float("-inf")
        x[7, vocab // 2] = float("inf")
        if kernel:  # NaN counts as the maximum in torch (the two-stage path's amax does not promise it)
            x[8, vocab - 1] = x[8, vocab // 3] = float("nan")
        assert torch.equal(sampler.argmax(x), x.argmax(dim=-1))


def chi_square_limit(df: int) -> float:
    """The chi-square distribution's 99.99th percentile (Wilson-Hilferty): a correct sampler fails ~1 in 10^4."""
    z = 3.719
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def hf_distribution(row: torch.Tensor, seen: list[int], p: SamplingParams) -> torch.Tensor:
    """The next-token distribution transformers' own logits processors give, in float64, in generate()'s order."""
    from transformers import (
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    scores = row.double()[None].clone()
    ids = torch.tensor([seen or [0]])
    if p.repetition_penalty != 1.0 and seen:
        scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, scores)
    warpers = [TemperatureLogitsWarper(p.temperature)]
    if p.top_k:
        warpers.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        warpers.append(TopPLogitsWarper(p.top_p))
    if p.min_p:
        warpers.append(MinPLogitsWarper(p.min_p))
    for w in warpers:
        scores = w(ids, scores)
    return scores.softmax(-1)[0]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=12),
    SamplingParams(temperature=1.3, top_k=20, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=0.9, min_p=0.1, repetition_penalty=1.3),
    SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.1),
], ids=["t0.7", "t0.7-p0.9", "k12", "t1.3-k20-p0.8-minp", "minp-penalty", "t0.7-p0.9-penalty"])
def test_draws_follow_transformers_logits_processors(params: SamplingParams) -> None:
    """Every stage and their order against transformers' processors: the kept tokens exactly, and the
    draws' frequencies by a chi-square test (which rejects a temperature 10% off, so it has power)."""
    vocab, draws = 48, 40000
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(21)) * 1.5
    seen = [3, 7, 7, 11, 30]  # a repeat: penalised once, as HF's gather/scatter does
    want = hf_distribution(row, seen, params)
    torch.manual_seed(22)
    logits = row.expand(draws, -1).contiguous()
    got = sample(logits, [params] * draws, seen=[seen] * draws)
    assert torch.equal(logits[0], row)  # the caller's logits are left alone
    counts = torch.bincount(got, minlength=vocab).double()
    kept = want > 0
    assert counts[~kept].sum() == 0, (counts[~kept].nonzero().flatten().tolist(), kept.nonzero().flatten().tolist())
    df = int(kept.sum()) - 1
    assert chi_square(counts[kept], want[kept]) < chi_square_limit(df)
    off = hf_distribution(row, seen, dataclasses.replace(params, temperature=params.temperature * 1.1))
    assert chi_square(counts[kept], off[kept] / off[kept].sum()) > chi_square_limit(df)


def test_kernel_and_torch_routes_pick_the_same_token_for_the_same_draw(monkeypatch) -> None:
    """At a real vocabulary's size, the C++ route and torch's give the same token for the same uniform
    (their sums round apart only where a draw falls within ~1e-6 of a boundary)."""
    from engine import sampler as sampler_module
    from kernels.cpu import ops as cpu_ops

    monkeypatch.undo()  # this test picks the routes itself
    if not cpu_ops.supported_cpu():
        pytest.skip(f"no CPU kernels here: {cpu_ops.unavailable_reason()}")
    g = torch.Generator().manual_seed(5)
    rows, vocab = 64, 49152
    logits = torch.randn(rows, vocab, generator=g) * 4
    params = [SamplingParams(temperature=t, top_p=p, top_k=k, min_p=m, repetition_penalty=r)
              for t, p, k, m, r in [(0.7, 0.9, 0, 0.0, 1.0), (1.0, 1.0, 0, 0.0, 1.1), (0.8, 0.95, 40, 0.0, 1.0),
                                    (1.0, 1.0, 0, 0.05, 1.0), (0.0, 1.0, 0, 0.0, 1.1), (0.6, 0.5, 0, 0.02, 1.2),
                                    (1.5, 0.99, 0, 0.0, 1.0), (0.3, 1.0, 100, 0.0, 1.0)]] * (rows // 8)
    seen = [torch.randint(0, vocab, (200,), generator=g).tolist() for _ in range(rows)]
    st = SamplingTensors.build(params, [make_generator(9, r, "cpu") for r in range(rows)], "cpu")
    kernel = sampler(logits, st, seen)
    st = SamplingTensors.build(params, [make_generator(9, r, "cpu") for r in range(rows)], "cpu")
    reference = sampler_module.Sampler._sample_torch(logits, st, seen)
    assert cpu_ops.use_fused(logits)
    assert (kernel == reference).float().mean() >= 0.98, (kernel != reference).nonzero().flatten().tolist()
