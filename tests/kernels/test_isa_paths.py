"""Every ISA path this CPU can run, end to end: a fresh process forced onto the path (ROSECHAT_CPU_ISA)
decodes the real model's greedy reply, and every path gives the same tokens. Paths this CPU cannot run
are skipped, naming the flags it lacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.cpu import isa as cpu_isa
from kernels.cpu import ops as cpu_ops

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]
_SCRIPT = """
import json, sys
from engine import LLMEngine, SamplingParams
llm = LLMEngine.from_pretrained("smollm2-135m-instruct", num_blocks=64)
prompts = [llm.render_chat([{"role": "user", "content": p}]) for p in json.loads(sys.argv[1])]
replies = [llm.generate([ids], SamplingParams(max_tokens=32, ignore_eos=True))[0].outputs[0].token_ids
           for ids in prompts]
agree = 0  # teacher-forced on the given replies: how many of their tokens this path ranks first
for ids, reply in zip(prompts, json.loads(sys.argv[2])):
    agree += sum(int(a == b) for a, b in zip(llm.score(ids + reply)[len(ids) - 1 : -1].argmax(1).tolist(), reply))
print("RESULT " + json.dumps({"kernels": llm.info.kernels, "replies": replies, "agree": agree}))
"""


def _decode(isa: str, replies: list[list[int]] | None = None) -> dict:
    env = {**os.environ, "ROSECHAT_CPU_ISA": isa, "PYTHONPATH": str(ROOT), **_wide(isa)}
    out = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(PROMPTS), json.dumps(replies or [])], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])


@pytest.fixture(scope="module")
def reference() -> dict:
    """The path the suite is pinned to (tests/conftest.py)."""
    return _decode(os.environ["ROSECHAT_CPU_ISA"])


@pytest.mark.parametrize("isa", cpu_isa.ISAS)
def test_every_isa_path_gives_the_same_greedy_reply(isa: str, reference: dict) -> None:
    flags = cpu_isa.cpu_flags()
    if isa not in cpu_isa.runnable(flags):
        pytest.skip(f"this CPU lacks {', '.join(f for f in cpu_isa.NEEDS[isa] if f not in flags)}")
    got = _decode(isa, reference["replies"])
    assert got["kernels"].startswith("torch" if isa == "generic" else f"rosechat {isa}"), got["kernels"]
    if isa == "generic":
        # torch's weight-only kernels take bfloat16 activations: near-ties go either way and a reply may
        # part from ours (it does on the first prompt), so the bound is on ranking our tokens first,
        # teacher-forced, as tests/engine/test_quant.py bounds packed against dequantized
        total = sum(len(r) for r in reference["replies"])
        print(f"generic path: ranks {got['agree']} of our {total} tokens first")
        assert got["agree"] >= 0.9 * total, (got["agree"], total, got["replies"], reference["replies"])
    else:  # our kernels, any ISA: the same float32 sums, the same tokens
        assert got["replies"] == reference["replies"]


_KERNELS_SCRIPT = """
import sys, torch
from kernels.cpu import ops as cpu_ops
assert cpu_ops.build_status().startswith("rosechat " + sys.argv[2]), cpu_ops.build_status()
gen = torch.Generator().manual_seed(0)
out = {}
for rows in (1, 2, 3, 4, 7, 8, 9, 17):  # every tile shape: x rows in 8s, 4s, 2s and 1s
    for k, n in ((576, 960), (96, 37), (1536, 577)):  # short last groups of rows, an odd count of blocks
        x = torch.randn(rows, k, generator=gen)
        nib = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        d, m = torch.rand(n, k // 32, generator=gen) * 0.02, -torch.rand(n, k // 32, generator=gen) * 0.1
        q8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
        out[f"q4 {rows} {k} {n}"] = cpu_ops.q4_linear(x, cpu_ops.pack_q4(nib), cpu_ops.pack_scales(d),
                                                      cpu_ops.pack_scales(m))
        out[f"q8 {rows} {k} {n}"] = cpu_ops.q8_linear(x, cpu_ops.pack_q8(q8), cpu_ops.pack_scales(d))
        out[f"q8m {rows} {k} {n}"] = cpu_ops.q8m_linear(x, cpu_ops.pack_q8(q8), cpu_ops.pack_scales(d),
                                                        cpu_ops.pack_scales(m))
        if k % 256 == 0:  # q6k: Q6_K's super-blocks, with and without offsets
            sc = torch.randint(-128, 128, (n, k // 16), dtype=torch.int8, generator=gen)
            q6k = (cpu_ops.pack_q6k(q8 // 4), cpu_ops.pack_scales(d[:, : k // 256].half()), cpu_ops.pack_sub_scales(sc))
            out[f"q6k {rows} {k} {n}"] = cpu_ops.q6k_linear(x, *q6k)
            out[f"q6km {rows} {k} {n}"] = cpu_ops.q6k_linear(x, *q6k, cpu_ops.pack_scales(m))
rows, vocab = 64, 5000  # sampling: every stage on, rows drawn at spread-out uniforms
f = lambda lo, hi: lo + (hi - lo) * torch.rand(rows, generator=gen)
seen = torch.randint(0, vocab, (rows * 4,), generator=gen)
out["sample"] = cpu_ops.sample_rows(torch.randn(rows, vocab, generator=gen) * 4, seen, torch.arange(rows + 1) * 4,
                                    f(1.0, 1.3), f(0.2, 1.5), torch.randint(0, 60, (rows,), generator=gen),
                                    f(0.5, 1.0), f(0.0, 0.1), torch.rand(rows, generator=gen, dtype=torch.float64))
torch.save(out, sys.argv[1])
"""


def _kernel_outputs(isa: str, path: Path) -> dict:
    env = {**os.environ, "ROSECHAT_CPU_ISA": isa, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **_wide(isa)}
    out = subprocess.run([sys.executable, "-c", _KERNELS_SCRIPT, str(path), isa], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return torch.load(path)


def _wide(isa: str) -> dict[str, str]:
    """The avx512 variant forced onto its 512-bit one-row tiles (kernels/cpu/tiles.py), whatever its timing
    would choose here: the wide tiles are what this run checks against the pinned variant's bits."""
    return {"ROSECHAT_CPU_TILES": "512"} if isa == "avx512" else {}


def _other_built_paths() -> list[str]:
    """Our kernels' variants besides the one the suite is pinned to (tests/conftest.py)."""
    return [isa for isa in cpu_isa.BUILT if isa != os.environ["ROSECHAT_CPU_ISA"]]


def _skip_unless_runnable(isa: str) -> None:
    flags = cpu_isa.cpu_flags()
    if isa not in cpu_isa.runnable(flags):
        pytest.skip(f"this CPU lacks {', '.join(f for f in cpu_isa.NEEDS[isa] if f not in flags)}")


@pytest.mark.parametrize("isa", _other_built_paths())
def test_every_isa_variant_computes_the_same_bits(isa: str, tmp_path: Path) -> None:
    """Block sums are exact integers whichever instructions add them, and the float steps are the same:
    each variant's packed linears give the pinned variant's results bit for bit, at every tile shape."""
    _skip_unless_runnable(isa)
    pinned = _kernel_outputs(os.environ["ROSECHAT_CPU_ISA"], tmp_path / "pinned.pt")
    got = _kernel_outputs(isa, tmp_path / f"{isa}.pt")
    assert got.keys() == pinned.keys()
    differ = [key for key in pinned if not torch.equal(got[key], pinned[key])]
    assert not differ, differ


@pytest.mark.parametrize("isa", _other_built_paths())
def test_the_kernel_tests_pass_on_every_isa_variant(isa: str) -> None:
    """The suite runs in one process on the pinned variant (one variant's operators per process): the
    kernel tests run again here, forced onto each other variant this CPU can run."""
    _skip_unless_runnable(isa)
    env = {**os.environ, "ROSECHAT_CPU_ISA": isa, **_wide(isa)}
    tests = [str(ROOT / f) for f in ("tests/kernels/test_cpu_quant.py", "tests/kernels/test_cpu_quant_k.py",
                                     "tests/kernels/test_cpu_layers.py", "tests/kernels/test_cpu_repack.py",
                                     "tests/kernels/test_cpu_tiles.py", "tests/engine/test_sampler.py")]
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", *tests],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:]
    assert f"kernels {isa} (forced by ROSECHAT_CPU_ISA)" in out.stdout  # the header: it ran on that variant


def test_a_variant_that_does_not_build_gives_way_to_the_next(monkeypatch, tmp_path: Path) -> None:
    """An AVX-512 CPU whose compiler cannot build the avx512 variant runs avx2, and says so, rather than
    falling back to torch's kernels; a forced variant has no stand-in."""
    flags = cpu_isa.cpu_flags()
    if "avx2" not in cpu_isa.runnable(flags):
        pytest.skip("this CPU lacks avx2")
    zen4 = flags | frozenset("avx512f avx512bw avx512vl avx512dq avx512_vnni".split())
    real_dir, real_compile = cpu_ops.build_dir, cpu_ops._compile

    def compile_(isa: str, where: Path, done: Path) -> None:
        if isa == "avx512":
            raise RuntimeError("c++: error: unrecognized command-line option '-mavx512vnni'")
        real_compile(isa, where, done)

    assert cpu_ops.available(), cpu_ops.unavailable_reason()  # the suite's pinned variant, loaded
    loaded: list[str] = []  # the libraries this process would load (it holds its own already)
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: zen4)
    monkeypatch.setattr(cpu_ops, "build_dir", lambda isa: tmp_path / isa if isa == "avx512" else real_dir(isa))
    monkeypatch.setattr(cpu_ops, "_compile", compile_)
    installed = cpu_ops.installed_module
    monkeypatch.setattr(cpu_ops, "installed_module", lambda isa: None if isa == "avx512" else installed(isa))
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    running, loaded_from = cpu_ops._running, cpu_ops._loaded_from
    try:
        monkeypatch.delenv("ROSECHAT_CPU_ISA")
        cpu_ops._running = None
        cpu_ops._build_once.cache_clear()
        assert cpu_ops.build_status() == "rosechat avx2 (the avx512 kernels did not build)"
        assert [Path(p).name.split(".")[0] for p in loaded] == ["rosechat_cpu_avx2"]  # the install's, or built now
        monkeypatch.setenv("ROSECHAT_CPU_ISA", "avx512")
        cpu_ops._running = None
        cpu_ops._build_once.cache_clear()
        status = cpu_ops.build_status()
        assert status.startswith("torch (could not build the CPU kernels (avx512: c++: error: unrecognized"), status
    finally:
        monkeypatch.undo()
        cpu_ops._running, cpu_ops._loaded_from = running, loaded_from
        cpu_ops._build_once.cache_clear()
    assert cpu_ops.available() and cpu_ops.build_status() == f"rosechat {running.reason}"  # as before


@pytest.mark.parametrize("flags,loads", [("zen3", False), ("zen4", True)])
def test_setup_builds_every_variant_but_loads_only_what_the_cpu_runs(monkeypatch, flags: str, loads: bool) -> None:
    """`python -m kernels.cpu.build` builds at run time every variant the install did not, avx512 on an AVX2
    machine too; loading that build would run AVX-512 code (its static initialisers) and kill the process
    with SIGILL, so there it is compiled only."""
    from kernels.cpu import build

    zen3 = frozenset({"avx", "avx2", "fma", "f16c", "sse4_2"})
    zen4 = zen3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16"}
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: zen3 if flags == "zen3" else zen4)
    loaded: list[str] = []
    monkeypatch.setattr(torch.ops, "load_library", lambda path: loaded.append(path))  # restored after the test
    # what cpp_extension.load does once it has compiled: load the library it built
    monkeypatch.setattr(cpu_ops, "_compile", lambda isa, where, done: torch.ops.load_library(f"{where}/x.so"))
    build.build_one("avx512")
    assert bool(loaded) is loads
