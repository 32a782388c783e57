"""`rosechat bench serve` end to end on the demo model, small and bounded: a real `rosechat serve`
process on loopback beside the in-process engine."""

from __future__ import annotations

from rosechat.bench import serve


def test_bench_serve_reports_both_systems_without_errors() -> None:
    args = serve.build_parser().parse_args(
        ["--model", "demo", "--device", "cpu", "--num-blocks", "128", "--concurrency", "4", "--requests", "6",
         "--slow-readers", "1", "--max-tokens", "6", "--system-words", "60", "--user-words", "4",
         "--timeout", "120", "--repeats", "2"])
    report = serve.run(args)
    local, remote = report["systems"]
    for s in (local, remote):
        assert s["errors"] == 0, s["error_samples"]
        assert s["completion_tokens"] == 6 * 6  # ignore_eos: every request generates max_tokens (best round)
        assert s["output_tok_s"] > 0 and 0 < s["ttft_p50_s"] <= s["ttft_p95_s"]
        assert s["prefix_hit_rate"] > 0  # the shared system prompt
    assert report["identical_replies"] == "12/12"  # greedy: the server and the engine agree
    assert "serve / in-process" in serve.render(report)


def test_bench_serve_is_bounded() -> None:
    import pytest

    with pytest.raises(SystemExit):
        serve.run(serve.build_parser().parse_args(["--concurrency", str(serve.MAX_CONCURRENCY + 1)]))
