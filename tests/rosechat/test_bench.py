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
from rosechat.bench.twin import Verifier, _seen, build_twin
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
        "--user-tokens", str(c["user_tokens"]), "--max-tokens", str(c["max_tokens"]), "--sampling", "greedy",
        "--decode-batches", "2,4", "--decode-context", "20", "--decode-steps", "2", "--profile", str(tmp_path),
    )
    assert report["workload"] == "chat" and report["model"] == "tiny" and report["threads"] == 1
    systems = {s["name"]: s for s in report["systems"]}
    assert list(systems) == [ROSECHAT, NO_PREFIX_CACHE, GENERATE, CONTINUOUS]
    # the chat template wraps the system prompt and the user message in its markers
    prompt_len = systems[NO_PREFIX_CACHE]["prompt_tokens"] // c["conversations"]
    assert prompt_len > c["system_tokens"] + c["user_tokens"]
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
    assert 0 < report["decode_overhead"]["hash_us_per_block"] < 1000  # the prefix cache's blake2b per block
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
        "--max-tokens", "5", "--sampling", "greedy",
    )
    assert all(s["outputs_match"] for s in report["systems"])
    later = report["turns"][1:]
    assert [t["turn"] for t in later] == list(range(2, turns + 1))
    for t in later:
        # the user message and the template's markers around it (end of the reply, the next assistant turn)
        assert t["new_tokens"] > convs * user
        # the parked conversation computes its new message plus the last reply token, never fed back
        assert t["prefill_tokens"][ROSECHAT] == t["prefill_tokens"][NO_PREFIX_CACHE] == t["new_tokens"] + convs
        assert t["prefill_tokens"][GENERATE] == t["prompt_tokens"]  # the whole history, again


def test_verifier_rejects_a_token_that_is_not_the_argmax(tiny: Path) -> None:
    from engine.weights.loader import load_model

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


def test_verifier_checks_the_setting_that_ran(tiny: Path) -> None:
    """A repetition penalty and a nucleus change which tokens are allowed: the check follows the setting."""
    from engine.weights.loader import load_model

    twin = build_twin(load_model(str(tiny)), torch.float32)
    verifier = Verifier(twin)
    prompt = [10, 20, 30, 40]
    with torch.no_grad():
        logits = twin(torch.tensor([prompt])).logits[0, -1]
    order = logits.argsort(descending=True).tolist()
    best, second = order[0], order[1]
    # the best token was already generated (it is in the reply's window): a heavy penalty makes it lose
    tokens, generated = prompt + [best, best], [4, 5]
    heavy = {"repetition_penalty": 1e6, "repetition_window": 64}
    assert verifier.check(prompt + [best], [4], heavy) is None  # nothing of the reply seen yet
    problem = verifier.check(tokens, generated, heavy)
    assert problem is not None and "#1 of 2" in problem
    with torch.no_grad():
        penalised = twin(torch.tensor([prompt + [best]])).logits[0, -1]
    v = penalised[best]
    penalised[best] = v / 1e6 if v > 0 else v * 1e6
    assert verifier.check(prompt + [best, int(penalised.argmax())], generated, heavy) is None
    # what the penalty looks at, as the engine: with a window, the reply so far (runs of generated positions)
    # within the window; without, the prompt too
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    windowed = _seen(tokens, [4, 5, 7], window=1)
    assert windowed[0] == []  # position 4 starts the reply: nothing seen
    assert windowed[1] == [5]  # the reply's last token, within the window of 1
    assert windowed[2] == []  # 7 starts another reply (6 was not generated)
    assert _seen(tokens, [4], window=None)[0] == [1, 2, 3, 4]  # without a window, the prompt too
    # nucleus: the second-best token is inside a wide nucleus, outside one only the best fills
    probs = (logits / 0.7).softmax(-1)
    wide = {"temperature": 0.7, "top_p": min(1.0, float(probs[best]) + 1e-3)}
    narrow = {"temperature": 0.7, "top_p": float(probs[best]) * 0.5}
    assert verifier.check(prompt + [second], [4], wide) is None
    assert "outside the top-p" in (verifier.check(prompt + [second], [4], narrow) or "")
    assert verifier.check(prompt + [best], [4], narrow) is None  # the top token is always in


def test_chat_runs_every_sampling_setting_for_rosechat(tiny: Path, capsys) -> None:
    report = run_bench(capsys, "chat", "--model", str(tiny), "--systems", f"{ROSECHAT},{NO_PREFIX_CACHE},{GENERATE}",
                       "--conversations", "2", "--system-tokens", "24", "--user-tokens", "8", "--max-tokens", "6",
                       "--no-decode-overhead")
    rows = [(s["name"], s["sampling"]) for s in report["systems"]]
    # the transformers systems and the no-prefix-cache run greedy only
    assert rows == [(ROSECHAT, "greedy"), (NO_PREFIX_CACHE, "greedy"), (GENERATE, "greedy"),
                    (ROSECHAT, "app"), (ROSECHAT, "t0.7-p0.9")]
    greedy = report["systems"][0]
    for s in report["systems"]:
        assert s["outputs_match"], s
        assert s["output_tokens"] == 2 * 6 and s["prompt_tokens"] == greedy["prompt_tokens"]
    for s in report["systems"][3:]:
        assert s["label"] == f"rosechat [{s['sampling']}]"
        assert s["output_vs_own_greedy"] == pytest.approx(s["output_tok_s"] / greedy["output_tok_s"])
    targets = {t["name"] for t in report["targets"]}
    assert {"rosechat [app] output tok/s / rosechat greedy", "rosechat [t0.7-p0.9] output tok/s / rosechat greedy"} \
        <= targets


def test_probe_block_counters_equal_the_cache_snapshot(tiny: Path) -> None:
    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.weights.loader import load_model
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
    argv = ["chat", "--model", str(tiny_gguf), "--systems", f"{ROSECHAT},{GENERATE}", "--no-llama-cpp", "--sampling",
            "greedy",
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
    rows = {(s["name"], s["sampling"]): s for s in report["systems"]}
    # every setting: rosechat and llama.cpp side by side; generate() greedy only
    assert list(rows) == [(ROSECHAT, "greedy"), (GENERATE, "greedy"), (LLAMA_CPP, "greedy"),
                          (ROSECHAT, "app"), (LLAMA_CPP, "app"), (ROSECHAT, "t0.7-p0.9"), (LLAMA_CPP, "t0.7-p0.9")]
    for (name, sampling), s in rows.items():
        assert s["output_tokens"] == 2 * 5 and s["outputs_match"], s
        if name == ROSECHAT:
            peer = rows[LLAMA_CPP, sampling]["output_tok_s"]
            assert s["output_vs_llama_cpp"] == pytest.approx(s["output_tok_s"] / peer)
    cpp = rows[LLAMA_CPP, "greedy"]
    # the second conversation reuses the shared system prompt from llama.cpp's context
    assert cpp["prefill_tokens"] < cpp["prompt_tokens"]
