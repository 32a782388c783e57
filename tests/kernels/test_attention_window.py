"""Paged attention with a sliding window and soft-capped scores (Gemma 2/3, Mistral), both
backends, against test_attention's float64 dense reference (which masks and caps the same way)."""

from __future__ import annotations

import pytest
import torch

from kernels import paged_decode_attention
from tests.kernels.test_attention import (
    check,
    decode_lens,
    make_case,
    prefill_lens,
    run_decode,
    run_prefill,
    share_prefixes,
)

# (window, softcap): a window shorter than a block, one spanning blocks, one longer than any
# context (decode takes the unwindowed paths), capping alone, both
WINDOW_CASES = [(3, None), (20, None), (100, None), (None, 0.5), (9, 2.0)]
WINDOW_IDS = [f"w{w}-cap{c}" for w, c in WINDOW_CASES]


@pytest.mark.parametrize("window,softcap", WINDOW_CASES, ids=WINDOW_IDS)
@pytest.mark.parametrize("backend,dtype", [("torch", torch.float32), ("torch", torch.float16),
                                           ("triton", torch.float32), ("triton", torch.float16)],
                         ids=["torch-fp32", "torch-fp16", "triton-fp32", "triton-fp16"])
def test_window_and_softcap(backend: str, dtype: torch.dtype, window: int | None, softcap: float | None) -> None:
    """Decode and prefill (prompts, a chunk after a cached prefix, several query tiles) with keys
    out of the window masked and scores capped, against the float64 reference."""
    bs = 8
    case = make_case(decode_lens(bs), [1] * 5, 4, 1, 64, bs, dtype, seed=21)
    case.window, case.softcap = window, softcap
    check(run_decode(case, backend), case, f"decode {backend} window={window} softcap={softcap}")
    ctx, new = prefill_lens(bs)
    case = make_case(ctx, new, 4, 2, 64, bs, dtype, seed=22)
    case.window, case.softcap = window, softcap
    check(run_prefill(case, backend), case, f"prefill {backend} window={window} softcap={softcap}")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_window_long_contexts(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A window far behind the start: several Triton splits over the window alone, and (small
    budgets) torch key slices in which some query rows see nothing yet."""
    from kernels.pytorch import budget as torch_budget

    monkeypatch.setattr(torch_budget, "KV_BUDGET", 20_000)
    monkeypatch.setattr(torch_budget, "SCORE_BUDGET", 5_000)
    case = make_case([1500, 37, 777], [1] * 3, 3, 1, 80, 16, torch.float32, seed=23)
    case.window, case.softcap = 600, 30.0
    check(run_decode(case, backend), case, f"decode {backend} long window")
    case = make_case([900, 40, 300], [200, 40, 300], 4, 2, 64, 16, torch.float32, seed=24)
    case.window = 50
    check(run_prefill(case, backend), case, f"prefill {backend} long window")


def test_window_ignores_shared_prefixes_plan() -> None:
    """A windowed decode given shared-prefix groups (a plan built for the unwindowed layers of the
    same step) still attends only each sequence's window."""
    from kernels.pytorch import decode as torch_decode

    bs = 8
    ctx = [3 * bs + 1, 5 * bs + 2, 4 * bs - 1]
    case = make_case(ctx, [1] * 3, 4, 2, 64, bs, torch.float32, seed=25)
    prefixes = share_prefixes(case, [([0, 1, 2], 3)], bs)
    plan = torch_decode.plan_decode(case.block_tables, case.context_lens, bs, 2 * 64, torch.float32, prefixes)
    case.window = 10
    out = paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.context_lens,
                                 case.scale, shared_prefixes=prefixes, plan=plan, backend="torch", window=10)
    check(out, case, "decode torch window with a shared-prefix plan")
