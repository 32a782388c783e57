import atexit
import os
import shutil
import tempfile

# GGUF config/tokenizer conversions are cached per file: keep the tests' out of the user's cache, and remove
# ours when the run ends (~200 MB of converted tokenizers and weight caches a run, left in /tmp before).
if "ROSECHAT_CACHE_DIR" not in os.environ:
    os.environ["ROSECHAT_CACHE_DIR"] = _cache_dir = tempfile.mkdtemp(prefix="rosechat-test-cache-")
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)

# Triton kernels run under the interpreter on CPU-only machines; compiled where CUDA is present.
# Must be set before triton.jit decorates anything, so it lives at the top of the root conftest.
try:
    import torch

    _cuda = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _cuda = False
if not _cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Triton reads it when a kernel is defined (triton.jit): define ours now, so a test that unsets it (to see
    # the CPU's refusal) cannot leave them compiled for a GPU for every test after it
    try:
        import kernels.triton.cache  # noqa: F401
        import kernels.triton.decode  # noqa: F401
        import kernels.triton.prefill  # noqa: F401
        import kernels.triton.quant  # noqa: F401
    except ImportError:  # no Triton here (not Linux): its tests skip
        pass
# The suite's expectations (float32 tolerances, the CPU's packed kernels) are the CPU defaults' on every
# machine: "auto" means the CPU here, and the CUDA tests ask for device="cuda" by name.
os.environ.setdefault("ROSECHAT_DEVICE", "cpu")
# ...and float32 on every CPU: a dense load on a CPU with native bfloat16 would otherwise measure both
# dtypes and might keep bfloat16 (engine/defaults.py); tests of that probe unset this
os.environ.setdefault("ROSECHAT_DTYPE", "float32")
# ...and speculation guesses by its rate alone: whether a measured check's cost outweighs it depends on the
# machine's timing (engine/spec_decode.py StepCost; its own tests turn it on)
os.environ.setdefault("ROSECHAT_SPEC_COST", "off")

# Pin the CPU kernels' variant for the whole run (subprocesses included): what the golden traces and
# bit-for-bit tests assert was computed on it. The AVX2 variant runs on every AVX2 and AVX-512 CPU;
# ROSECHAT_CPU_ISA set by hand (e.g. "generic": torch's ops only) still wins.
try:
    from kernels.cpu import isa as cpu_isa

    os.environ.setdefault("ROSECHAT_CPU_ISA", "avx2" if "avx2" in cpu_isa.runnable(cpu_isa.cpu_flags()) else "generic")
except ImportError:  # pragma: no cover
    pass


def pytest_sessionstart(session) -> None:
    """Which machine a run was on, first thing (also under -q, which hides pytest's header): a red run on
    the other kind of CPU says so at once."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        for line in _machine_lines():
            reporter.write_line(line)


def _machine_lines() -> list[str]:
    from engine import defaults
    from kernels.cpu import isa as cpu_isa

    flags = cpu_isa.cpu_flags()
    avx512 = sorted(f for f in flags if f.startswith("avx512") or f.startswith("amx"))
    d = defaults.resolve()
    return [
        f"cpu: {cpu_isa.cpu_model()} | ISA paths it runs: {', '.join(cpu_isa.runnable(flags))} | our kernels: "
        f"{', '.join(cpu_isa.BUILT)} | AVX-512 flags: {' '.join(avx512) or 'none'}",
        f"defaults: {d.device}, {d.dtype}, quantization {d.quantization}, ROSECHAT_CPU_ISA="
        f"{os.environ.get('ROSECHAT_CPU_ISA')} | {d.reason}",
    ]
