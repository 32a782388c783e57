"""The CPU kernels built at install (setup.py, kernels/cpu/build.py): each ISA variant its own extension
module with its own flags, loaded when it was built from the sources, flags and torch at hand (the source
key in its bytes), refused when stale, and the runtime build standing in, saying so once. Fakes stand in
for the modules and the compiler; one test checks this very process's avx2 kernels."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils import cpp_extension

from kernels.cpu import build
from kernels.cpu import isa as cpu_isa
from kernels.cpu import ops as cpu_ops

ROOT = Path(__file__).resolve().parents[2]


def _skip_without_avx2() -> None:
    if "avx2" not in cpu_isa.runnable(cpu_isa.cpu_flags()):
        pytest.skip("this CPU lacks avx2")


@pytest.fixture
def loader(monkeypatch, tmp_path: Path):
    """The loader, as a fresh process has it, on avx2, with nothing loaded for real: `loaded` lists the
    libraries it loads, `compiled` the runtime builds it runs (the real _compile around a fake compiler),
    into tmp_path; this process's own kernels are as they were afterwards."""
    _skip_without_avx2()
    assert cpu_ops.available(), cpu_ops.unavailable_reason()  # the suite's pinned variant, loaded first
    state = cpu_ops._running, cpu_ops._loaded_from, cpu_ops._built
    loaded: list[str] = []
    compiled: list[str] = []
    monkeypatch.setenv("ROSECHAT_CPU_ISA", "avx2")
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    monkeypatch.setattr(cpu_ops, "build_dir", lambda isa: tmp_path / f"{isa}-runtime")
    monkeypatch.setattr(cpp_extension, "load", lambda name, **kw: compiled.append(name))

    def fresh() -> None:
        cpu_ops._running, cpu_ops._loaded_from, cpu_ops._built = None, None, False
        cpu_ops._build_once.cache_clear()

    fresh()
    yield SimpleNamespace(loaded=loaded, compiled=compiled, fresh=fresh)
    monkeypatch.undo()
    cpu_ops._running, cpu_ops._loaded_from, cpu_ops._built = state
    cpu_ops._build_once.cache_clear()
    assert cpu_ops.available() and cpu_ops.loaded_from() == state[1]  # as before


def _fake_module(monkeypatch, tmp_path: Path, key: str | None) -> Path:
    """An install-built avx2 module (an ELF's worth of other bytes around the key), or none (key None)."""
    path = tmp_path / "rosechat_cpu_avx2.cpython-3x-x86_64-linux-gnu.so"
    if key is not None:
        path.write_bytes(b"\x7fELF" + os.urandom(4096) + cpu_ops.KEY_MARK + key.encode() + b"\0" + os.urandom(4096))
    monkeypatch.setattr(cpu_ops, "installed_module", lambda isa: path if isa == "avx2" and path.exists() else None)
    return path


def test_the_key_is_read_from_the_bytes(tmp_path: Path) -> None:
    path = tmp_path / "m.so"
    path.write_bytes(b"\x7fELF\0" + cpu_ops.KEY_MARK + b"ab" * 32 + b"\0tail")
    assert cpu_ops.built_key(path) == "ab" * 32
    path.write_bytes(b"\x7fELF\0 no key: built by hand")
    assert cpu_ops.built_key(path) is None


def test_a_matching_install_built_module_loads_without_a_compile(loader, monkeypatch, tmp_path: Path) -> None:
    path = _fake_module(monkeypatch, tmp_path, cpu_ops.source_key("avx2"))
    assert cpu_ops.install_problem("avx2") is None and not cpu_ops.needs_build()
    assert cpu_ops.build_status() == "rosechat avx2 (forced by ROSECHAT_CPU_ISA)"
    assert loader.loaded == [str(path)] and loader.compiled == []
    assert cpu_ops.loaded_from() == path


@pytest.mark.parametrize("key,problem", [
    ("0" * 64, "built at install are stale (sources, flags or torch changed since)"),  # a kernel edited since
    (None, "were not built at install"),  # no compiler at install, or a variant that failed there
])
def test_the_runtime_build_stands_in_and_says_so_once(loader, monkeypatch, tmp_path: Path, caplog, key: str | None,
                                                      problem: str) -> None:
    _fake_module(monkeypatch, tmp_path, key)
    assert cpu_ops.install_problem("avx2") == problem and cpu_ops.needs_build()
    with caplog.at_level(logging.INFO, logger=cpu_ops.log.name):
        assert cpu_ops.build_status() == "rosechat avx2 (forced by ROSECHAT_CPU_ISA)"
        runtime = tmp_path / "avx2-runtime" / "rosechat_cpu_avx2.so"
        assert loader.compiled == ["rosechat_cpu_avx2"] and loader.loaded == [str(runtime)]
        assert cpu_ops.loaded_from() == runtime
        loader.fresh()  # the next process: the runtime build is there, nothing is compiled or said again
        assert cpu_ops.build_status() == "rosechat avx2 (forced by ROSECHAT_CPU_ISA)"
        assert loader.compiled == ["rosechat_cpu_avx2"] and loader.loaded == [str(runtime)] * 2
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert said == [f"CPU kernels {problem}: building now (avx2, once, in {runtime.parent})"]


