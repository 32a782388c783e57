"""Loading you can see, and nothing typed meanwhile is lost: the app over a model whose load the test
holds at a gate (a thread event), so "while loading" lasts exactly as long as the test needs."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from textual.widgets import ProgressBar

from engine import LLMEngine
from engine.weights.loader import Stages
from rosechat.app import RoseChatApp
from rosechat.config import load_config
from rosechat.history import HistoryStore
from rosechat.widgets.chat import MessageView
from rosechat.widgets.loading import LoadBar, StageLog
from rosechat.widgets.queued import QUEUED, QUEUED_NEXT
from rosechat.widgets.tab import ChatTab
from tests.rosechat.test_app import SIZE, _footer, new_tab, ready, replied, wait_for


def gated_app(tmp_path: Path, gate: threading.Event, *, fail: bool = False, **overrides: Any) -> RoseChatApp:
    """The demo model, loaded once ``gate`` is set: a few stages reported first, as a real load does."""

    def factory(source, progress: Callable) -> LLMEngine:
        say = Stages(progress)
        say("converting the tokenizer")
        say("repacking weights", 45, 100)
        assert gate.wait(30), "the test never opened the gate"
        if fail:
            raise ValueError("the file is damaged")
        return LLMEngine.from_pretrained(source, progress, num_blocks=96)

    settings = {"model.name": "demo", "sampling.max_tokens": 8, "sampling.temperature": 0.0,
                "history.path": str(tmp_path / "history.sqlite3"), "ui.show_kv_panel": True, **overrides}
    config = load_config(overrides=settings, user_file=None)
    return RoseChatApp(config, HistoryStore(config.history_path()), engine_factory=factory)


async def type_message(pilot, tab: ChatTab, text: str) -> None:
    """Type ``text`` into ``tab``'s box and press enter, once the box has the focus."""
    app = pilot.app
    await wait_for(pilot, lambda: app.active_tab is tab and app.focused is tab.input, "the tab's input focused")
    tab.input.value = text
    await pilot.press("enter")


def shown_in_order(tab: ChatTab) -> list[tuple[str, str]]:
    """(role, text) of the messages as the log shows them, top to bottom."""
    return [(v.role, v.text) for v in tab.log_view.query(MessageView)]


async def test_loading_shows_each_stage_with_a_bar_and_a_clock(tmp_path: Path) -> None:
    gate = threading.Event()
    app = gated_app(tmp_path, gate)
    async with app.run_test(size=SIZE) as pilot:
        bar = app.query_one("#loading-bar", LoadBar)
        await wait_for(pilot, lambda: "repacking weights 45/100" in bar.text, "the stage on the loading line")
        assert "demo" in bar.text and not app.ready
        progress = bar.query_one(ProgressBar)
        assert (progress.total, progress.progress) == (100, 45)
        panel = app.kv_panel  # the panel draws the load until the engine's first map
        assert panel.query_one("#kv-loading").display and not panel.query_one("#kv-main").display
        assert "repacking weights 45/100" in panel.query_one(LoadBar).text
        # the stages done so far, with their durations
        log = str(panel.query_one(StageLog).render())
        assert re.search(r"✓ converting the tokenizer +\d+\.\d s", log)

        def seconds() -> int:
            return int(re.search(r"· (\d+) s$", bar.text).group(1))

        # no event for a second (a long stage): the clock still moves
        start = seconds()
        await wait_for(pilot, lambda: seconds() > start, "the clock to tick between stages")
        gate.set()
        await ready(pilot)
        await wait_for(pilot, lambda: panel.query_one("#kv-main").display, "the block map to replace the load")
        # the loading views are gone or stopped, their clocks and bars with them
        await wait_for(pilot, lambda: not app.query("#loading") and not panel.query(ProgressBar), "no loading view")
        assert not panel.query_one("#kv-loading").display


