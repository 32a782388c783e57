"""Memory budgets of the PyTorch paged-attention path (decode and prefill share them).

Read as ``torch_budget.KV_BUDGET`` at call time, never imported by value, so that one override
(a test's monkeypatch) reaches both paths.
"""

from __future__ import annotations

# Elements of one gathered K+V slice, and of one fp32 score slice. They keep CPU buffers under
# glibc's mmap threshold (32 MiB), past which every allocation page-faults afresh, while leaving
# slices long enough that the per-op overhead is amortised.
KV_BUDGET = 1 << 22
SCORE_BUDGET = 1 << 22