def test_a_variant_the_cpu_cannot_run_is_never_loaded(loader, monkeypatch, tmp_path: Path) -> None:
    """An install-built avx512 module beside a CPU without AVX-512: not even opened by the loader (its static
    initialisers would die of SIGILL); the avx2 one runs."""
    monkeypatch.delenv("ROSECHAT_CPU_ISA")
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: frozenset({"avx", "avx2", "fma", "f16c"}))
    mods = {isa: tmp_path / f"rosechat_cpu_{isa}.so" for isa in cpu_isa.BUILT}
    for isa, path in mods.items():
        path.write_bytes(cpu_ops.KEY_MARK + cpu_ops.source_key(isa).encode())
    monkeypatch.setattr(cpu_ops, "installed_module", mods.get)
    assert cpu_ops.build_status() == "rosechat avx2 (from the CPU's flags)"
    assert loader.loaded == [str(mods["avx2"])] and loader.compiled == []


def test_the_avx2_kernels_of_this_process_come_from_the_install() -> None:
    """In an environment set up by `make setup` (or `pip install --no-build-isolation -e .`), the suite's
    real avx2 kernels are the install's module, not a runtime build."""
    _skip_without_avx2()
    if os.environ.get("ROSECHAT_CPU_ISA") != "avx2":
        pytest.skip("the suite is not pinned to avx2 here")
    path = cpu_ops.installed_module("avx2")
    if path is None:
        pytest.skip("the install did not build the avx2 kernels here (`make setup` does)")
    if cpu_ops.install_problem("avx2") is not None:
        pytest.skip(f"the install's avx2 kernels are stale: {cpu_ops.install_problem('avx2')} (`make setup` rebuilds)")
    assert cpu_ops.available(), cpu_ops.unavailable_reason()
    assert cpu_ops.loaded_from() == path
    assert cpu_ops.built_key(path) == cpu_ops.source_key("avx2")


def test_each_variant_is_an_extension_module_of_its_own_isa_flags() -> None:
    exts = {ext.name: ext for ext in build.extensions()}
    assert list(exts) == [f"kernels.cpu.rosechat_cpu_{isa}" for isa in cpu_isa.BUILT]
    for isa in cpu_isa.BUILT:
        ext = exts[f"kernels.cpu.rosechat_cpu_{isa}"]
        flags = ext.extra_compile_args
        isa_flags = {f for f in flags if f.startswith("-m")}
        assert isa_flags == set(cpu_isa.CFLAGS[isa]), isa_flags  # this ISA's alone: never -march=native
        assert f"-DROSECHAT_KERNEL_KEY={cpu_ops.source_key(isa)}" in flags
        assert [ROOT / s for s in ext.sources] == cpu_ops._SOURCES and ext.optional


@pytest.mark.parametrize("compiler", ["fails", "missing"])
def test_an_install_that_cannot_compile_the_kernels_still_succeeds(tmp_path: Path, compiler: str) -> None:
    """A compiler that fails every variant, or none at all: the build goes on, builds no module, says why."""
    fake = tmp_path / "c++"
    if compiler == "fails":
        fake.write_text('#!/bin/sh\ncase "$1" in --version|-v) echo "g++ (fake) 12.2.0";; '
                        '*) echo "c++: error: cannot compile" >&2; exit 1;; esac\n')
        fake.chmod(0o755)
    env = {**os.environ, "CXX": str(fake), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"),
                          "--build-temp", str(tmp_path / "tmp")], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    said = [line.split("UserWarning: ", 1)[1] for line in out.stderr.splitlines() if "UserWarning: rosechat: " in line]
    if compiler == "fails":  # warnings: pip shows them under -q too
        assert [line.split(" (")[0] for line in said] == [
            f"rosechat: could not build the {isa} CPU kernels" for isa in cpu_isa.BUILT]
    else:
        assert said == [f"rosechat: no C++ compiler ({fake}): the CPU kernels are not built at install; the first "
                        "use tries again, else torch's own kernels run"]
    assert not list(tmp_path.glob("lib/**/*.so"))


def test_a_build_environment_without_torch_builds_no_kernels_and_says_so(tmp_path: Path) -> None:
    """An isolated build (`pip install .` without --no-build-isolation) has no torch: torch is no build
    requirement (it would fetch the newest, a CUDA build of gigabytes, and compile against a torch that does
    not run), so the install builds no kernels, says so, and the first use builds them."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    assert not [r for r in requires if r.split(">")[0].split("=")[0].strip() == "torch"], requires
    (tmp_path / "torch.py").write_text('raise ImportError("No module named \'torch\'")\n')
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    out = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"),
                          "--build-temp", str(tmp_path / "tmp")], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    said = "rosechat: CPU kernels not built at install (No module named 'torch'): the first use builds them"
    assert said in out.stderr
    assert not list(tmp_path.glob("lib/**/*.so"))