async def test_messages_typed_while_loading_are_sent_in_order_once_ready(tmp_path: Path) -> None:
    gate = threading.Event()
    app = gated_app(tmp_path, gate)
    async with app.run_test(size=SIZE) as pilot:
        first = app.active_tab
        await type_message(pilot, first, "first question")
        await wait_for(pilot, lambda: len(first.queued) == 1, "the first message to be queued")
        assert first.input.value == "" and _footer(first.queued[0].view) == QUEUED
        await type_message(pilot, first, "second question")
        await wait_for(pilot, lambda: len(first.queued) == 2, "the second message to be queued")
        other = await new_tab(pilot)
        await type_message(pilot, other, "the other tab's question")
        await wait_for(pilot, lambda: len(other.queued) == 1, "the other tab's message to be queued")
        assert not app.ready and first.chat_title == "first question"
        # saved as typed: quitting now would lose nothing
        saved = app.history.load(first.history_id).messages
        assert [(m.role, m.content) for m in saved] == [("user", "first question"), ("user", "second question")]

        gate.set()
        await ready(pilot)
        await wait_for(pilot, lambda: not first.queued and replied(first) and len(first.messages) == 4,
                       "both of the first tab's messages answered")
        await wait_for(pilot, lambda: not other.queued and replied(other), "the other tab's message answered")
        expected = [("user", "first question"), ("assistant", first.messages[1].content),
                    ("user", "second question"), ("assistant", first.messages[3].content)]
        assert [(m.role, m.content) for m in first.messages] == expected  # each its own turn, in order
        assert shown_in_order(first) == expected  # each reply under the message it answers
        assert [(m.role, m.content) for m in app.history.load(first.history_id).messages] == expected
        assert [m.role for m in other.messages] == ["user", "assistant"]
        assert all(_footer(m.view) not in (QUEUED, QUEUED_NEXT) for m in first.messages if m.role == "user")


async def test_the_next_queued_message_says_it_waits_for_the_reply_above(tmp_path: Path) -> None:
    gate = threading.Event()
    app = gated_app(tmp_path, gate, **{"sampling.max_tokens": 200})
    async with app.run_test(size=SIZE) as pilot:
        tab = app.active_tab
        for text in ("one", "two"):
            await type_message(pilot, tab, text)
        await wait_for(pilot, lambda: len(tab.queued) == 2, "two queued messages")
        gate.set()
        await wait_for(pilot, lambda: tab.generating and len(tab.queued) == 1, "the first one sent")
        assert _footer(tab.queued[0].view) == QUEUED_NEXT
        await wait_for(pilot, lambda: not tab.queued and replied(tab), "the second one answered")


async def test_queued_messages_stay_marked_not_sent_when_the_model_fails_to_load(tmp_path: Path) -> None:
    gate = threading.Event()
    app = gated_app(tmp_path, gate, fail=True)
    async with app.run_test(size=SIZE) as pilot:
        tab = app.active_tab
        await type_message(pilot, tab, "are you there?")
        await wait_for(pilot, lambda: len(tab.queued) == 1, "the message to be queued")
        gate.set()
        await wait_for(pilot, lambda: app.load_error is not None, "the load to fail")
        await wait_for(pilot, lambda: not tab.queued, "the queue to be emptied")
        message = tab.messages[-1]
        assert (message.role, message.content) == ("user", "are you there?")
        assert "not sent" in _footer(message.view) and message.view.has_class("-error")
        assert [m.content for m in app.history.load(tab.history_id).messages] == ["are you there?"]
        assert "the file is damaged" in app.query_one("#loading-bar", LoadBar).text
        assert "the file is damaged" in app.kv_panel.query_one(LoadBar).text


async def test_the_engine_process_loads_reports_replies_and_ends_with_the_app(tmp_path: Path) -> None:
    """As `rosechat` runs: the model loads in the engine's own process, its stages reach the panel, a reply
    streams back, and quitting ends the process cleanly."""
    from engine import EngineProcess
    from tests.rosechat.test_app import make_app, send

    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert isinstance(app.engine, EngineProcess) and app.llm is None  # no model in the UI's process
        child = app.engine._process
        log = app.kv_panel.query_one(StageLog)
        await wait_for(pilot, lambda: len(log.stages) >= 2, "the load's stages in the panel")  # at the next drain
        assert re.search(r"✓ \w.* +\d+\.\d s", str(log.render()))  # the child's load, stage by stage
        tab = await send(pilot, "hello from the other process")
        await wait_for(pilot, lambda: replied(tab), "the reply")
        assert tab.last_finished.usage.completion_tokens > 0 and tab.messages[-1].content
    assert child.wait(30) == 0  # asked to stop, it stopped by itself


async def test_quitting_while_the_engine_process_loads_ends_it(tmp_path: Path) -> None:
    from rosechat.widgets.loading import ModelLoader
    from tests.rosechat.test_app import make_app

    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        loader = app.query_one(ModelLoader)
        await wait_for(pilot, lambda: loader._process is not None and loader._process._process is not None,
                       "the engine process to start")
        child = loader._process._process
    # closed while loading (or just after): the process goes with the app, whichever came first
    assert child.wait(30) is not None
