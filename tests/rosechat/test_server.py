"""`rosechat serve` over real sockets on 127.0.0.1: the official openai client, raw bad requests,
disconnects, auth, limits and /metrics. Each server runs uvicorn on a thread with the demo model."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import LLMEngine
from rosechat.server.app import ServerSettings, create_app
from rosechat.server.run import BackgroundServer, start_background

KEY = "s3cret-test-key"
SYSTEM = "You are a helpful assistant. " * 12  # a few KV blocks: what the prefix cache reuses


def _serve(**settings) -> Iterator[BackgroundServer]:
    # plain decoding: the disconnect, abort and queue tests need a greedy reply still running a while after its
    # first token, and speculation decodes the demo model's repetitive greedy text several tokens a step
    # (speculation through the server: test_speculation_counters_reach_metrics_and_the_kv_map)
    llm = LLMEngine.from_pretrained("demo", device="cpu", num_blocks=128, block_size=16, cuda_graphs=False,
                                     speculative_config=None)
    server = start_background(create_app(llm, ServerSettings(model_name="demo", **settings)))
    try:
        yield server
    finally:
        server.stop()
        assert not server.thread.is_alive()


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    yield from _serve(max_n=4)


@pytest.fixture(scope="module")
def guarded() -> Iterator[BackgroundServer]:
    yield from _serve(api_key=KEY, max_queued=1, max_body_bytes=4096)


def client(server: BackgroundServer, key: str = "unused") -> openai.OpenAI:
    # the client insists on a key even for an open server; no retries, so a failure shows at once
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)


def wait_for(predicate: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def chat(text: str, history: list[dict] | None = None) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, *(history or []), {"role": "user", "content": text}]


def kv(server: BackgroundServer) -> dict:
    return httpx.get(f"{server.url}/v1/rosechat/kv", timeout=10).json()


def metric_samples(server: BackgroundServer, key: str | None = None) -> dict[tuple[str, tuple], float]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    text = httpx.get(f"{server.url}/metrics", headers=headers, timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


# ---------------------------------------------------------------------- the API, with the openai client
def test_health_and_models(server: BackgroundServer) -> None:
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    models = client(server).models.list()
    assert [m.id for m in models.data] == ["demo"]


def test_chat_non_stream_and_stream_agree(server: BackgroundServer) -> None:
    c = client(server)
    full = c.chat.completions.create(model="demo", messages=chat("hello there"), max_tokens=8, temperature=0)
    text = full.choices[0].message.content
    assert full.choices[0].finish_reason in ("stop", "length") and full.object == "chat.completion"
    assert full.usage.completion_tokens <= 8 and full.usage.prompt_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    chunks = list(c.chat.completions.create(model="demo", messages=chat("hello there"), max_tokens=8,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == text  # greedy: the same reply, token for token
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(ch.usage is None for ch in chunks[:-1])


def test_n_samples_seed_and_sampling_fields(server: BackgroundServer) -> None:
    c = client(server)
    kwargs = dict(model="demo", messages=chat("tell me a story"), max_tokens=6, temperature=1.0, top_p=0.9,
                  seed=7, n=3, extra_body={"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1})
    a, b = c.chat.completions.create(**kwargs), c.chat.completions.create(**kwargs)
    assert [ch.index for ch in a.choices] == [0, 1, 2]
    assert [ch.message.content for ch in a.choices] == [ch.message.content for ch in b.choices]  # seeded
    stream = list(c.chat.completions.create(**kwargs, stream=True))
    texts = ["".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices and ch.choices[0].index == i)
             for i in range(3)]
    assert texts == [ch.message.content for ch in a.choices]


def test_stop_string_cuts_the_reply(server: BackgroundServer) -> None:
    c = client(server)
    free = c.chat.completions.create(model="demo", messages=chat("go on"), max_tokens=12, temperature=0)
    text = free.choices[0].message.content
    words = text.split()
    assert len(words) >= 3, text
    stop = words[2]
    cut = c.chat.completions.create(model="demo", messages=chat("go on"), max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.index(stop)]
    chunks = list(c.chat.completions.create(model="demo", messages=chat("go on"), max_tokens=12, temperature=0,
                                            stop=stop, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == text[: text.index(stop)]  # none leaks
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completions_endpoint(server: BackgroundServer) -> None:
    c = client(server)
    done = c.completions.create(model="demo", prompt="the world and", max_tokens=6, temperature=0)
    assert done.object == "text_completion" and done.usage.completion_tokens <= 6
    chunks = list(c.completions.create(model="demo", prompt="the world and", max_tokens=6, temperature=0,
                                       stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == done.choices[0].text
    by_ids = c.completions.create(model="demo", prompt=[5, 6, 7, 8], max_tokens=3, temperature=0)
    assert by_ids.usage.prompt_tokens == 4


def test_completions_echo_the_prompt_streamed_and_not(server: BackgroundServer) -> None:
    c = client(server)
    plain = c.completions.create(model="demo", prompt="the world and", max_tokens=6, temperature=0)
    echoed = c.completions.create(model="demo", prompt="the world and", max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == "the world and" + plain.choices[0].text
    chunks = [ch.choices[0].text for ch in c.completions.create(model="demo", prompt="the world and", max_tokens=6,
                                                                temperature=0, echo=True, stream=True) if ch.choices]
    assert chunks[0] == "the world and" and "".join(chunks) == echoed.choices[0].text
    ids = [40, 41, 42, 43]  # token ids: echoed as their text
    plain = c.completions.create(model="demo", prompt=ids, max_tokens=2, temperature=0).choices[0].text
    echoed_ids = c.completions.create(model="demo", prompt=ids, max_tokens=2, temperature=0, echo=True)
    assert echoed_ids.choices[0].text.endswith(plain) and len(echoed_ids.choices[0].text) > len(plain)


def test_echo_with_logprobs_scores_the_prompt_streamed_and_not(server: BackgroundServer) -> None:
    """What evaluation harnesses send: the prompt's tokens with their logprobs (the first has none), then the
    completion's, in one legacy logprobs object; streamed, the echo chunk carries the prompt's."""
    c = client(server)
    kw = dict(model="demo", prompt="the cat sat on the mat", max_tokens=3, temperature=0, echo=True, logprobs=2)
    r = c.completions.create(**kw)
    lp = r.choices[0].logprobs
    n_prompt, n_out = r.usage.prompt_tokens, r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n_prompt + n_out
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(len(t) == 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and r.choices[0].text.startswith("the cat sat on the mat")
    chunks = [ch.choices[0] for ch in c.completions.create(stream=True, **kw) if ch.choices]
    assert chunks[0].text == "the cat sat on the mat"
    assert chunks[0].logprobs.token_logprobs == lp.token_logprobs[:n_prompt]
    streamed = [v for ch in chunks[1:] if ch.logprobs for v in ch.logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs[n_prompt:])


def test_resent_history_hits_the_prefix_cache(server: BackgroundServer) -> None:
    c = client(server)
    first = c.chat.completions.create(model="demo", messages=chat("first question " * 8), max_tokens=8,
                                      temperature=0)
    reply = first.choices[0].message.content
    history = [{"role": "user", "content": "first question " * 8}, {"role": "assistant", "content": reply}]
    second = c.chat.completions.create(model="demo", messages=chat("and a second one", history), max_tokens=4,
                                       temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # all the full blocks of the first prompt come from the cache: only the new turn is prefilled
    assert cached >= (first.usage.prompt_tokens // 16) * 16 > 0
    assert cached < second.usage.prompt_tokens


def test_logprobs_in_chat_streamed_and_not_and_in_completions(server: BackgroundServer) -> None:
    c = client(server)
    kw = dict(model="demo", messages=chat("Count to five."), max_tokens=6, temperature=0, logprobs=True,
              top_logprobs=3, extra_body={"ignore_eos": True})
    whole = c.chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 6
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the most likely token was chosen
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert bytes(entry.bytes) == entry.token.encode()
    streamed = [e for ch in c.chat.completions.create(**kw, stream=True) if ch.choices and ch.choices[0].logprobs
                for e in ch.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in content]
    # without logprobs, none are sent
    assert c.chat.completions.create(**{**kw, "logprobs": False, "top_logprobs": None}).choices[0].logprobs is None

    done = c.completions.create(model="demo", prompt="Once upon a time", max_tokens=5, temperature=0, logprobs=2,
                                extra_body={"ignore_eos": True})
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(len(top) <= 2 and max(top.values()) == pytest.approx(v) for top, v in zip(lp.top_logprobs,
                                                                                     lp.token_logprobs))
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_cache_salt_keeps_tenants_caches_apart(server: BackgroundServer) -> None:
    c = client(server)
    messages = chat("a tenant's private document " * 10)

    def cached(salt: str) -> int:
        reply = c.chat.completions.create(model="demo", messages=messages, max_tokens=2, temperature=0,
                                          extra_body={"cache_salt": salt})
        return reply.usage.prompt_tokens_details.cached_tokens

    cached("tenant-a")
    assert cached("tenant-b") == 0  # the same prompt, another salt: computed anew
    assert cached("tenant-a") >= 16  # the first tenant's blocks are still there for it


# ---------------------------------------------------------------------- bad requests
GOOD = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
BAD: list[tuple[str, bytes | dict, int, str | None]] = [
    ("malformed JSON", b'{"model": "demo", "messages": [', 400, None),
    ("not an object", b"[1, 2, 3]", 400, None),
    ("messages wrong type", {**GOOD, "messages": "hi"}, 400, "messages"),
    ("max_tokens wrong type", {**GOOD, "max_tokens": "many"}, 400, "max_tokens"),
    ("negative max_tokens", {**GOOD, "max_tokens": -5}, 400, "max_tokens"),
    ("unknown model", {**GOOD, "model": "gpt-9"}, 404, "model"),
    ("n over the limit", {**GOOD, "n": 99}, 400, "n"),
    ("temperature out of range", {**GOOD, "temperature": -1}, 400, "temperature"),
    ("unknown role", {**GOOD, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ("prompt longer than the context", {**GOOD, "messages": [{"role": "user", "content": "word " * 3000}]},
     400, "messages"),
    ("max_tokens past the context", {**GOOD, "max_tokens": 5000}, 400, "max_tokens"),
    ("empty messages", {**GOOD, "messages": []}, 400, "messages"),
    # fields of the API rosechat does not implement: refused, never silently ignored
    ("a JSON schema that does not compile", {**GOOD, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}}, 400, "response_format"),
    ("a regex that does not compile", {**GOOD, "guided_regex": "(ab"}, 400, "guided_regex"),
    ("two constraints at once", {**GOOD, "guided_regex": "a+", "guided_choice": ["a"]}, 400, None),
    ("an empty choice", {**GOOD, "guided_choice": []}, 400, None),
    ("the legacy functions", {**GOOD, "functions": [{"name": "f"}]}, 400, "functions"),
    ("a tool without its function", {**GOOD, "tools": [{"type": "function"}]}, 400, "tools.0.function"),
    ("top_logprobs without logprobs", {**GOOD, "top_logprobs": 2}, 400, "top_logprobs"),
    ("top_logprobs over 20", {**GOOD, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("a presence penalty", {**GOOD, "presence_penalty": 0.5}, 400, "presence_penalty"),
    # a misspelled field is not dropped without a word
    ("unknown field", {**GOOD, "temprature": 0.2}, 400, "temprature"),
    ("unknown field in a message", {**GOOD, "messages": [{"role": "user", "content": "x", "mood": 1}]}, 400,
     "messages.0.mood"),
]


@pytest.mark.parametrize("name,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_request_gets_an_openai_error_and_the_server_goes_on(server, name, body, status, param) -> None:
    url = f"{server.url}/v1/chat/completions"
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"Content-Type": "application/json"}, timeout=30)
    else:
        r = httpx.post(url, json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    ok = httpx.post(url, json=GOOD, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["role"] == "assistant"


def test_neutral_values_of_unimplemented_fields_and_harmless_ones_pass(server: BackgroundServer) -> None:
    """What SDKs send by default asks for nothing: presence_penalty 0, a text response format, a user id."""
    body = {**GOOD, "presence_penalty": 0, "frequency_penalty": 0.0, "response_format": {"type": "text"},
            "user": "u-1", "logprobs": False, "tool_choice": "auto"}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text


def test_unknown_fields_pass_where_the_server_allows_them() -> None:
    for server in _serve(allow_unknown_fields=True):
        url = f"{server.url}/v1/chat/completions"
        assert httpx.post(url, json={**GOOD, "temprature": 0.2}, timeout=60).status_code == 200
        # what rosechat does not implement is refused all the same
        assert httpx.post(url, json={**GOOD, "presence_penalty": 0.5}, timeout=60).status_code == 400


def test_openapi_describes_the_real_schema(server: BackgroundServer) -> None:
    spec = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    chat = spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"messages", "temperature", "cache_salt", "seed"} <= set(chat)
    assert {"logprobs", "top_logprobs", "response_format", "guided_json", "guided_choice", "tools"} <= set(chat)
    assert not {"functions", "presence_penalty"} & set(chat)  # refused: not in the schema
    assert httpx.get(f"{server.url}/docs", timeout=30).status_code == 200


def test_bad_requests_through_the_openai_client(server: BackgroundServer) -> None:
    c = client(server)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="nope", messages=chat("x"), max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="demo", prompt="x", max_tokens=0)
    with pytest.raises(openai.BadRequestError):  # token ids outside the vocabulary: the engine refuses
        c.completions.create(model="demo", prompt=[10**7], max_tokens=2)
    assert httpx.get(f"{server.url}/v1/nothing-here", timeout=10).json()["error"]["message"]


# ---------------------------------------------------------------------- disconnects free their blocks
def _aborts(server: BackgroundServer) -> float:
    return metric_samples(server).get(
        ("vllm:request_success_total", (("finished_reason", "abort"), ("model_name", "demo"))), 0.0)


def test_streaming_client_disconnect_aborts_and_frees_blocks(server: BackgroundServer) -> None:
    before = _aborts(server)
    body = {**GOOD, "max_tokens": 1800, "ignore_eos": True, "stream": True, "messages": chat("a long answer please")}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        while not next(lines).startswith('data: {"id"'):
            pass
    wait_for(lambda: _aborts(server) > before)
    wait_for(lambda: kv(server)["used_blocks"] == 0 and kv(server)["num_running"] == 0)


def test_non_streaming_client_disconnect_aborts_and_frees_blocks(server: BackgroundServer) -> None:
    before = _aborts(server)
    # ignore_eos: the reply cannot end by itself before the client gives up
    body = {**GOOD, "max_tokens": 1800, "ignore_eos": True, "messages": chat("another long answer")}
    outcome: list[BaseException | httpx.Response] = []

    def go() -> None:
        try:  # the client gives up after 1 s without an answer and closes its connection
            outcome.append(httpx.post(f"{server.url}/v1/chat/completions", json=body,
                                      timeout=httpx.Timeout(60, read=1.0)))
        except BaseException as e:
            outcome.append(e)

    t = threading.Thread(target=go)
    t.start()
    t.join(60)
    assert len(outcome) == 1 and isinstance(outcome[0], httpx.ReadTimeout), outcome
    wait_for(lambda: _aborts(server) > before)
    wait_for(lambda: kv(server)["used_blocks"] == 0 and kv(server)["num_running"] == 0)


# ---------------------------------------------------------------------- metrics and the KV map
def test_metrics_use_vllm_names_and_move(server: BackgroundServer) -> None:
    m0 = metric_samples(server)
    names = {name for name, _ in m0}
    lab = (("model_name", "demo"),)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:time_to_first_token_seconds_count"):
        assert name in names, name
    # the system prompt's blocks in the prefix cache first, whatever ran before (the module's order, or alone)
    client(server).chat.completions.create(model="demo", messages=chat("warm the cache"), max_tokens=1)
    m0 = metric_samples(server)
    r = client(server).chat.completions.create(model="demo", messages=chat("count me"), max_tokens=5, temperature=0)
    m1 = metric_samples(server)
    assert m1[("vllm:prompt_tokens_total", lab)] - m0.get(("vllm:prompt_tokens_total", lab), 0) == \
        r.usage.prompt_tokens
    assert m1[("vllm:generation_tokens_total", lab)] - m0.get(("vllm:generation_tokens_total", lab), 0) == \
        r.usage.completion_tokens
    assert m1[("vllm:time_to_first_token_seconds_count", lab)] == \
        m0.get(("vllm:time_to_first_token_seconds_count", lab), 0) + 1
    assert m1[("vllm:prefix_cache_queries_total", lab)] > m0[("vllm:prefix_cache_queries_total", lab)]
    assert m1[("vllm:prefix_cache_hits_total", lab)] > m0[("vllm:prefix_cache_hits_total", lab)]  # the system prompt
    assert 0 <= m1[("vllm:kv_cache_usage_perc", lab)] <= 1


def test_kv_map_endpoint(server: BackgroundServer) -> None:
    snap = kv(server)
    assert snap["num_blocks"] == 128 and len(snap["state"]) == len(snap["refcount"]) == len(snap["owners"]) == 128
    assert snap["cached_blocks"] > 0  # earlier requests left their full blocks in the prefix cache


# ---------------------------------------------------------------------- auth and limits
def test_api_key_on_every_endpoint_but_health(guarded: BackgroundServer) -> None:
    assert httpx.get(f"{guarded.url}/health", timeout=10).status_code == 200
    for path in ("/v1/models", "/metrics", "/v1/rosechat/kv"):
        r = httpx.get(f"{guarded.url}{path}", timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        wrong = httpx.get(f"{guarded.url}{path}", headers={"Authorization": "Bearer nope"}, timeout=10)
        assert wrong.status_code == 401
        assert httpx.get(f"{guarded.url}{path}", headers={"Authorization": f"Bearer {KEY}"},
                         timeout=10).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        client(guarded, "wrong").models.list()
    r = client(guarded, KEY).chat.completions.create(model="demo", messages=chat("hi"), max_tokens=2)
    assert r.choices[0].message.role == "assistant"


def test_body_size_limit(guarded: BackgroundServer) -> None:
    body = {**GOOD, "messages": [{"role": "user", "content": "x" * 10_000}]}
    r = httpx.post(f"{guarded.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=10)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


def test_queue_bound_answers_503(guarded: BackgroundServer) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {**GOOD, "max_tokens": 1800, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{guarded.url}/v1/chat/completions", json=body, headers=auth, timeout=60) as r:
        assert r.status_code == 200
        second = httpx.post(f"{guarded.url}/v1/chat/completions", json=GOOD, headers=auth, timeout=30)
        assert second.status_code == 503 and second.headers["retry-after"] == "1"
        assert second.json()["error"]["code"] == "server_overloaded"
    wait_for(lambda: httpx.post(f"{guarded.url}/v1/chat/completions", json=GOOD, headers=auth,
                                timeout=30).status_code == 200)


def test_sse_wire_format_ends_with_done(server: BackgroundServer) -> None:
    body = {**GOOD, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    assert json.loads(events[0][6:])["object"] == "chat.completion.chunk"


# ---------------------------------------------------------------------- the command line
def test_rosechat_serve_command_serves_and_stops_on_ctrl_c(tmp_path) -> None:
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from rosechat.bench.server_process import ChildLog

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "ROSECHAT_API_KEY": KEY}
    cmd = [sys.executable, "-m", "rosechat.cli", "--config", str(tmp_path / "none.toml"), "serve", "--model",
           "demo", "--device", "cpu", "--num-blocks", "64", "--port", "0", "--max-tokens", "4"]
    (tmp_path / "none.toml").write_text("")
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    # read on a thread: every wait below has a deadline, however silent the server stays
    log = ChildLog(proc, r"on (http://127\.0\.0\.1:\d+)/v1", name="rosechat serve", keep=100_000)
    try:
        url = log.wait(180).group(1)  # the line naming the address comes once the socket is bound
        wait_for(lambda: _health(url))
        c = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
        r = c.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], temperature=0)
        assert r.usage.completion_tokens <= 4  # --max-tokens is the default for requests without one
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert log.wait_closed(30), "the server exited but its stderr stayed open"
        text = log.text()
        rest = text[text.index(url):]
        assert "rosechat serve: stopped" in rest and "Traceback" not in rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def _health(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def test_max_completion_tokens_and_ignore_eos(server: BackgroundServer) -> None:
    r = client(server).chat.completions.create(model="demo", messages=chat("short"), max_completion_tokens=3,
                                               temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_speculation_counters_reach_metrics_and_the_kv_map() -> None:
    """vLLM's spec-decode counters; the proposer here always guesses two tokens, so every decode step checks some."""
    llm = LLMEngine.from_pretrained("demo", device="cpu", num_blocks=128, block_size=16,
                                    speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    llm.scheduler.proposer.propose = lambda ids, k, index=None: [ids[-1]] * k
    llm.scheduler.proposer.kind = lambda seq: 0  # guesses at every step, of one kind
    server = start_background(create_app(llm, ServerSettings(model_name="demo")))
    try:
        r = client(server).chat.completions.create(model="demo", messages=chat("count me"), max_tokens=12,
                                                   temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 12
        m, lab = metric_samples(server), (("model_name", "demo"),)
        drafts = m[("vllm:spec_decode_num_drafts_total", lab)]
        guessed = m[("vllm:spec_decode_num_draft_tokens_total", lab)]
        kept = m[("vllm:spec_decode_num_accepted_tokens_total", lab)]
        assert drafts > 0 and 0 < guessed <= 2 * drafts and 0 <= kept <= guessed
        per_pos = [m[("vllm:spec_decode_num_accepted_tokens_per_pos_total", (*lab, ("position", str(i))))]
                   for i in range(2)]
        assert sum(per_pos) == kept and per_pos[0] >= per_pos[1]
        snap = kv(server)
        assert (snap["spec_drafts"], snap["spec_draft_tokens"], snap["spec_accepted_tokens"]) == (drafts, guessed, kept)
        # what checks did since the map was last served (never: all of them), blocks named as they are now
        assert (snap["spec_recent_guesses"], snap["spec_recent_rejected"]) == (guessed, guessed - kept)
        assert all(snap["state"][b] == 2 for b in snap["spec_guess_blocks"])
        assert all(snap["state"][b] in (0, 1) for b in snap["spec_returned_blocks"])
        again = kv(server)
        assert (again["spec_recent_guesses"], again["spec_guess_blocks"], again["spec_returned_blocks"]) == (0, [], [])
    finally:
        server.stop()
