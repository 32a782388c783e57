"""`rosechat bench` end to end on a tiny random model: JSON shape, outputs checked against
transformers, prefix caching visible in prefill tokens and KV blocks, the multi-turn accounting,
the decode-overhead section and the profiler trace."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from rosechat.bench import main
from rosechat.bench.systems import CONTINUOUS, GENERATE, LLAMA_CPP, NO_PREFIX_CACHE, ROSECHAT, llama_cpp_available
from rosechat.bench.twin import Verifier, build_twin
from tests.helpers import make_tiny_model

SYSTEM_KEYS = {
    "name": str, "output_tok_s": float, "total_tok_s": float, "ttft_p50_s": float, "ttft_p95_s": float,
    "prefill_tokens": int, "peak_kv_bytes": int, "outputs_match": bool,
}
CHAT = dict(conversations=3, system_tokens=48, user_tokens=8, max_tokens=6)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("bench") / "tiny", "llama")


def run_bench(capsys: pytest.CaptureFixture, *argv: str) -> dict:
    # a small pool: continuous batching sizes its attention mask by the pool (tokens x batch tokens)
    threads = torch.get_num_threads()
    try:
        code = main([*argv, "--json", "--threads", "1", "--kv-cache-mib", "2"])
    finally:
        torch.set_num_threads(threads)  # the bench sets it process-wide
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report
    return report


def test_chat_json_matches_and_shares_the_system_prompt(tiny: Path, tmp_path: Path, capsys) -> None:
    c = CHAT
    report = run_bench(
        capsys, "chat", "--model", str(tiny),
        "--conversations", str(c["conversations"]), "--system-tokens", str(c["system_tokens"]),
        "--user-tokens", str(c["user_tokens"]), "--max-tokens", str(c["max_tokens"]),
        "--decode-batches", "2,4", "--decode-context", "20", "--decode-steps", "2", "--profile", str(tmp_path),
    )
    assert report["workload"] == "chat" and report["model"] == "tiny" and report["threads"] == 1
    systems = {s["name"]: s for s in report["systems"]}
    assert list(systems) == [ROSECHAT, NO_PREFIX_CACHE, GENERATE, CONTINUOUS]
    prompt_len = c["system_tokens"] + c["user_tokens"]
    for name, s in systems.items():
        for key, kind in SYSTEM_KEYS.items():
            assert isinstance(s[key], kind), (name, key, s[key])
        assert s["outputs_match"] is True, (name, s.get("mismatch"))
        assert s["output_tokens"] == c["conversations"] * c["max_tokens"]
        assert s["prompt_tokens"] == c["conversations"] * prompt_len
        assert s["output_tok_s"] > 0 and s["total_tok_s"] > s["output_tok_s"]
        assert 0 < s["ttft_p50_s"] <= s["ttft_p95_s"]
        assert s["peak_kv_bytes"] > 0
        assert s["vs_generate"]["output_tok_s"] == pytest.approx(s["output_tok_s"] / systems[GENERATE]["output_tok_s"])

    rc, plain = systems[ROSECHAT], systems[NO_PREFIX_CACHE]
    # the shared system prompt is computed once with the prefix cache, for every request without
    assert rc["prefill_tokens"] < plain["prefill_tokens"] == c["conversations"] * prompt_len
    assert rc["peak_kv_bytes"] < rc["peak_kv_bytes_without_sharing"]
    assert rc["peak_kv_blocks"] < rc["peak_kv_blocks_without_sharing"]
    assert plain["peak_kv_blocks"] == plain["peak_kv_blocks_without_sharing"]
    # generate() computes every prompt (same length here: no padding); its cache holds prompt + outputs - 1
    assert systems[GENERATE]["prefill_tokens"] == c["conversations"] * prompt_len
    kv_per_token = report["roofline"]["model"]["kv_bytes_per_token"]
    assert systems[GENERATE]["peak_kv_bytes"] == c["conversations"] * (prompt_len + c["max_tokens"] - 1) * kv_per_token

    roof = report["roofline"]
    assert roof["matmul_gflops"] > 0 and roof["mem_bw_gbs"] > 0
    assert 0 < roof["rosechat_decode"]["fraction"] and roof["rosechat_decode"]["limit_ms"] > 0
    decode = report["decode_overhead"]["batches"]
    assert [d["num_seqs"] for d in decode] == [2, 4]
    for d in decode:
        assert 0 < d["model_ms"] and 0 < d["host_ms"] < d["step_ms"]
        assert d["other_ms"] >= 0  # per step, host time holds scheduling, preparation and sampling
    assert {t["name"] for t in report["targets"]} >= {"decode step / model math at 4 seqs",
                                                     "rosechat peak KV blocks / without sharing"}
    trace = json.loads(Path(report["profile"]["trace"]).read_text())
    assert trace["traceEvents"] and report["profile"]["top_self_cpu"]


def test_multiturn_prefills_only_what_each_turn_adds(tiny: Path, capsys) -> None:
    convs, turns, user = 2, 3, 8
    report = run_bench(
        capsys, "multiturn", "--model", str(tiny), "--systems", f"{ROSECHAT},{NO_PREFIX_CACHE},{GENERATE}",
        "--conversations", str(convs), "--turns", str(turns), "--system-tokens", "40", "--user-tokens", str(user),
        "--max-tokens", "5",
    )
    assert all(s["outputs_match"] for s in report["systems"])
    later = report["turns"][1:]
    assert [t["turn"] for t in later] == list(range(2, turns + 1))
    for t in later:
        assert t["new_tokens"] == convs * user
        # the parked conversation computes its new message plus the last reply token, never fed back
        assert t["prefill_tokens"][ROSECHAT] == t["prefill_tokens"][NO_PREFIX_CACHE] == t["new_tokens"] + convs
        assert t["prefill_tokens"][GENERATE] == t["prompt_tokens"]  # the whole history, again


def test_verifier_rejects_a_token_that_is_not_the_argmax(tiny: Path) -> None:
    from engine.loader import load_model

    loaded = load_model(str(tiny))
    twin = build_twin(loaded, torch.float32)
    prompt = [10, 20, 30, 40]
    with torch.no_grad():
        logits = twin(torch.tensor([prompt])).logits[0, -1]
    best, worst = int(logits.argmax()), int(logits.argmin())
    verifier = Verifier(twin)
    assert verifier.check(prompt + [best], [len(prompt)]) is None
    problem = verifier.check(prompt + [worst], [len(prompt)])
    assert problem is not None and f"chose {worst}" in problem


def test_probe_block_counters_equal_the_cache_snapshot(tiny: Path) -> None:
    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.loader import load_model
    from rosechat.bench.probe import StepProbe

    loaded = load_model(str(tiny))
    engine = LLMEngine(loaded, EngineConfig(model="tiny", device="cpu", block_size=4))
    probe = StepProbe(engine)
    system = list(range(10, 30))
    for i in range(3):
        engine.add_request(system + [40 + i] * 3, SamplingParams(max_tokens=6, ignore_eos=True))
    shared_seen = False
    while engine.has_unfinished_requests():
        outputs, record = probe.step()
        if any(o.finished for o in outputs):
            continue  # finished sequences freed blocks after the probe counted them
        snap = engine.cache_snapshot()
        assert (probe.blocks, probe.blocks_unshared) == (snap.used_blocks, snap.blocks_without_sharing)
        assert record.num_seqs > 0 and record.total_s >= record.run_s >= record.prepare_s > 0
        shared_seen |= snap.shared_blocks > 0
    assert shared_seen and probe.peak_blocks < probe.peak_blocks_unshared


def test_random_lengths_through_continuous_batching(tiny: Path, capsys) -> None:
    report = run_bench(
        capsys, "random", "--model", str(tiny), "--systems", f"{ROSECHAT},{CONTINUOUS}",
        "--requests", "4", "--prompt-range", "5-40", "--output-range", "2-7", "--seed", "3",
    )
    rc, cb = report["systems"]
    assert rc["outputs_match"] and cb["outputs_match"], (rc.get("mismatch"), cb.get("mismatch"))
    assert rc["output_tokens"] == cb["output_tokens"] < 4 * 7  # each request its own length
    assert rc["prefill_tokens"] == rc["prompt_tokens"]  # nothing shared: everything computed


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.gguf_helpers import write_gguf

    path = tmp_path_factory.mktemp("bench-gguf") / "tiny-q4.gguf"
    write_gguf(path, "llama", qtype="Q4_0")
    return path


def test_chat_with_packed_weights_against_the_dense_model(tiny_gguf: Path, capsys) -> None:
    """--quantization: rosechat runs the packed weights, transformers the dense ones; the roofline
    counts the bytes a step streams (the packed ones)."""
    argv = ["chat", "--model", str(tiny_gguf), "--systems", f"{ROSECHAT},{GENERATE}", "--no-llama-cpp",
            "--conversations", "2", "--system-tokens", "32", "--user-tokens", "8", "--max-tokens", "5",
            "--decode-batches", "1", "--decode-context", "16", "--decode-steps", "2"]
    packed = run_bench(capsys, *argv)  # the default: what a user gets, the file's blocks kept packed
    dense = run_bench(capsys, *argv, "--quantization", "none")
    assert packed["quantization"] == "auto" and dense["quantization"] == "none"
    ours = f"rosechat {os.environ['ROSECHAT_CPU_ISA']}" if os.environ["ROSECHAT_CPU_ISA"] != "generic" else "torch"
    assert packed["kernels"].startswith(ours) and "float32" in packed["reason"]  # the header says what ran
    for report in (packed, dense):
        systems = {s["name"]: s for s in report["systems"]}
        assert list(systems) == [ROSECHAT, GENERATE]
        assert all(s["outputs_match"] for s in systems.values()), systems
        assert systems[ROSECHAT]["output_tokens"] == 2 * 5
    packed_bytes = packed["roofline"]["model"]["weight_bytes"]
    dense_bytes = dense["roofline"]["model"]["weight_bytes"]
    assert packed["roofline"]["model"]["matmul_params"] == dense["roofline"]["model"]["matmul_params"]
    assert 0 < packed_bytes < dense_bytes / 3  # 4-bit blocks against float32


@pytest.mark.skipif(not llama_cpp_available(), reason="llama-cpp-python is an optional extra (.[llamacpp])")
def test_llama_cpp_joins_the_chat_workload_on_a_gguf_file(tiny_gguf: Path, capsys) -> None:
    report = run_bench(capsys, "chat", "--model", str(tiny_gguf), "--systems", f"{ROSECHAT},{GENERATE}",
                       "--llama-cpp", "--quantization", "auto", "--conversations", "2", "--system-tokens", "32",
                       "--user-tokens", "8", "--max-tokens", "5", "--no-decode-overhead")
    systems = {s["name"]: s for s in report["systems"]}
    assert list(systems) == [ROSECHAT, GENERATE, LLAMA_CPP]
    cpp = systems[LLAMA_CPP]
    assert cpp["output_tokens"] == 2 * 5 and cpp["outputs_match"], cpp
    # the second conversation reuses the shared system prompt from llama.cpp's context
    assert cpp["prefill_tokens"] < 2 * (32 + 8)
