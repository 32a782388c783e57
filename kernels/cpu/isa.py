"""Which variant of our CPU kernels runs here: chosen once from the CPU's own flags (cpuid, as Linux
reports it), or forced with ROSECHAT_CPU_ISA=avx512|avx2|generic ("generic": torch's own ops, no C++).

As llama.cpp's ggml-cpu, each variant is compiled for its own ISA's flags alone (never the build
machine's) and picked at run time, so a build cached on one machine is never run by a CPU that lacks its instructions.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

ISAS = ("avx512", "avx2", "generic")  # best first
# The variants built from our C++ sources, one set of them compiled per ISA (the avx512 build's
# block sums take VNNI, quant.cpp). A CPU with AVX-512 but no VNNI (Skylake-X) runs avx2.
BUILT = tuple(isa for isa in ISAS if isa != "generic")
# cpuid flags (Linux names) each variant's code needs
NEEDS = {
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx2", "fma", "f16c"),
    "avx2": ("avx2", "fma", "f16c"),
    "generic": (),
}
# compiler flags of each variant: its ISA only, so its object runs on any CPU that has these
CFLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx2", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (empty where /proc/cpuinfo is not there: not Linux, not x86)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def runnable(flags: frozenset[str]) -> list[str]:
    """The variants this CPU can execute, best first ("generic" always)."""
    return [isa for isa in ISAS if all(f in flags for f in NEEDS[isa])]


def has_bf16(flags: frozenset[str]) -> bool:
    """Native bfloat16 math (AVX512_BF16 or AMX); elsewhere bf16 is emulated through float32."""
    return "avx512_bf16" in flags or "amx_bf16" in flags


@dataclass(frozen=True)
class IsaChoice:
    isa: str  # one of ISAS
    reason: str  # one line, for logs, the title and bench headers
    forced: bool = False  # by ROSECHAT_CPU_ISA: no other variant stands in if it cannot be built


def fallbacks(choice: IsaChoice, flags: frozenset[str] | None = None) -> list[IsaChoice]:
    """The variants to try, in order, where `choice` cannot be built (a compiler without AVX-512
    flags): the next built ones this CPU runs; none where the choice was forced."""
    if choice.forced:
        return []
    can = runnable(cpu_flags() if flags is None else flags)
    return [IsaChoice(isa, f"{isa} (the {choice.isa} kernels did not build)")
            for isa in can[can.index(choice.isa) + 1:] if isa in BUILT]


def choose(flags: frozenset[str] | None = None, forced: str | None = None) -> IsaChoice:
    """The variant to run. `flags`: the CPU's (tests fake them); `forced`: ROSECHAT_CPU_ISA's value
    when None. A forced variant this CPU cannot run is a ValueError."""
    flags = cpu_flags() if flags is None else flags
    forced = os.environ.get("ROSECHAT_CPU_ISA", "") if forced is None else forced
    can = runnable(flags)
    if forced:
        if forced not in ISAS:
            raise ValueError(f"ROSECHAT_CPU_ISA={forced!r}: choose one of {', '.join(ISAS)}")
        if forced not in can:
            missing = [f for f in NEEDS[forced] if f not in flags]
            raise ValueError(f"ROSECHAT_CPU_ISA={forced}: this CPU lacks {', '.join(missing)}")
        return IsaChoice(forced, f"{forced} (forced by ROSECHAT_CPU_ISA)", forced=True)
    if can[0] == "generic":
        return IsaChoice("generic", "generic: this CPU has no AVX2 (torch's own ops)")
    return IsaChoice(can[0], f"{can[0]} (from the CPU's flags)")
