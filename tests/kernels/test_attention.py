"""Paged decode / prefill attention, both backends, against an independent float64 dense attention.

Every case builds a pool whose blocks are handed out in shuffled order, fills only the slots
inside each sequence's context, and poisons everything else (unused blocks, the tail of partial
last blocks, the blocks that block-table padding points at) with NaN: a kernel that lets one
poisoned value into its result fails. Triton runs compiled on CUDA, interpreted on CPU (slow, so
its cases are a hand-picked cover instead of a cartesian product).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

import kernels
from kernels import paged_decode_attention, paged_prefill_attention

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# (atol, rtol): fp16/bf16 outputs are rounded to 11/8 significant bits
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
HEADS = [(4, 4), (4, 2), (6, 2), (8, 2), (8, 1)]  # GQA ratio 1, 2, 3, 4, 8


@dataclass
class Case:
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    q_lens: list[int]
    scale: float
    window: int | None = None  # sliding window: a query at p sees keys > p - window
    softcap: float | None = None  # scores = tanh(s / softcap) * softcap


def make_case(
    ctx_lens: list[int],
    q_lens: list[int],
    hq: int,
    hkv: int,
    d: int,
    bs: int,
    dtype: torch.dtype,
    seed: int = 0,
    pad_block: int | None = None,
) -> Case:
    """pad_block: what block-table padding holds (default: ids of poisoned blocks)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-c // bs) for c in ctx_lens]
    n_spare = 3
    num_blocks = sum(need) + n_spare
    perm = torch.randperm(num_blocks, generator=gen)
    spare = perm[sum(need) :]
    width = max(need) + 2
    k_cache = torch.full((num_blocks, bs, hkv, d), float("nan"))
    v_cache = torch.full((num_blocks, bs, hkv, d), float("nan"))
    tables = torch.empty(len(ctx_lens), width, dtype=torch.int32)
    used = 0
    for b, c in enumerate(ctx_lens):
        tables[b, : need[b]] = perm[used : used + need[b]]
        used += need[b]
        pad = spare[torch.randint(n_spare, (width - need[b],), generator=gen)]
        tables[b, need[b] :] = pad if pad_block is None else pad_block
        pos = torch.arange(c)
        blocks = tables[b, pos // bs].long()
        k_cache[blocks, pos % bs] = torch.randn(c, hkv, d, generator=gen)
        v_cache[blocks, pos % bs] = torch.randn(c, hkv, d, generator=gen)
    assert torch.isnan(v_cache).any()  # the poison is really there
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    q = torch.randn(int(cu[-1]), hq, d, generator=gen)
    return Case(
        q=q.to(DEVICE, dtype),
        k_cache=k_cache.to(DEVICE, dtype),
        v_cache=v_cache.to(DEVICE, dtype),
        block_tables=tables.to(DEVICE),
        context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE),
        cu_seqlens_q=cu.to(DEVICE),
        q_lens=list(q_lens),
        scale=1 / math.sqrt(d),
    )


def dense_attention(case: Case) -> torch.Tensor:
    """float64 causal attention, each sequence's K/V gathered slot by slot through its table."""
    k_cache, v_cache = case.k_cache.cpu().double(), case.v_cache.cpu().double()
    tables, q = case.block_tables.cpu(), case.q.cpu().double()
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    hq = q.shape[1]
    kv_head = torch.arange(hq) // (hq // hkv)
    outs, start = [], 0
    for b, (c, n) in enumerate(zip(case.context_lens.tolist(), case.q_lens, strict=True)):
        pos = torch.arange(c)
        blocks = tables[b, pos // bs].long()
        k = k_cache[blocks, pos % bs][:, kv_head]  # [c, Hq, D]
        v = v_cache[blocks, pos % bs][:, kv_head]
        s = torch.einsum("qhd,khd->hqk", q[start : start + n], k) * case.scale
        if case.softcap:
            s = torch.tanh(s / case.softcap) * case.softcap
        q_pos = torch.arange(c - n, c)
        s = s.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        if case.window:
            s = s.masked_fill(pos[None, None, :] <= q_pos[None, :, None] - case.window, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v))
        start += n
    return torch.cat(outs)


