"""`rosechat bench quant`: the microbenchmark's routes and the per-quantization decode runs, on
tiny shapes and a tiny GGUF file (the figures themselves are measured by hand, not asserted)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from rosechat.bench import quant, quant_decode

pytestmark = pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"),
                                reason="torch without the CPU weight-only kernels")


def test_every_route_runs_on_a_small_shape() -> None:
    with torch.no_grad():
        results = quant.measure([("tiny 64->32", 64, 32)], [1, 2], repeats=1, cold_bytes=1 << 16)
    routes = {r["route"] for r in results}
    assert {"fp32 F.linear", "int8pack bf16", "int4pack bf16", "int4pack fp32->bf16", "rosechat q4 fp32",
            "rosechat q8 fp32"} <= routes
    assert len(results) == 2 * len(routes) and all(r["us"] > 0 for r in results)
    table = quant.render(results)
    assert "tiny 64->32" in table and "int4pack bf16" in table


def test_decode_runs_each_quantization_in_its_own_process(tmp_path: Path) -> None:
    from tests.gguf_helpers import write_gguf

    path = tmp_path / "tiny-q4.gguf"
    write_gguf(path, "llama", qtype="Q4_0")
    results = quant_decode.run_decode(str(path), ["none", "auto", "auto/torch"], threads=1, prompt_tokens=40,
                                      new_tokens=6, streams=[2])
    none, auto, auto_torch = results
    assert none["packed_bytes"] == 0 and auto["packed_bytes"] > 0
    # ours keeps the file's float16 d and m per block; torch's int4 a bf16 scale and zero per group plus, for the
    # tied embedding's lookups, a plain copy of its nibbles: the routes differ, ours the smaller
    assert 0 < auto["packed_bytes"] < auto_torch["packed_bytes"]
    assert auto["dense_bytes"] < none["dense_bytes"]
    assert none["decode_tok_s"] > 0 and auto["decode_tok_s"] > 0
    # the prefill figure times whole prompts: none of their 16-token blocks came from the prefix cache
    assert auto["prefilled_tokens"] == 2 * 40
    assert "auto" in quant_decode.render_decode(results)


def test_rounds_give_medians_and_ratios_paired_within_a_round() -> None:
    """A machine whose speed drifts between rounds: each round's ratio compares its own runs."""
    base = {"streams": 1, "load_s": 1.0, "packed_bytes": 1, "dense_bytes": 0, "file_bytes": 1, "prefill_tok_s": 1.0,
            "rss_before": {"VmRSS": 0, "RssAnon": 0}, "rss_after": {"VmRSS": 1, "RssAnon": 1}}
    speed = [1.0, 0.5, 0.8]  # the machine's, per round
    results = [{**base, "mode": mode, "sampling": sampling, "round": r, "decode_tok_s": tok * speed[r]}
               for r in range(3) for sampling, scale in (("greedy", 1.0), ("app", 0.9))
               for mode, tok in (("auto", 130.0 * scale), (quant_decode.LLAMA_CPP, 100.0))]
    rows = {(r["mode"], r["sampling"]): r for r in quant_decode.summarize(results)}
    auto, app = rows["auto", "greedy"], rows["auto", "app"]
    assert auto["decode_tok_s"] == 104.0 and auto["runs"] == [130.0, 65.0, 104.0]  # the median run
    assert auto["vs_peer"] == pytest.approx([1.3] * 3)  # the drift cancels within each round
    assert app["vs_greedy"] == pytest.approx([0.9] * 3) and app["vs_peer"] == pytest.approx([1.17] * 3)
    assert rows[quant_decode.LLAMA_CPP, "app"]["vs_peer"] == []
    table = quant_decode.render_decode(results)
    assert "1.30x (1.30-1.30)" in table and "0.90x" in table and "medians of 3 rounds" in table


