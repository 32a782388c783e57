"""`rosechat serve` while its model loads: the socket answers at once, /health says the stage with 503,
every API path 503 model_loading, and the same server serves once the load ends. Real sockets, real
clients; the load is held at a gate (a thread event), so "while loading" lasts as long as the test needs."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx
import openai

from engine import LLMEngine
from engine.weights.loader import Stages
from rosechat.bench.server_process import ServerProcess
from rosechat.server.app import ServerSettings, create_app
from rosechat.server.loading import LoadingServer
from rosechat.server.run import start_background


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def gated_server(gate: threading.Event, *, fail: bool = False):
    logged: list[str] = []
    failures: list[str] = []

    def load(progress) -> LLMEngine:
        say = Stages(progress)
        say("converting the tokenizer")
        for done in range(0, 46, 5):
            say("repacking weights", done, 100)
        assert gate.wait(60), "the test never opened the gate"
        if fail:
            raise ValueError("the file is damaged")
        return LLMEngine.from_pretrained("demo", progress, device="cpu", num_blocks=64, cuda_graphs=False)

    app = LoadingServer(load, lambda llm: create_app(llm, ServerSettings(model_name="demo")), log=logged.append,
                        on_failed=failures.append)
    return start_background(app), app, logged, failures  # type: ignore[arg-type]


def test_health_says_the_stage_until_the_model_is_ready_then_the_server_serves() -> None:
    gate = threading.Event()
    server, app, logged, _ = gated_server(gate)
    try:
        wait_for(lambda: app.progress is not None and app.progress.done == 45, "the load to reach 45 %")
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 503 and health.headers["retry-after"] == "1"
        body = health.json()
        assert body["status"] == "loading" and body["stage"] == "repacking weights"
        assert (body["done"], body["total"]) == (45, 100) and body["elapsed_s"] >= 0
        models = httpx.get(f"{server.url}/v1/models", timeout=10)
        assert models.status_code == 503 and models.json()["error"]["code"] == "model_loading"
        assert "repacking weights 45/100" in models.json()["error"]["message"]
        # the log: each stage once, a counted stage at each quarter (not at every step)
        assert [line for line in logged if "converting" in line] == [logged[0]]
        assert sum("repacking weights" in line for line in logged) == 2  # 0/100 and 25/100

        gate.set()
        wait_for(lambda: httpx.get(f"{server.url}/health", timeout=10).status_code == 200, "/health 200")
        assert any("allocating the KV pool" in line for line in logged)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        reply = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4)
        assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.completion_tokens >= 1
    finally:
        gate.set()
        server.stop()
    assert not server.thread.is_alive()


def test_a_load_that_fails_is_said_by_health_and_ends_the_server() -> None:
    gate = threading.Event()
    server, app, logged, failures = gated_server(gate, fail=True)
    try:
        gate.set()
        wait_for(lambda: bool(failures), "the failure to be reported")
        assert "the file is damaged" in failures[0] and any("failed to load" in line for line in logged)
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert "the file is damaged" in health.json()["error"]
        chat = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": []}, timeout=10)
        assert chat.status_code == 503 and "failed to load" in chat.json()["error"]["message"]
    finally:
        server.stop()


def test_rosechat_serve_logs_each_stage_before_it_is_ready() -> None:
    server = ServerProcess(["--model", "demo", "--num-blocks", "64"], timeout=120)
    try:
        assert httpx.get(f"{server.url.removesuffix('/v1')}/health", timeout=10).status_code == 200
        log = server.log.text()
        assert "listening on http://127.0.0.1:" in log and "/health answers 503" in log
        assert log.index("listening on") < log.index("loading: allocating the KV pool") < log.index("/v1")
    finally:
        server.stop()