def check(out: torch.Tensor, case: Case, label: str) -> float:
    ref = dense_attention(case)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype and out.device == case.q.device
    err = (out.cpu().double() - ref).abs().max().item()
    print(f"{label}: max abs err {err:.2e}")
    atol, rtol = TOL[case.q.dtype]
    torch.testing.assert_close(out.cpu().double(), ref, atol=atol, rtol=rtol)
    return err


def run_decode(case: Case, backend: str) -> torch.Tensor:
    return paged_decode_attention(
        case.q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, case.scale, backend=backend,
        window=case.window, softcap=case.softcap,
    )


def run_prefill(case: Case, backend: str) -> torch.Tensor:
    return paged_prefill_attention(
        case.q,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.cu_seqlens_q,
        case.context_lens,
        case.scale,
        backend=backend,
        window=case.window,
        softcap=case.softcap,
    )


def decode_lens(bs: int) -> list[int]:
    return [1, bs - 1, bs, bs + 1, 5 * bs + 3]


def prefill_lens(bs: int) -> tuple[list[int], list[int]]:
    """(context, new tokens): whole prompts of boundary lengths, a cached prefix with a few new
    tokens, one new token after a full block, and a prompt spanning several query tiles."""
    ctx = [1, bs - 1, bs, bs + 1, 3 * bs + 2, 2 * bs + 1, 70 + bs]
    new = [1, bs - 1, bs, bs + 1, 5, 1, 70]
    return ctx, new


# ---- PyTorch backend: cheap, so every ratio x head dim x block size in fp32, a cover in fp16 ----

TORCH_CASES = [(hq, hkv, d, bs, torch.float32) for hq, hkv in HEADS for d in (64, 128, 80) for bs in (8, 16, 32)] + [
    (hq, hkv, d, (8, 16, 32)[i % 3], torch.float16) for i, (hq, hkv) in enumerate(HEADS) for d in (64, 128, 80)
]
TORCH_IDS = [f"h{hq}/{hkv}-d{d}-bs{bs}-{str(dt)[6:]}" for hq, hkv, d, bs, dt in TORCH_CASES]


@pytest.mark.parametrize("hq,hkv,d,bs,dtype", TORCH_CASES, ids=TORCH_IDS)
def test_decode_torch(hq: int, hkv: int, d: int, bs: int, dtype: torch.dtype) -> None:
    case = make_case(decode_lens(bs), [1] * 5, hq, hkv, d, bs, dtype, seed=hq * d + bs)
    check(run_decode(case, "torch"), case, f"decode torch {dtype}")


@pytest.mark.parametrize("hq,hkv,d,bs,dtype", TORCH_CASES, ids=TORCH_IDS)
def test_prefill_torch(hq: int, hkv: int, d: int, bs: int, dtype: torch.dtype) -> None:
    ctx, new = prefill_lens(bs)
    case = make_case(ctx, new, hq, hkv, d, bs, dtype, seed=hq * d + bs)
    check(run_prefill(case, "torch"), case, f"prefill torch {dtype}")