def test_memory_prefill_and_load_time_are_the_medians_of_the_rounds() -> None:
    """A fresh install's first load builds the weight cache (the packed weights held in anonymous memory, a
    slow load): the rows took the first round's figures, showing 1.3x the file where every later load adds
    0.25x."""
    mib = 2**20
    results = [{"mode": "auto", "sampling": "greedy", "streams": 1, "round": r, "decode_tok_s": 100.0,
                "packed_bytes": 1, "dense_bytes": 0, "file_bytes": 100 * mib, "load_s": load, "prefill_tok_s": pre,
                "rss_before": {"VmRSS": 0, "RssAnon": 0}, "rss_after": {"VmRSS": rss * mib, "RssAnon": anon * mib}}
               for r, (load, pre, rss, anon) in enumerate([(3.0, 500.0, 130, 106), (0.2, 1000.0, 25, -13),
                                                            (0.3, 1100.0, 23, -14)])]
    (row,) = quant_decode.summarize(results)
    assert (row["load_s"], row["prefill_tok_s"]) == (0.3, 1000.0)
    assert (row["rss"], row["rss_anon"]) == (25 * mib, -13 * mib)
    line = quant_decode.render_decode(results).splitlines()[2]
    assert line.split()[5:8] == ["-13", "25", "0.25"]


@pytest.mark.skipif(not quant_decode.llama_cpp_available(),
                    reason="llama-cpp-python is an optional extra (.[llamacpp])")
def test_llama_cpp_runs_as_a_peer_on_the_same_file() -> None:
    from engine import resolve_model

    source = resolve_model("smollm2-135m-instruct")
    results = quant_decode.run_decode(str(source.path), [quant_decode.LLAMA_CPP], threads=1, prompt_tokens=8,
                                      new_tokens=6, streams=[2])
    (r,) = results
    assert r["mode"] == "llama.cpp" and r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0
    assert "llama.cpp seq" in quant_decode.render_decode(results)  # 2 streams run one after another


def test_the_busy_neighbour_computes_while_the_runs_go_on_and_is_gone_after() -> None:
    def cpu_ticks(pid: int) -> int:  # utime + stime of the process, in clock ticks
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])

    with quant_decode.neighbour(0) as none:
        assert none is None
    with quant_decode.neighbour(1) as proc:
        assert proc is not None
        deadline = time.monotonic() + 60
        while cpu_ticks(proc.pid) < 20 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # polling a condition (its CPU time), with a deadline
        assert proc.poll() is None, "the neighbour died"
        assert cpu_ticks(proc.pid) >= 20  # 0.2 s of CPU: it computes, it does not sleep
    assert proc.poll() is not None  # killed and reaped


@pytest.mark.parametrize(("flags", "env", "use"), [
    ("fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8", None, False),  # Sapphire Rapids and later
    ("fpu avx2 avx512f avx512_vnni avx512_bf16", None, True),  # Zen 4
    ("fpu avx2 fma", None, True),  # Zen 3
    ("fpu avx2 avx512f amx_tile amx_int8", "on", True),
    ("fpu avx2 fma", "off", False),
])
def test_llama_cpp_extra_buffer_types_follow_the_cpu_and_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      flags: str, env: str | None, use: bool) -> None:
    """llama.cpp's AMX matmul crashes on AMX CPUs (llama-cpp-python 0.3.36): its extra buffer types are off
    there by default, with the reason in the report, and the variable overrides either way."""
    from rosechat.bench import llama_load

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    monkeypatch.setattr(llama_load, "CPUINFO", str(cpuinfo))
    if env is None:
        monkeypatch.delenv(llama_load.ENV, raising=False)
    else:
        monkeypatch.setenv(llama_load.ENV, env)
    allowed, why = llama_load.extra_bufts()
    assert allowed is use and (why == "") is use
    assert ("AMX" in why) is (not use and env is None)
    monkeypatch.setenv(llama_load.ENV, "sometimes")
    with pytest.raises(ValueError, match="auto, on or off"):
        llama_load.extra_bufts()
