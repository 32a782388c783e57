"""Our CPU kernels, built ahead of their first use.

At install: setup.py (the build backend's hook) takes `setup_args()`: torch's BuildExtension compiles
every variant in isa.BUILT at once, each as an extension module of its own (kernels/cpu/rosechat_cpu_<isa>
+ Python's suffix, beside ops.py: in site-packages, or in the tree for an editable install) with that
ISA's flags alone (never -march=native) and the source key ops.py checks before loading it. A variant
that does not compile, or no compiler, still installs: the message says why, and the runtime builds it
at first use (ops.py), or runs the next variant or torch's own kernels.

`python -m kernels.cpu.build` says what the install built and builds now, as the first launch would
(into ops.build_dir), each variant the install did not build from these sources; with --prune it also
removes the environment's runtime builds of other sources (`make setup` runs it so after the install:
not in an environment that several checkouts share, whose builds those are).
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

from kernels.cpu import isa as cpu_isa
from kernels.cpu import ops as cpu_ops

ROOT = Path(__file__).resolve().parents[2]


def _say(line: str) -> None:
    print(f"rosechat: {line}", file=sys.stderr, flush=True)


def _warn(line: str) -> None:
    """Why a variant was not built: a warning, which pip shows even under -q (it hides the build's output)."""
    warnings.warn(f"rosechat: {line}", stacklevel=2)


def install_cflags(isa: str) -> list[str]:
    """The `isa` variant's flags at install: the runtime build's (ops._cflags, hashed into the source key),
    without what Python's own CFLAGS, which setuptools puts first, add (debug info, -fwrapv), and the key."""
    return [*cpu_ops._cflags(isa), "-g0", "-fno-wrapv", f"-DROSECHAT_KERNEL_KEY={cpu_ops.source_key(isa)}"]


def extensions() -> list:
    """One extension module per variant, each compiled with its own ISA's flags only."""
    from torch.utils.cpp_extension import CppExtension

    sources = [str(f.relative_to(ROOT)) for f in cpu_ops._SOURCES]
    return [CppExtension(f"kernels.cpu.rosechat_cpu_{isa}", sources, extra_compile_args=install_cflags(isa),
                         depends=[str(f.relative_to(ROOT)) for f in cpu_ops._HEADERS], optional=True)
            for isa in cpu_isa.BUILT]


_FALLBACK = "the first use builds them, else the next variant or torch's own kernels run"


def _last_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[-1] if text else type(exc).__name__


def _build_command() -> type:
    from torch.utils.cpp_extension import BuildExtension

    class BuildKernels(BuildExtension):
        """Each variant on its own, timed; one that fails is reported, left out, and the install goes on."""

        def build_extensions(self) -> None:
            try:  # BuildExtension first checks the compiler (runs it): a broken one fails every variant
                super().build_extensions()
            except Exception as exc:  # noqa: BLE001
                _warn(f"could not build the CPU kernels ({_last_line(exc)}): {_FALLBACK}")

        def build_extension(self, ext) -> None:
            isa, t0 = ext.name.rsplit("_", 1)[1], time.perf_counter()
            _say(f"building CPU kernels ({isa})…")
            try:
                super().build_extension(ext)
            except Exception as exc:  # noqa: BLE001 (ninja's RuntimeError, distutils' CompileError, ...)
                _warn(f"could not build the {isa} CPU kernels ({_last_line(exc)}): {_FALLBACK}")
                return
            _say(f"CPU kernels ({isa}) built in {time.perf_counter() - t0:.0f} s")

    return BuildKernels


def setup_args() -> dict:
    """setup()'s ext_modules and cmdclass: every variant, or none (saying why) where there is no compiler."""
    from torch.utils import cpp_extension

    compiler = cpp_extension.get_cxx_compiler()
    if shutil.which(compiler) is None:
        _warn(f"no C++ compiler ({compiler}): the CPU kernels are not built at install; the first use tries "
             "again, else torch's own kernels run")
        return {}
    cpu_ops.ninja_on_path()
    return {"ext_modules": extensions(), "cmdclass": {"build_ext": _build_command()}}


def build_one(isa: str) -> None:
    """Build the `isa` variant at run time (in a process of its own: building loads the library, and two
    variants register the same operators). A variant this CPU cannot run is compiled, not loaded: loading
    runs its static initialisers, compiled for that ISA (an AVX2 machine dies of SIGILL loading avx512)."""
    import torch

    if isa not in cpu_isa.runnable(cpu_isa.cpu_flags()):
        torch.ops.load_library = lambda path: None  # this child process only builds
    where = cpu_ops.build_dir(isa)
    cpu_ops._compile(isa, where, where / "built")


def _prune(current: list[Path]) -> None:
    """Remove the environment's runtime builds of older sources (each edit of a kernel leaves one behind).
    Only in the environment, which is this checkout's: the user cache may hold other checkouts'."""
    for root in {where.parent for where in current if where.is_relative_to(sys.prefix)}:
        if not root.exists():
            continue
        for old in root.iterdir():
            if old.name.split("-")[0] in cpu_isa.ISAS and old.with_suffix("") not in current:
                shutil.rmtree(old) if old.is_dir() else old.unlink()


def main(argv: list[str]) -> int:
    from torch.utils import cpp_extension

    logging.basicConfig(level=logging.ERROR)
    if argv[:1] == ["--isa"]:
        build_one(argv[1])
        return 0
    ready, runs = set(), cpu_isa.runnable(cpu_isa.cpu_flags())  # the variants that can load now
    compiler = cpp_extension.get_cxx_compiler()
    for isa in cpu_isa.BUILT:
        note = "" if isa in runs else " (this CPU does not run it)"
        problem, where = cpu_ops.install_problem(isa), cpu_ops.build_dir(isa)
        if problem is None:
            ready.add(isa)
            print(f"CPU kernels ({isa}): built at install, {cpu_ops.installed_module(isa)}{note}")
            continue
        if (where / "built").exists():
            ready.add(isa)
            print(f"CPU kernels ({isa}) {problem}: built at run time, in {where}{note}")
            continue
        if shutil.which(compiler) is None:
            print(f"CPU kernels ({isa}) {problem}, and there is no C++ compiler ({compiler})")
            continue
        print(f"CPU kernels ({isa}) {problem}: building now… ", end="", flush=True)
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "kernels.cpu.build", "--isa", isa], capture_output=True, text=True)
        if done.returncode != 0:  # the runtime takes the next variant the CPU runs, then torch's kernels
            lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
            print(f"failed: {lines[-1] if lines else f'exit {done.returncode}'}")
            continue
        ready.add(isa)
        print(f"{time.perf_counter() - t0:.1f} s, in {where}{note}")
    if "--prune" in argv:
        _prune([cpu_ops.build_dir(isa) for isa in cpu_isa.BUILT])
    choice = cpu_isa.choose(forced="")
    loads = [c for c in [choice, *cpu_isa.fallbacks(choice)] if c.isa in ready or c.isa == "generic"]
    print("this CPU runs: " + (loads[0].reason if loads else "torch's own kernels (ours did not build)"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