@pytest.mark.parametrize("kv_budget,score_budget", [(20_000, 5_000), (60_000, 30_000)])
def test_torch_chunking_matches_single_chunk(
    monkeypatch: pytest.MonkeyPatch, kv_budget: int, score_budget: int
) -> None:
    """Small budgets split the torch path into several sequence chunks (one sequence each, or a
    few padded together), query-row steps and key slices (online softmax): same result."""
    from kernels.pytorch import budget as torch_budget
    from kernels.pytorch import prefill as torch_prefill

    ctx, new = prefill_lens(16)
    case = make_case(ctx + [300], new + [200], 6, 2, 64, 16, torch.float32, seed=7)
    whole = run_prefill(case, "torch")
    chunk_sizes: list[int] = []
    chunk = torch_prefill._attend_chunk
    monkeypatch.setattr(torch_prefill, "_attend_chunk", lambda *a: chunk_sizes.append(len(a[4])) or chunk(*a))
    gathers: list[int] = []
    gather = torch_prefill._gather_kv
    monkeypatch.setattr(torch_prefill, "_gather_kv", lambda *a: gathers.append(a[4]) or gather(*a))
    monkeypatch.setattr(torch_budget, "KV_BUDGET", kv_budget)
    monkeypatch.setattr(torch_budget, "SCORE_BUDGET", score_budget)
    chunked = run_prefill(case, "torch")
    assert any(k0 > 0 for k0 in gathers)  # some keys came in a later slice: online softmax ran
    # every sequence once; the long ones alone, short ones padded together
    assert sum(chunk_sizes) == len(ctx) + 1 and 1 in chunk_sizes and max(chunk_sizes) > 1, chunk_sizes
    check(chunked, case, "prefill torch chunked")
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-6)


def test_torch_decode_chunking_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    from kernels.pytorch import budget as torch_budget

    case = make_case(decode_lens(8) + [200], [1] * 6, 4, 2, 64, 8, torch.float32, seed=8)
    whole = run_decode(case, "torch")
    monkeypatch.setattr(torch_budget, "KV_BUDGET", 2 * 200 * 2 * 2 * 64)  # two sequences per chunk
    chunked = run_decode(case, "torch")
    check(chunked, case, "decode torch chunked")
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-6)


def share_prefixes(case: Case, groups: list[tuple[list[int], int]], bs: int) -> list[kernels.SharedPrefix]:
    """Point each group's block tables at its first member's leading blocks (copy-on-write
    sharing as the block manager builds it) and poison the blocks that no table uses any more."""
    tables = case.block_tables.cpu()
    prefixes = []
    for members, nblocks in groups:
        for b in members[1:]:
            orphans = tables[b, :nblocks].long()
            tables[b, :nblocks] = tables[members[0], :nblocks]
            case.k_cache[orphans.to(DEVICE)] = float("nan")
            case.v_cache[orphans.to(DEVICE)] = float("nan")
        prefixes.append(kernels.SharedPrefix(torch.tensor(members, device=DEVICE),
                                             tables[members[0], :nblocks].long().to(DEVICE)))
    case.block_tables = tables.to(DEVICE)
    return prefixes


def renumber_first(case: Case, blocks: list[int]) -> None:
    """Renumber the pool's blocks so that `blocks` become 0, 1, 2, ... (contents and tables follow)."""
    nb = case.k_cache.shape[0]
    order = blocks + [b for b in range(nb) if b not in blocks]  # order[new id] = old id
    new_id = torch.empty(nb, dtype=torch.long)
    new_id[torch.tensor(order)] = torch.arange(nb)
    old = torch.tensor(order, device=DEVICE)
    case.k_cache, case.v_cache = case.k_cache[old], case.v_cache[old]
    case.block_tables = new_id.to(DEVICE)[case.block_tables.long()].to(torch.int32)


