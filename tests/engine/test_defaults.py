"""One resolution of every default, checked under another machine's CPU flags: the CPU this suite
happens to run on must not hide a default that breaks on the other kind."""

from __future__ import annotations

import os

import pytest
import torch

from engine import EngineConfig, defaults
from kernels.cpu import isa as cpu_isa

# Linux's flags of the two kinds of machine this project has run on (abridged to what matters)
ZEN3_AVX2 = frozenset("sse4_2 avx avx2 fma f16c bmi2".split())
ZEN4_AVX512 = ZEN3_AVX2 | frozenset("avx512f avx512bw avx512vl avx512dq avx512_vnni avx512_bf16".split())
SKYLAKE_X = ZEN3_AVX2 | frozenset("avx512f avx512bw avx512vl avx512dq avx512cd".split())  # AVX-512, no VNNI
SAPPHIRE_AMX = ZEN4_AVX512 | frozenset("amx_bf16 amx_int8 amx_tile".split())
NO_AVX = frozenset("sse4_2".split())


PINNED_ISA = os.environ.get("ROSECHAT_CPU_ISA")  # tests/conftest.py's


@pytest.fixture(autouse=True)
def _no_forced_isa(monkeypatch) -> None:
    """The suite pins ROSECHAT_CPU_ISA (tests/conftest.py); these tests resolve as a user's launch does."""
    monkeypatch.delenv("ROSECHAT_CPU_ISA", raising=False)
    monkeypatch.delenv("ROSECHAT_DTYPE", raising=False)


@pytest.mark.parametrize("flags", [ZEN3_AVX2, ZEN4_AVX512, SAPPHIRE_AMX], ids=["avx2", "avx512-bf16", "amx"])
def test_cpu_defaults_are_float32_and_packed_on_every_x86(flags: frozenset[str]) -> None:
    """bfloat16 was the default wherever the CPU had AVX512_BF16, while the fused kernels take float32
    only: 13 tests failed there and the app ran at a third of its speed."""
    d = defaults.resolve(flags=flags, cuda=False)
    assert (d.device, d.dtype, d.quantization, d.attention_backend) == ("cpu", "float32", "auto", "torch")
    assert d.isa == ("avx2" if flags == ZEN3_AVX2 else "avx512")
    assert "float32" in d.reason and d.isa in d.reason
    assert ("native bfloat16" in d.reason) == cpu_isa.has_bf16(flags)


def test_a_cpu_without_avx2_runs_torchs_kernels() -> None:
    d = defaults.resolve(flags=NO_AVX, cuda=False)
    assert (d.dtype, d.quantization, d.isa) == ("float32", "auto", "generic")
    assert "no AVX2" in d.reason


def test_asked_for_values_are_kept_and_bad_ones_named() -> None:
    d = defaults.resolve(dtype="bf16", quantization="none", flags=ZEN4_AVX512, cuda=False)
    assert (d.dtype, d.quantization, d.torch_dtype) == ("bfloat16", "none", torch.bfloat16)
    with pytest.raises(ValueError, match="dtype must be one of"):
        defaults.resolve(dtype="int8", cuda=False)
    with pytest.raises(ValueError, match="quantization must be one of"):
        defaults.resolve(quantization="q4", cuda=False)
    with pytest.raises(ValueError, match="CUDA is not available"):
        defaults.resolve(device="cuda", cuda=False)
    with pytest.raises(ValueError, match="device must be"):
        defaults.resolve(device="tpu", cuda=False)


