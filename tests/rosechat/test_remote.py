"""RemoteBackend against a real `rosechat serve` on 127.0.0.1: the engine thread's commands and
events over HTTP, alternatives when a server refuses n > 1, errors a user can act on, and the
server going away mid-reply."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator

import jsonschema
import openai
import pytest

from engine import LLMEngine, SamplingParams, StructuredOutput
from engine.events import CacheSnapshot, EngineError, Finished, TokenDelta, TurnStarted
from rosechat.remote import RemoteBackend, split_base_url
from rosechat.server.app import ServerSettings, create_app
from rosechat.server.run import BackgroundServer, start_background

SYSTEM = "You are a helpful assistant. " * 12  # a few KV blocks for the prefix cache


def _server(port: int = 0, **settings) -> BackgroundServer:
    # plain decoding: the abort tests need a greedy reply still running a while after its first token
    llm = LLMEngine.from_pretrained("demo", device="cpu", num_blocks=128, block_size=16, cuda_graphs=False,
                                     speculative_config=None)
    return start_background(create_app(llm, ServerSettings(model_name="demo", **settings)), port=port)


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    s = _server(api_key="k3y")
    yield s
    s.stop()


class Events:
    """What a backend reported, with waits on conditions (never fixed sleeps)."""

    def __init__(self) -> None:
        self.items: list[object] = []
        self._cond = threading.Condition()

    def push(self, event: object) -> None:
        with self._cond:
            self.items.append(event)
            self._cond.notify_all()

    def wait(self, predicate: Callable[[list[object]], object], timeout: float = 60.0) -> object:
        with self._cond:
            assert self._cond.wait_for(lambda: predicate(self.items), timeout), self.items[-5:]
            return predicate(self.items)

    def end_of(self, rid: str, timeout: float = 60.0) -> Finished | EngineError:
        return self.wait(lambda items: next((e for e in items if isinstance(e, (Finished, EngineError))
                                             and e.request_id == rid), None), timeout)


def wait_until(predicate: Callable[[], object], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.01)


def settle(b: RemoteBackend, timeout: float = 30.0) -> None:
    """Every callback already queued on the backend's loop has run (whatever they emit, emitted)."""
    done = threading.Event()
    b._loop.call_soon_threadsafe(done.set)
    assert done.wait(timeout), "the backend's loop did not answer"


def backend(url: str, **kw) -> tuple[RemoteBackend, Events]:
    events = Events()
    b = RemoteBackend(url, events.push, **kw)
    b.start()
    return b, events


def chat(text: str, history: list[dict] | None = None) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, *(history or []), {"role": "user", "content": text}]


def test_base_url_with_or_without_v1() -> None:
    assert split_base_url("http://h:8000") == ("http://h:8000/v1", "http://h:8000")
    assert split_base_url("http://h:8000/v1/") == ("http://h:8000/v1", "http://h:8000")
    assert split_base_url("localhost:11434") == ("http://localhost:11434/v1", "http://localhost:11434")


def test_a_turn_streams_as_engine_events_and_matches_the_server(server: BackgroundServer) -> None:
    b, events = backend(server.url, api_key="k3y")  # no model named: the server's first one
    try:
        cid = b.new_conversation()
        params = SamplingParams(max_tokens=12, temperature=0.0)
        rid = b.submit_turn(cid, chat("hello there"), params)
        end = events.end_of(rid)
        assert isinstance(end, Finished), end
        deltas = "".join(e.text for e in events.items if isinstance(e, TokenDelta) and e.request_id == rid)
        assert any(isinstance(e, TurnStarted) and e.request_id == rid for e in events.items)
        assert end.texts == (deltas,) and end.conversation_id == cid
        direct = openai.OpenAI(base_url=f"{server.url}/v1", api_key="k3y", max_retries=0).chat.completions.create(
            model="demo", messages=chat("hello there"), max_tokens=12, temperature=0.0)
        assert deltas == direct.choices[0].message.content
        assert end.usage.completion_tokens == direct.usage.completion_tokens
        # the history resent with the next turn comes from the server's prefix cache
        history = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": deltas}]
        end2 = events.end_of(b.submit_turn(cid, chat("and then?", history), params))
        assert isinstance(end2, Finished) and end2.usage.prefilled_tokens < end2.usage.prompt_tokens / 2
        # the panel gets the server's own block map
        seen = len(events.items)
        b.request_snapshot()
        snap = events.wait(lambda items: next((e for e in items[seen:] if isinstance(e, CacheSnapshot)), None))
        assert snap.num_blocks == 128 and snap.prefix_cache_hits > 0
    finally:
        b.shutdown()
    assert not b.is_alive


def test_a_salted_conversation_shares_the_servers_cache_only_with_its_salt(server: BackgroundServer) -> None:
    b, events = backend(server.url, api_key="k3y")
    try:
        params = SamplingParams(max_tokens=2, temperature=0.0)
        # a system prompt no other test sends: none of its blocks is cached yet, under any salt
        messages = [{"role": "system", "content": "You tend a community garden and answer briefly. " * 10},
                    {"role": "user", "content": "a salted question about gardens"}]

        def prefilled(cid: str) -> int:
            end = events.end_of(b.submit_turn(cid, messages, params))
            assert isinstance(end, Finished), end
            return end.usage.prefilled_tokens

        salted = b.new_conversation(cache_salt="tenant-x")
        first = prefilled(salted)
        assert prefilled(b.new_conversation()) == first  # unsalted: none of the salted blocks
        assert prefilled(b.fork_conversation(salted)) < first  # a fork keeps the salt: the cache hits
    finally:
        b.shutdown()