@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("dtype,consecutive", [(torch.float32, False), (torch.float32, True), (torch.float16, False)])
def test_decode_shared_prefixes(monkeypatch: pytest.MonkeyPatch, hq: int, hkv: int, dtype: torch.dtype,
                                consecutive: bool) -> None:
    """Cascade decode: two groups share leading blocks (one member's own part is a single token),
    one sequence shares nothing. Equal to dense attention through the tables; fp16 ignores the
    groups (it takes the sliced path), fp32 attends each prefix once, read in place when its blocks
    are consecutive in the pool."""
    from kernels.pytorch import decode as torch_decode

    bs = 8
    ctx = [3 * bs + 1, 5 * bs + 2, 4 * bs - 1, 2 * bs + 5, bs + 3, 2 * bs]
    case = make_case(ctx, [1] * len(ctx), hq, hkv, 64, bs, dtype, seed=hq + hkv)
    if consecutive:
        renumber_first(case, case.block_tables[1, :3].tolist())
    prefixes = share_prefixes(case, [([1, 0, 2], 3), ([4, 5], 1)], bs)
    plan = torch_decode.plan_decode(case.block_tables, case.context_lens, bs, hkv * 64, dtype, prefixes)
    assert (plan.prefixes[0].first_block == 0) == consecutive
    calls: list[tuple[int, ...]] = []
    lse = torch_decode._attention_lse
    monkeypatch.setattr(torch_decode, "_attention_lse", lambda q, *a: calls.append(tuple(q.shape)) or lse(q, *a))
    out = paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.context_lens,
                                 case.scale, shared_prefixes=prefixes, backend="torch")
    check(out, case, f"decode torch shared prefixes {dtype}")
    if dtype == torch.float32 and DEVICE.type == "cpu":
        g = hq // hkv  # the prefix calls stack every member's query heads: [1, Hkv, members * G, D]
        assert (1, hkv, 3 * g, 64) in calls and (1, hkv, 2 * g, 64) in calls, calls


# ---- Triton backend (interpreted on CPU): a cover of ratios, head dims, block sizes, dtypes ----

TRITON_CASES = [
    # hq, hkv, d, bs, dtype
    (4, 4, 64, 16, torch.float32),
    (4, 2, 128, 8, torch.float16),
    (6, 2, 80, 16, torch.float32),
    (8, 2, 96, 32, torch.float16),
    (8, 1, 128, 16, torch.float32),
    (3, 1, 64, 8, torch.float16),
    (2, 1, 256, 16, torch.float16),
]
TRITON_IDS = [f"h{hq}/{hkv}-d{d}-bs{bs}-{str(dt)[6:]}" for hq, hkv, d, bs, dt in TRITON_CASES]


@pytest.mark.parametrize("hq,hkv,d,bs,dtype", TRITON_CASES, ids=TRITON_IDS)
def test_decode_triton(hq: int, hkv: int, d: int, bs: int, dtype: torch.dtype) -> None:
    case = make_case(decode_lens(bs), [1] * 5, hq, hkv, d, bs, dtype, seed=hq * d + bs)
    check(run_decode(case, "triton"), case, f"decode triton {dtype}")


