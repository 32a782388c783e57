"""Build every ISA variant of our CPU kernels ahead, into the environment: `python -m kernels.cpu.build`
(`make setup` runs it, so no first launch waits on a compiler)."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path

from kernels.cpu import isa as cpu_isa
from kernels.cpu import ops as cpu_ops


def build_one(isa: str) -> None:
    """Build the `isa` variant (in a process of its own: building loads the library, and two variants
    register the same operators). A variant this CPU cannot run is compiled, not loaded: loading runs its
    static initialisers, compiled for that ISA (an AVX2 machine dies of SIGILL loading the avx512 one)."""
    import torch

    if isa not in cpu_isa.runnable(cpu_isa.cpu_flags()):
        torch.ops.load_library = lambda path: None  # this child process only builds
    where = cpu_ops.build_dir(isa)
    cpu_ops._compile(isa, where, where / "built")


def _prune(current: list[Path]) -> None:
    """Remove the environment's builds of older sources (each edit of a kernel leaves one behind).
    Only in the environment, which is this checkout's: the user cache may hold other checkouts'."""
    for root in {where.parent for where in current if where.is_relative_to(sys.prefix)}:
        for old in root.iterdir():
            if old.name.split("-")[0] in cpu_isa.ISAS and old.with_suffix("") not in current:
                shutil.rmtree(old) if old.is_dir() else old.unlink()


def main(argv: list[str]) -> int:
    from torch.utils import cpp_extension

    logging.basicConfig(level=logging.ERROR)
    if argv[:1] == ["--isa"]:
        build_one(argv[1])
        return 0
    if shutil.which(cpp_extension.get_cxx_compiler()) is None:
        print(f"no C++ compiler ({cpp_extension.get_cxx_compiler()}): torch's own CPU kernels will run")
        return 0
    failed = 0
    for isa in cpu_isa.BUILT:
        where, t0 = cpu_ops.build_dir(isa), time.perf_counter()
        if (where / "built").exists():
            print(f"CPU kernels ({isa}): built, in {where}")
            continue
        print(f"building CPU kernels ({isa})… ", end="", flush=True)
        done = subprocess.run([sys.executable, "-m", "kernels.cpu.build", "--isa", isa], capture_output=True, text=True)
        if done.returncode != 0:  # the runtime takes the next variant the CPU runs, then torch's kernels
            failed += 1
            lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
            print(f"failed: {lines[-1] if lines else f'exit {done.returncode}'}")
            continue
        runs = isa in cpu_isa.runnable(cpu_isa.cpu_flags())
        print(f"{time.perf_counter() - t0:.1f} s, in {where}" + ("" if runs else " (this CPU does not run it)"))
    _prune([cpu_ops.build_dir(isa) for isa in cpu_isa.BUILT])
    print(f"this CPU runs: {cpu_isa.choose(forced='').reason}" + (" (the next variant where a build failed)"
                                                                   if failed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
