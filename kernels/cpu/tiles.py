"""How wide a one-row tile runs in the avx512 variant: 256-bit vectors (tile<8, 1>) or 512 (tile_wide).

Both give the same bits (quant.h), so the choice is speed alone, and the CPU's flags cannot make it: on
Intel's server cores 512-bit operations run at full width (q4 at one row 1.3-1.6x faster), on Zen 4 each
is split in two and the wider fold measured slower. So it is timed once, when the kernels load, on a
cache-resident q4 weight (a few milliseconds), and ROSECHAT_CPU_TILES=256|512 forces it.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from kernels.cpu.layouts import pack_q4, pack_scales

ENV = "ROSECHAT_CPU_TILES"
MARGIN = 0.95  # 512-bit tiles only where they save at least 5 %: a noisy probe leaves the proven width


def set_bits(bits: int) -> int:
    """Ask for `bits` (256 or 512); returns the width now in use (always 256 outside the avx512 variant)."""
    return int(torch.ops.rosechat_quant.tile_bits(bits))


def probe(rounds: int = 5, calls: int = 8) -> tuple[float, float]:
    """Median call times (µs) of a 1024 x 1024 q4 linear at one row, 256- then 512-bit, the best of
    `rounds` interleaved rounds (a burst of other load hits both alike)."""
    gen = torch.Generator().manual_seed(0)
    n = k = 1024
    qs = pack_q4(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen))
    d = pack_scales(torch.rand(n, k // 32, generator=gen)).half()
    m = pack_scales(torch.rand(n, k // 32, generator=gen)).half()
    x = torch.randn(1, k, generator=gen)
    best = {256: float("inf"), 512: float("inf")}
    for _ in range(rounds):
        for bits in best:
            set_bits(bits)
            torch.ops.rosechat_quant.q4_linear(x, qs, d, m)
            times = []
            for _ in range(calls):
                t0 = time.perf_counter()
                torch.ops.rosechat_quant.q4_linear(x, qs, d, m)
                times.append(time.perf_counter() - t0)
            best[bits] = min(best[bits], statistics.median(times))
    return best[256] * 1e6, best[512] * 1e6


def choose(isa: str) -> str:
    """Set the width for the loaded variant `isa`; returns why, for build_status ("" where there is no
    choice). A forced width the variant cannot run is a ValueError."""
    forced = os.environ.get(ENV, "")
    if forced and forced not in ("256", "512"):
        raise ValueError(f"{ENV}={forced!r}: choose 256 or 512")
    if isa != "avx512":
        if forced == "512":
            raise ValueError(f"{ENV}=512: the {isa} kernels have 256-bit tiles only")
        return ""
    if forced:
        return f"{set_bits(int(forced))}-bit tiles (forced by {ENV})"
    narrow, wide = probe()
    bits = set_bits(512 if wide < MARGIN * narrow else 256)
    return f"{bits}-bit tiles (timed: {narrow:.0f} µs at 256, {wide:.0f} at 512)"