def test_json_mode_and_a_schema_pass_through_to_the_server(server: BackgroundServer) -> None:
    schema = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}, "n": {"type": "integer", "minimum": 0,
              "maximum": 9}}, "required": ["k", "n"], "additionalProperties": False}
    b, events = backend(server.url, api_key="k3y")
    try:
        for spec in (StructuredOutput(json_object=True), StructuredOutput(json=schema)):
            params = SamplingParams(max_tokens=60, temperature=1.0, seed=2, structured=spec)
            end = events.end_of(b.submit_turn(b.new_conversation(), chat("some JSON please"), params))
            assert isinstance(end, Finished), end
            assert end.texts[0].startswith("{"), end.texts
            if spec.json is not None:  # bounded: it always ends
                assert end.finish_reasons == ("stop",) and jsonschema.validate(json.loads(end.texts[0]), schema) is None
    finally:
        b.shutdown()


def test_alternatives_fall_back_to_separate_requests_when_n_is_refused() -> None:
    s = _server(max_n=1)  # as llama.cpp's server: n > 1 is a 400
    b, events = backend(s.url + "/v1", model="demo")
    try:
        rid = b.submit_turn(b.new_conversation(), chat("tell me"), SamplingParams(max_tokens=8, n=3, seed=1,
                                                                                     temperature=1.0))
        end = events.end_of(rid)
        assert isinstance(end, Finished) and len(end.texts) == 3 and all(end.texts), end
        assert len(set(end.texts)) > 1  # three samples, not one reply thrice
        for i in range(3):
            assert "".join(e.text for e in events.items if isinstance(e, TokenDelta) and e.index == i) == end.texts[i]
    finally:
        b.shutdown()
        s.stop()


def test_abort_keeps_the_text_so_far_and_drop_ends_silently(server: BackgroundServer) -> None:
    b, events = backend(server.url, api_key="k3y", model="demo")
    try:
        long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        rid = b.submit_turn(b.new_conversation(), chat("a long story"), long)
        events.wait(lambda items: any(isinstance(e, TokenDelta) and e.request_id == rid for e in items))
        b.abort(rid)
        end = events.end_of(rid)
        assert isinstance(end, Finished) and end.finish_reasons == ("abort",) and end.texts[0]
        cid = b.new_conversation()
        dropped = b.submit_turn(cid, chat("another long story"), long)
        events.wait(lambda items: any(isinstance(e, TokenDelta) and e.request_id == dropped for e in items))
        b.drop_conversation(cid)
        marker = b.submit_turn(b.new_conversation(), chat("hi"), SamplingParams(max_tokens=2))
        events.end_of(marker)  # a turn submitted after the drop has come and gone
        # and the dropped turn has ended too: every turn ends in _end, which would report it (the
        # turn is forgotten first, then its event emitted, in one callback on the backend's loop)
        wait_until(lambda: dropped not in b._turns, "the dropped turn to end")
        settle(b)
        assert not any(isinstance(e, (Finished, EngineError)) and e.request_id == dropped for e in events.items)
    finally:
        b.shutdown()


def test_wrong_key_and_unknown_model_are_clear_errors(server: BackgroundServer) -> None:
    b, events = backend(server.url, api_key="wrong", model="demo")
    try:
        end = events.end_of(b.submit_turn(b.new_conversation(), chat("hi"), SamplingParams(max_tokens=2)))
        assert isinstance(end, EngineError) and "401" in end.message and "api-key" in end.message
    finally:
        b.shutdown()
    b, events = backend(server.url, api_key="k3y", model="no-such-model")
    try:
        end = events.end_of(b.submit_turn(b.new_conversation(), chat("hi"), SamplingParams(max_tokens=2)))
        assert isinstance(end, EngineError) and "404" in end.message and "no-such-model" in end.message
    finally:
        b.shutdown()


def test_a_reply_limit_past_the_context_is_not_a_message_too_long(server: BackgroundServer) -> None:
    b, events = backend(server.url, api_key="k3y", model="demo")
    try:
        end = events.end_of(b.submit_turn(b.new_conversation(), chat("hi"), SamplingParams(max_tokens=5000)))
        # the server refuses as vLLM does; the tab must not take the user's message out of the chat
        assert isinstance(end, EngineError) and end.code == "invalid_request" and "completion" in end.message
        end = events.end_of(b.submit_turn(b.new_conversation(), chat("hi " * 3000), SamplingParams(max_tokens=4)))
        assert isinstance(end, EngineError) and end.code == "context_length_exceeded"
    finally:
        b.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_refused_then_retry_once_the_server_is_up_and_the_server_dying_mid_reply() -> None:
    port = _free_port()
    b, events = backend(f"http://127.0.0.1:{port}", model="demo", connect_timeout=2.0)
    try:
        cid = b.new_conversation()
        end = events.end_of(b.submit_turn(cid, chat("hi"), SamplingParams(max_tokens=4)))
        assert isinstance(end, EngineError) and "cannot reach" in end.message and str(port) in end.message
        s = _server(port=port)
        end = events.end_of(b.submit_turn(cid, chat("hi"), SamplingParams(max_tokens=4)))
        assert isinstance(end, Finished) and end.texts[0]
        long = SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)
        rid = b.submit_turn(cid, chat("go on forever"), long)
        first = events.wait(lambda items: next((e for e in items if isinstance(e, (TokenDelta, EngineError))
                                                and e.request_id == rid), None))
        assert isinstance(first, TokenDelta), first
        t0 = time.monotonic()
        s.stop(grace=0)  # cut at once, as a dying server does: a fast reply (speculation) finished within the grace
        end = events.end_of(rid)
        assert isinstance(end, EngineError) and "went away mid-reply" in end.message, end
        assert time.monotonic() - t0 < 30
    finally:
        b.shutdown()
