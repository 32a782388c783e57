"""`rosechat bench serve` end to end on the demo model, small and bounded: a real `rosechat serve`
process on loopback beside the in-process engine."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from rosechat.bench import serve, server_process


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
    with pytest.raises(SystemExit):
        serve.run(serve.build_parser().parse_args(["--concurrency", str(serve.MAX_CONCURRENCY + 1)]))


# ---------------------------------------------------------------------- ServerProcess start-up: always bounded
def _spy_popen(monkeypatch: pytest.MonkeyPatch) -> list[subprocess.Popen]:
    """The processes ServerProcess starts (it raises from its constructor: no handle comes back)."""
    started: list[subprocess.Popen] = []
    popen = subprocess.Popen

    def spy(*args, **kwargs):
        started.append(popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(subprocess, "Popen", spy)
    return started


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_silent_server_fails_at_the_deadline_and_is_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    started = _spy_popen(monkeypatch)
    t0 = time.monotonic()
    silent = r"has not printed its address within 1 s .*still running"
    with pytest.raises(server_process.ChildStartError, match=silent) as info:
        # one line, then nothing more: the wait must not hang on a next line that never comes
        server_process.ServerProcess([], timeout=1.0, command=_python(
            "import sys, time; print('loading the model', file=sys.stderr, flush=True); time.sleep(120)"))
    assert time.monotonic() - t0 < 20  # the deadline, plus stopping it (SIGINT, a kill after 5 s)
    (proc,) = started
    assert proc.poll() is not None, "the silent server was left running"
    if "loading the model" not in str(info.value):  # its last words, once they were read before the deadline
        assert "wrote nothing to stderr" in str(info.value)


def test_a_server_that_prints_nothing_at_all_fails_at_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    started = _spy_popen(monkeypatch)
    t0 = time.monotonic()
    with pytest.raises(server_process.ChildStartError, match="it wrote nothing to stderr"):
        server_process.ServerProcess([], timeout=0.5, command=_python("import time; time.sleep(120)"))
    assert time.monotonic() - t0 < 20
    assert started[0].poll() is not None


def test_a_server_that_exits_at_once_is_said_with_its_code_and_last_words() -> None:
    t0 = time.monotonic()
    with pytest.raises(server_process.ChildStartError) as info:
        server_process.ServerProcess([], timeout=300.0, command=_python(
            "import sys; print('rosechat serve: no such model: nope', file=sys.stderr); sys.exit(3)"))
    assert time.monotonic() - t0 < 60  # seen as it exits, not at the (long) deadline
    message = str(info.value)
    assert "exited with code 3 before printing its address" in message and "no such model: nope" in message


def test_the_address_is_read_and_the_log_kept_draining() -> None:
    # the address, then far more log than a pipe holds: nobody reads the log, yet the child never
    # blocks writing it (it could not exit if it did)
    server = server_process.ServerProcess([], timeout=120.0, command=_python(
        "import sys\n"
        "print('rosechat serve: demo on http://127.0.0.1:4321/v1', file=sys.stderr, flush=True)\n"
        "for i in range(20000): print('request', i, 'x' * 60, file=sys.stderr)\n"))
    try:
        assert server.url == "http://127.0.0.1:4321"
        assert server.proc.wait(timeout=60) == 0
        assert server.log.wait_closed(30) and "request 19999" in server.log.text()
    finally:
        server.stop(grace=10)