@pytest.mark.parametrize("hq,hkv,d,bs,dtype", TRITON_CASES, ids=TRITON_IDS)
def test_prefill_triton(hq: int, hkv: int, d: int, bs: int, dtype: torch.dtype) -> None:
    ctx, new = prefill_lens(bs)
    case = make_case(ctx, new, hq, hkv, d, bs, dtype, seed=hq * d + bs)
    check(run_prefill(case, "triton"), case, f"prefill triton {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_decode_long_multi_split(backend: str, dtype: torch.dtype) -> None:
    """Long contexts: the Triton path picks several splits and merges them."""
    from kernels.triton.decode import choose_num_splits

    case = make_case([1500, 37, 777], [1] * 3, 3, 1, 80, 16, dtype, seed=11)
    max_ctx = case.block_tables.shape[1] * 16
    assert choose_num_splits(3, 1, max_ctx, DEVICE) > 1
    check(run_decode(case, backend), case, f"decode {backend} {dtype} long")


@pytest.mark.parametrize("num_splits", [1, 2, 5, 64])
def test_decode_triton_forced_splits(num_splits: int) -> None:
    """Explicit split counts, including more splits than a short sequence has tiles."""
    from kernels.triton.decode import paged_decode_attention as triton_decode

    case = make_case([600, 1, 65, 129], [1] * 4, 4, 2, 64, 16, torch.float32, seed=num_splits)
    out = triton_decode(
        case.q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, case.scale, num_splits
    )
    check(out, case, f"decode triton splits={num_splits}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_prefill_long_cached_prefix(backend: str, dtype: torch.dtype) -> None:
    """A few new tokens after a cached prefix of thousands, next to a fresh prompt and a sequence
    with no new tokens at all (its tile ids must map to nothing)."""
    case = make_case([3000, 40, 9, 1030], [8, 40, 0, 70], 4, 2, 64, 16, dtype, seed=5)
    check(run_prefill(case, backend), case, f"prefill {backend} {dtype} long prefix")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padding_never_read(backend: str) -> None:
    """Block-table padding holding out-of-range ids must not be dereferenced."""
    case = make_case([1, 17, 40], [1, 1, 1], 4, 2, 64, 8, torch.float32, seed=3, pad_block=10**6)
    check(run_decode(case, backend), case, f"decode {backend} oob padding")
    case = make_case([1, 17, 40], [1, 9, 40], 4, 2, 64, 8, torch.float32, seed=4, pad_block=10**6)
    check(run_prefill(case, backend), case, f"prefill {backend} oob padding")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_prefill_last_token_equals_decode(backend: str) -> None:
    """The last row of a whole-prompt prefill is exactly what decode computes for that token."""
    lens = [5, 33, 64]
    case = make_case(lens, lens, 6, 2, 64, 16, torch.float32, seed=9)
    last = case.cu_seqlens_q[1:].long() - 1
    pre = run_prefill(case, backend)[last]
    dec = paged_decode_attention(
        case.q[last],
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.context_lens,
        case.scale,
        backend=backend,
    )
    torch.testing.assert_close(pre, dec, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_strided_q(backend: str) -> None:
    """q as a view into a fused QKV projection (row stride > Hq * D), as models produce it."""
    case = make_case([7, 40], [7, 3], 4, 2, 64, 16, torch.float32, seed=6)
    fused = torch.randn(case.q.shape[0], 8, 64, device=DEVICE)
    fused[:, 2:6] = case.q
    case.q = fused[:, 2:6]
    assert not case.q.is_contiguous()
    check(run_prefill(case, backend), case, f"prefill {backend} strided q")
    last = case.cu_seqlens_q[1:].long() - 1
    fused_dec = torch.randn(2, 8, 64, device=DEVICE)
    fused_dec[:, 2:6] = case.q[last]
    dec = make_case([7, 40], [1, 1], 4, 2, 64, 16, torch.float32, seed=6)
    dec.q = fused_dec[:, 2:6]
    check(run_decode(dec, backend), dec, f"decode {backend} strided q")


def test_backend_dispatch() -> None:
    x = torch.zeros(1, device=DEVICE)
    assert kernels._use_triton(x, "triton") and not kernels._use_triton(x, "torch")
    assert kernels._use_triton(x, None) == (DEVICE.type == "cuda" and kernels.triton_status() == "compiled")
    case = make_case([3], [1], 2, 1, 64, 8, torch.float32)
    with pytest.raises(ValueError, match="backend"):
        run_decode(case, "cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 needs compiled Triton (CUDA)")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bf16_cuda(backend: str) -> None:
    case = make_case(decode_lens(16) + [2000], [1] * 6, 8, 2, 128, 16, torch.bfloat16, seed=1)
    check(run_decode(case, backend), case, f"decode {backend} bf16")
    ctx, new = prefill_lens(16)
    case = make_case(ctx + [2000], new + [100], 8, 2, 128, 16, torch.bfloat16, seed=2)
    check(run_prefill(case, backend), case, f"prefill {backend} bf16")


def test_the_pytorch_path_never_calls_our_cpp() -> None:
    """kernels/pytorch/ is the reference our C++ and Triton kernels are held to: it imports neither;
    kernels/__init__.py hands it our C++ attention where that runs."""
    import ast
    from pathlib import Path

    import kernels

    for module in (Path(kernels.__file__).parent / "pytorch").glob("*.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else (
                [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            assert not any(n.startswith(("kernels.cpu", "kernels.triton")) for n in names), (module.name, names)

