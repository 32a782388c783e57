"""The app as a client of an OpenAI-compatible server (`--remote`), driven with Pilot against a
real `rosechat serve` on 127.0.0.1: parallel tabs, the server's block map in the KV panel, and the
server dying mid-reply (the partial reply kept and marked, retry once it is back)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from engine import LLMEngine
from rosechat.server.app import ServerSettings, create_app
from rosechat.server.run import BackgroundServer, start_background
from rosechat.server_stats import ServerStats
from rosechat.widgets.chat import MessageView
from rosechat.widgets.server_view import NO_DATA, ServerView
from tests.rosechat.test_app import SIZE, _footer, make_app, ready, replied, send, wait_for

KEY = "remote-key"


def _server(port: int = 0, hold_after_steps: int | None = None) -> BackgroundServer:
    """`hold_after_steps`: the engine stops stepping after that many steps until the server is told to exit, so
    a reply is mid-way when a test cuts it, however fast the model (speculation made the demo model's 900
    tokens take ~1 s) and however loaded the machine."""
    llm = LLMEngine.from_pretrained("demo", device="cpu", num_blocks=128, block_size=16, cuda_graphs=False)
    held: list[BackgroundServer] = []
    if hold_after_steps is not None:
        step, steps = llm.step, iter(range(hold_after_steps))

        def holding_step():
            if next(steps, None) is None:  # polled, not slept on: the exit is a flag on the server
                while not (held and held[0].server.should_exit):
                    time.sleep(0.005)
            return step()

        llm.step = holding_step
    held.append(start_background(create_app(llm, ServerSettings(model_name="demo", api_key=KEY)), port=port))
    return held[0]


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    s = _server()
    yield s
    s.stop()


def remote_app(tmp_path: Path, url: str, **overrides):
    # temperature set (so sent) and greedy: the replies can be checked against the server itself
    return make_app(tmp_path, **{"remote.url": url, "remote.api_key": KEY, "sampling.temperature": 0.0,
                                 "remote.connect_timeout": 2.0, **overrides})


async def test_tabs_stream_from_the_server_and_the_panel_draws_its_blocks(tmp_path: Path,
                                                                          server: BackgroundServer) -> None:
    # a system prompt of several full blocks: what the server's prefix cache shares between the tabs
    app = remote_app(tmp_path, f"{server.url}/v1", **{"ui.show_kv_panel": True,
                                                      "chat.system_prompt": "You are a helpful assistant. " * 12})
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert app.sub_title.startswith("remote") and server.url in app.sub_title
        first = await send(pilot, "hello there")
        await app.action_new_tab()
        assert app.active_tab is not first
        second = await send(pilot, "what is a block?")  # once the new tab's input has the focus
        await wait_for(pilot, lambda: replied(first) and replied(second), "both replies")
        direct = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0).chat.completions.create(
            model="demo", messages=first.chat_messages()[:-1], max_tokens=12, temperature=0.0)
        assert first.messages[-1].content == direct.choices[0].message.content
        assert second.messages[-1].content  # the other tab got its own reply
        # the server's block map, drawn as the local engine's is; the system prompt's blocks were shared
        await wait_for(pilot, lambda: app.kv_panel.snapshot is not None
                       and app.kv_panel.snapshot.prefix_cache_hits > 0, "the server's block map")
        assert app.kv_panel.snapshot.num_blocks == 128


async def test_the_server_dying_mid_reply_keeps_the_partial_reply_and_retry_works(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    s = _server(port, hold_after_steps=40)  # the reply is cut mid-way: its engine waits for the server's exit
    # 900 tokens: the retry's prompt (holding the cut reply) plus 900 stays inside the server's 2048-token context
    app = remote_app(tmp_path, f"http://127.0.0.1:{port}", **{"sampling.max_tokens": 900})
    try:
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            tab = await send(pilot, "tell me a long story")  # greedy on the demo model: no EOS
            view = tab.reply
            await wait_for(pilot, lambda: len(view.text) > 20, "the reply to stream")
            s.stop(grace=0)  # the stream cut at once, as a dying server does: however fast the model is
            await wait_for(pilot, lambda: not tab.generating, "the error")
            partial = tab.messages[-1]
            assert partial.role == "assistant" and partial.content == view.text and len(partial.content) > 20
            assert view.has_class("-error") and "went away mid-reply" in _footer(view)
            saved = app.history.load(tab.history_id).messages[-1]
            assert saved.content == partial.content and saved.finish_reason == "error"
            # meanwhile a new message is refused clearly, and the app stays up
            await send(pilot, "are you there?")
            failed = tab.log_view.query(MessageView).last()
            await wait_for(pilot, lambda: not tab.generating and "cannot reach" in _footer(failed), "refused")
            assert [m.content for m in tab.messages[-2:]] == [partial.content, "are you there?"]
            s = _server(port)  # back: ctrl+r retries the message whose reply failed
            await pilot.press("ctrl+r")
            await wait_for(pilot, lambda: tab.log_view.query(MessageView).last() is not failed, "the retry's reply")
            retry = tab.log_view.query(MessageView).last()
            # three sampled alternatives: any may end early, so the retry shows when one of them streams
            await wait_for(pilot, lambda: max(map(len, retry.texts)) > 20 or retry.has_class("-error"), "the retry")
            assert not retry.has_class("-error"), _footer(retry)
            await pilot.press("escape")  # 3 alternatives x 900 tokens: stop once it is shown to work
            await wait_for(pilot, lambda: not tab.generating, "the stop")
            assert tab.messages[-1].role == "assistant" and tab.messages[-1].content == retry.text
            assert tab.messages[-2].content == "are you there?" and not retry.has_class("-error")
    finally:
        s.stop()


async def test_a_metrics_only_server_shows_usage_and_one_without_data_says_so(tmp_path: Path) -> None:
    app = make_app(tmp_path, **{"ui.show_kv_panel": True})
    async with app.run_test(size=SIZE) as pilot:
        panel = app.kv_panel
        await wait_for(pilot, lambda: panel.query(ServerView) and panel.query_one(ServerView).is_mounted,
                       "the server view")
        view = panel.query_one(ServerView)
        for usage in (0.25, 0.5):
            panel.show_server(ServerStats("vllm", kv_usage=usage, prefix_hit_rate=0.4, running=3, waiting=1,
                                          preemptions=2))

        def shown() -> str:
            return str(view.query_one("#srv-usage").render()) + str(view.query_one("#srv-line").render())

        await wait_for(pilot, lambda: "50.0% used" in shown(), "the usage shown")
        text = shown()
        assert "50.0% used" in text and "prefix hits 40.0%" in text and "3 running, 1 waiting" in text
        assert list(view.usage) == [0.25, 0.5] and view.query_one("#srv-spark").display
        panel.show_server(ServerStats(""))
        await wait_for(pilot, lambda: str(view.query_one("#srv-usage").render()) == NO_DATA, "no data, said")


async def test_messages_typed_before_the_server_is_up_are_sent_once_it_answers(tmp_path: Path) -> None:
    """A remote server not up yet: the app says it retries, queues what is typed, and sends it once the
    server answers. Its socket is bound but not listening until the test starts the server: refused till then."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = remote_app(tmp_path, f"http://127.0.0.1:{port}")
    s = None
    try:
        async with app.run_test(size=SIZE) as pilot:
            tab = app.active_tab
            bar = app.query_one("#loading-bar")
            await wait_for(pilot, lambda: "cannot reach" in bar.text and "retrying" in bar.text, "the retry line")
            await wait_for(pilot, lambda: app.focused is tab.input, "the input's focus")
            tab.input.value = "hello, server"
            await pilot.press("enter")
            await wait_for(pilot, lambda: len(tab.queued) == 1, "the message to be queued")
            assert not app.ready and tab.input.value == ""
            s = start_background(create_app(LLMEngine.from_pretrained("demo", device="cpu", num_blocks=64),
                                            ServerSettings(model_name="demo", api_key=KEY)), sock=sock)
            await ready(pilot)
            await wait_for(pilot, lambda: not tab.queued and replied(tab), "the queued message answered")
            assert [m.role for m in tab.messages] == ["user", "assistant"] and tab.messages[1].content
            assert not app.query("#loading")
    finally:
        if s is not None:
            s.stop()
        sock.close()