def test_cuda_defaults_are_dense_bfloat16(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    d = defaults.resolve(cuda=True)
    assert (d.device, d.dtype, d.quantization, d.attention_backend) == ("cuda", "bfloat16", "none", "triton")
    with pytest.raises(ValueError, match="CPU only"):
        defaults.resolve(quantization="int4", cuda=True)


def test_rosechat_device_says_what_auto_is_on_this_machine(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("ROSECHAT_DEVICE", "cuda:7")
    with pytest.raises(ValueError, match="'cuda:7' requested but CUDA is not available"):
        defaults.resolve()
    assert defaults.resolve(device="cpu").device == "cpu"  # a device asked for by name wins
    monkeypatch.delenv("ROSECHAT_DEVICE")
    assert defaults.resolve().device == "cpu"


@pytest.mark.parametrize("flags, want", [
    (ZEN3_AVX2, ["avx2", "generic"]), (ZEN4_AVX512, ["avx512", "avx2", "generic"]),
    (SKYLAKE_X, ["avx2", "generic"]), (NO_AVX, ["generic"]),
])
def test_isa_choice_and_forcing(flags: frozenset[str], want: list[str]) -> None:
    assert cpu_isa.runnable(flags) == want
    assert cpu_isa.choose(flags, forced="").isa == want[0]  # the best this CPU runs
    assert cpu_isa.choose(flags, forced="generic").isa == "generic"
    if "avx2" in want:
        assert cpu_isa.choose(flags, forced="avx2").reason.startswith("avx2 (forced")
    else:
        with pytest.raises(ValueError, match="lacks avx2"):
            cpu_isa.choose(flags, forced="avx2")
    if "avx512" in want:
        assert cpu_isa.choose(flags, forced="avx512").reason.startswith("avx512 (forced")
    else:  # the missing flags named
        with pytest.raises(ValueError, match="lacks avx512"):
            cpu_isa.choose(flags, forced="avx512")
    with pytest.raises(ValueError, match="choose one of"):
        cpu_isa.choose(flags, forced="sse")


def test_every_entry_point_takes_the_same_defaults(tiny_llama, monkeypatch) -> None:
    """EngineConfig (the app, serve, from_pretrained) and load_model resolve alike; the KV cache takes the
    dtype of the model actually loaded."""
    from engine import LLMEngine, load_model

    if PINNED_ISA:  # loading builds our kernels in this process: the suite's pinned variant, whatever runs first
        monkeypatch.setenv("ROSECHAT_CPU_ISA", PINNED_ISA)
    # where the CPU has native bfloat16 the dense load times both dtypes: equal times here (a loaded machine's
    # timing once kept bfloat16), so the load must keep the resolved float32 (the probe's own test covers it)
    monkeypatch.setattr(defaults, "_time_linears", lambda shapes, dtype: 1.0)
    here = defaults.resolve()
    config = EngineConfig()
    assert (config.dtype, config.quantization, config.device) == (here.dtype, here.quantization, here.device)
    assert config.reason == here.reason
    loaded = load_model(str(tiny_llama))
    assert loaded.dtype == here.torch_dtype
    bf16 = load_model(str(tiny_llama), dtype="bfloat16")
    engine = LLMEngine(bf16, EngineConfig(num_blocks=8))  # the config said float32 (auto)
    assert engine.runner.k_cache.dtype == torch.bfloat16 and engine.info.dtype == "bfloat16"
    assert engine.info.reason


def test_the_default_cpu_pool_holds_a_useful_context(monkeypatch) -> None:
    """256 MiB, or 4,096 tokens where a big model's tokens take more, within a quarter of available memory."""
    from engine.config import EngineConfig

    config = EngineConfig(device="cpu", block_size=16)
    small, big = 16 * 46_080, 16 * 393_216  # bytes per block: SmolLM2-135M's and 1.7B's fp32 K and V
    monkeypatch.setenv("ROSECHAT_MEMORY_LIMIT", str(64 << 30))
    assert config.resolve_num_blocks(small) == (256 << 20) // small  # 5,825 tokens: the floor is plenty
    assert config.resolve_num_blocks(big) * 16 == 4096  # 1.5 GiB: 4,096 tokens
    monkeypatch.setenv("ROSECHAT_MEMORY_LIMIT", str(2 << 30))
    assert config.resolve_num_blocks(big) == (512 << 20) // big  # a quarter of 2 GiB
    monkeypatch.setenv("ROSECHAT_MEMORY_LIMIT", str(512 << 20))
    assert config.resolve_num_blocks(big) == (256 << 20) // big  # never below the floor


def test_rosechat_dtype_says_what_auto_is_on_this_machine(monkeypatch) -> None:
    monkeypatch.setenv("ROSECHAT_DTYPE", "bf16")
    d = defaults.resolve(flags=ZEN4_AVX512, cuda=False)
    assert d.dtype == "bfloat16" and d.dtype_reason.startswith("bfloat16: ROSECHAT_DTYPE") and not d.probe
    assert defaults.resolve(dtype="float32", flags=ZEN4_AVX512, cuda=False).dtype == "float32"  # asked for wins


def test_the_bfloat16_probe_keeps_the_dtype_measured_faster() -> None:
    """Only on a CPU with native bfloat16, and only where bfloat16 beats float32 by BF16_MARGIN."""
    asked = []

    def measure(times: dict[torch.dtype, float]):
        return lambda shapes, dtype: asked.append((tuple(shapes), dtype)) or times[dtype]

    shapes = [(192, 64), (64, 64), (256, 64), (64, 128)]
    avx2 = defaults.resolve(flags=ZEN3_AVX2, cuda=False)
    assert defaults.probe_cpu_dtype(avx2, shapes, measure({})) == avx2 and not asked  # nothing measured
    zen4 = defaults.resolve(flags=ZEN4_AVX512, cuda=False)
    assert zen4.probe and zen4.dtype == "float32"
    fast = defaults.probe_cpu_dtype(zen4, shapes, measure({torch.float32: 2.0, torch.bfloat16: 1.0}))
    assert asked == [(tuple(shapes), torch.float32), (tuple(shapes), torch.bfloat16)] * defaults.PROBE_ROUNDS
    assert fast.dtype == "bfloat16" and "measured 2.00x" in fast.reason and fast.kernels == zen4.kernels
    slow = defaults.probe_cpu_dtype(zen4, shapes, measure({torch.float32: 1.2, torch.bfloat16: 1.0}))
    assert slow.dtype == "float32" and "measured 1.20x" in slow.dtype_reason
    real = defaults.probe_cpu_dtype(zen4, shapes)  # this CPU's own timing: either answer, always a figure
    assert real.dtype in ("float32", "bfloat16") and "measured" in real.dtype_reason and not real.probe


def test_a_dense_load_measures_bfloat16_a_packed_one_does_not(tiny_llama, tmp_path, monkeypatch) -> None:
    """Through the loader and the engine: the measured dtype is the model's, its KV cache's and the title's."""
    from engine import LLMEngine, SamplingParams, load_model
    from tests.gguf_helpers import write_gguf

    if PINNED_ISA:
        monkeypatch.setenv("ROSECHAT_CPU_ISA", PINNED_ISA)
    flags = cpu_isa.cpu_flags() | ZEN4_AVX512  # this CPU's, as if it computed bfloat16 natively
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: flags)
    times = {torch.float32: 2.0, torch.bfloat16: 1.0}
    measured = []
    monkeypatch.setattr(defaults, "_time_linears", lambda shapes, dtype: measured.append(dtype) or times[dtype])
    loaded = load_model(str(tiny_llama))
    assert loaded.dtype == torch.bfloat16 and measured == [torch.float32, torch.bfloat16] * defaults.PROBE_ROUNDS
    engine = LLMEngine(loaded, EngineConfig(num_blocks=16))
    assert engine.runner.k_cache.dtype == torch.bfloat16
    assert engine.info.dtype == "bfloat16" and engine.info.reason.startswith("bfloat16: bfloat16 measured 2.00x")
    out = engine.generate([[3, 4, 5, 6]], SamplingParams(max_tokens=4, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 4
    times[torch.bfloat16] = 1.9  # not worth it
    assert load_model(str(tiny_llama)).dtype == torch.float32
    measured.clear()
    path = tmp_path / "packed.gguf"
    write_gguf(path, "llama", qtype="Q4_0", embed_qtype="Q8_0")
    assert load_model(path).dtype == torch.float32 and not measured  # packed: our float32 kernels
    assert load_model(path, quantization="none").dtype == torch.float32 and measured  # dense: measured
