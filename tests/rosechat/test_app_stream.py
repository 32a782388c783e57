"""A streaming reply in the app: every piece of text reaches the screen in order, and a paragraph that
grows within its last line is repainted without laying the screen out again (issue 27, point 4)."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from rosechat.engine_link import GIL_SWITCH_S, UI_NICE
from rosechat.widgets import chat
from rosechat.widgets.reply_markdown import ReplyParagraph
from tests.rosechat.test_app import SIZE, make_app, wait_for


def _paragraphs(view: chat.MessageView) -> list[ReplyParagraph]:
    return list(view.markdown.query(ReplyParagraph))


def _shown(paragraph: ReplyParagraph) -> list[str]:
    """The paragraph's lines as drawn at its width (what the compositor gets)."""
    return [strip.text.rstrip() for strip in paragraph.render_lines(paragraph.size.region)]


async def test_a_paragraph_growing_on_its_line_is_not_laid_out_again(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        view = chat.MessageView("assistant")
        await app.active_tab.log_view.mount(view)
        await view.markdown.append("Once upon")
        await wait_for(pilot, lambda: _paragraphs(view) and _paragraphs(view)[0].size.height == 1, "one line")
        (paragraph,) = _paragraphs(view)
        layouts, height, width = paragraph.layouts, view.size.height, paragraph.size.width

        await view.markdown.append(" a time")  # the same line, longer: a repaint only
        await wait_for(pilot, lambda: _shown(paragraph) == ["Once upon a time"], "the longer line drawn")
        assert paragraph.layouts == layouts and view.size.height == height

        words = " there lived a dragon who could not read" * (2 * width // 40)  # wraps onto more lines
        await view.markdown.append(words)
        await wait_for(pilot, lambda: paragraph.size.height > 1, "the paragraph to grow")
        assert paragraph.layouts == layouts + 1  # it asked for the layout that grew it
        lines = _shown(paragraph)
        assert len(lines) == paragraph.size.height and " ".join(lines).split() == ("Once upon a time" + words).split()
        await wait_for(pilot, lambda: view.size.height == height + paragraph.size.height - 1, "the reply to grow")


@pytest.mark.parametrize("interval", [0.0, 0.05])
async def test_many_deltas_end_as_the_whole_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 interval: float) -> None:
    """Hundreds of pieces (words, newlines, a list, a code block), written as they come (interval 0) or
    batched: the Markdown's source is the text, and its blocks are drawn from all of it."""
    monkeypatch.setattr(chat, "REDRAW_INTERVAL", interval)
    text = ("The dragon sat by the river and opened a book. " * 12 + "\n\nShe learned:\n\n1. letters\n2. words\n\n"
            "```\nread(book)\n```\n\n" + "Then she read every book in the land. " * 10)
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        view = chat.MessageView("assistant")
        await app.active_tab.log_view.mount(view)
        for piece in pieces:
            await view.add_delta(0, piece)
        await wait_for(pilot, lambda: view.markdown.source == text, "every piece written")

        def last_words() -> bool:  # the blocks are built after the source is set (the stream's task)
            *_, last = _paragraphs(view)
            return bool(_shown(last)) and _shown(last)[-1].endswith("in the land.")

        await wait_for(pilot, last_words, "the last words drawn")
        first = _paragraphs(view)[0]
        assert " ".join(_shown(first)).split() == ("The dragon sat by the river and opened a book. " * 12).split()
        assert "read(book)" in str(view.markdown.query_one("MarkdownFence")._content)
        await view.set_texts([text])  # the reply's end: nothing to change
        assert view.markdown.source == view.text == text


@pytest.mark.parametrize("ui_ms", [1.0, 12.0])
async def test_the_next_redraw_waits_for_the_ui_threads_work_to_be_a_small_share(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ui_ms: float) -> None:
    """After a write, the next one waits REDRAW_INTERVAL, or longer when the UI thread was busy since the
    last: its CPU time over REDRAW_SHARE (12 ms of it: 0.3 s). The reply's clocks are faked: the UI thread's
    advances `ui_ms` at each read, the wall's only when the test moves it."""
    now, cpu = [0.0], [0.0]

    def thread_time() -> float:
        cpu[0] += ui_ms / 1000
        return cpu[0]

    want = min(max(chat.REDRAW_INTERVAL, ui_ms / 1000 / chat.REDRAW_SHARE), chat.REDRAW_MAX)
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        view = chat.MessageView("assistant")
        await app.active_tab.log_view.mount(view)
        monkeypatch.setattr(chat, "time", SimpleNamespace(monotonic=lambda: now[0], thread_time=thread_time))
        await view.add_delta(0, "Once")  # the first write: at once, the next due REDRAW_INTERVAL on
        assert view.markdown.source == "Once"
        now[0] = chat.REDRAW_INTERVAL
        await view.add_delta(0, " upon")  # due: written to the stream at once; the UI's time since the first
        assert view._unwritten == "" and view._write_timer is None  # sets the pace
        now[0] += want - 0.05
        await view.add_delta(0, " a time")  # not due yet: kept, and written by a timer 0.05 s on
        assert view._unwritten == " a time" and view._write_timer is not None
        await wait_for(pilot, lambda: view.markdown.source == "Once upon a time", "the timer's write")
    if ui_ms > 10:  # a costly redraw slows the next: the third piece waited well past REDRAW_INTERVAL
        assert want - 0.05 >= 2 * chat.REDRAW_INTERVAL


async def test_sending_a_message_lays_the_screen_out_once_both_its_views_are_in(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The user's message and its reply mount in one batch: no layout of the screen between the two mounts (each
    one is ~7 ms of the UI thread on 2 cores while the engine computes the prompt), and both are laid out after."""
    from textual.screen import Screen

    from rosechat.widgets.tab import ChatTab
    from tests.rosechat.test_app import ready, replied, send

    layouts: list[int] = []
    refresh_layout = Screen._refresh_layout
    monkeypatch.setattr(Screen, "_refresh_layout",
                        lambda self, *a, **k: (layouts.append(1), refresh_layout(self, *a, **k))[1])
    during: list[int] = []
    start_reply = ChatTab.start_reply

    async def counted(self: ChatTab, *args: object, **kwargs: object) -> str:
        before = len(layouts)
        rid = await start_reply(self, *args, **kwargs)
        during.append(len(layouts) - before)
        return rid

    monkeypatch.setattr(ChatTab, "start_reply", counted)
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        tab = await send(pilot, "hello there")
        await wait_for(pilot, lambda: replied(tab), "the reply")
        assert during == [0]
        user, reply = tab.messages[-2].view, tab.messages[-1].view
        assert user is not None and reply is not None and user.region.height and reply.region.height
        assert reply.region.y > user.region.y


async def test_a_reply_does_not_repaint_its_whole_tab(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tab draws nothing of its own: a reply starting, naming the chat and ending changes what the tab's
    watchers show (its label), never a repaint of the tab (every widget in it, ~5 ms a time on 2 cores)."""
    from rosechat.widgets.tab import ChatTab
    from tests.rosechat.test_app import ready, replied, send

    refreshed: list[dict[str, object]] = []
    refresh = ChatTab.refresh
    monkeypatch.setattr(ChatTab, "refresh", lambda self, *a, **k: (refreshed.append(k), refresh(self, *a, **k))[1])
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        refreshed.clear()
        tab = await send(pilot, "hello there")
        await wait_for(pilot, lambda: replied(tab), "the reply")
        assert not tab.generating and tab.chat_title == "hello there"
        assert refreshed == []


async def test_a_message_is_laid_out_once_and_a_footer_of_one_line_is_repainted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mounted message takes one layout of the screen, not a second one for its lines' first size; a reply's
    footer that stays one line ("generating…" to its figures) is a repaint; one that wraps is laid out."""
    from textual.screen import Screen

    from tests.rosechat.test_app import ready

    layouts: list[int] = []
    refresh_layout = Screen._refresh_layout
    monkeypatch.setattr(Screen, "_refresh_layout",
                        lambda self, *a, **k: (layouts.append(1), refresh_layout(self, *a, **k))[1])
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        log = app.active_tab.log_view
        await pilot.wait_for_scheduled_animations()
        await pilot.pause()
        layouts.clear()
        with app.batch_update():  # as a tab mounts a message (start_reply): Textual's mount alone lays out twice
            view = await log.add(chat.ChatMessage("user", "a question that fits on one line"))
        await pilot.pause()
        await pilot.pause()
        assert view.region.height and len(layouts) == 1

        reply = await log.add(chat.ChatMessage("assistant", "An answer."))
        reply.set_footer("generating…")
        await wait_for(pilot, lambda: reply.query_one(".reply-footer").region.height == 1, "the footer")
        await pilot.pause()
        layouts.clear()
        reply.set_footer("12 tokens · TTFT 0.05 s · 240.0 tok/s")
        await pilot.pause()
        await pilot.pause()
        footer = reply.query_one(".reply-footer", chat.Static)
        assert layouts == [] and footer.render_lines(footer.size.region)[0].text.startswith("12 tokens")

        reply.set_footer("a long footer " * 20)  # wraps: the reply grows
        await wait_for(pilot, lambda: footer.region.height > 1, "the footer to wrap")
        assert layouts


async def test_a_thread_waiting_for_the_gil_gets_it_within_a_millisecond_once_the_engine_runs(
        tmp_path: Path) -> None:
    """The engine thread waits for the GIL after each of its kernels; the UI thread holds it through a layout.
    Once the engine runs, a waiting thread asks the holder to let go after GIL_SWITCH_S, not Python's 5 ms."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)  # Python's default, whatever an earlier app in this process set
    try:
        app = make_app(tmp_path)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.link.backend is not None, "the engine")
            assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_S) and GIL_SWITCH_S < 0.005
    finally:
        sys.setswitchinterval(before)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own niceness is Linux's")
async def test_the_ui_thread_yields_to_the_engine_threads_once_they_run(tmp_path: Path) -> None:
    """On two cores the UI's CPU comes out of the engine's: once the engine runs the UI thread is at nice
    UI_NICE, and every thread of the engine's process keeps the niceness it was started with."""
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.link.backend is not None, "the engine")
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == max(before, UI_NICE)
        tasks = os.listdir(f"/proc/{app.engine._process.pid}/task")  # the engine process's threads
        assert len(tasks) >= 2  # its command loop and the engine thread, at least
        assert {os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in tasks} == {before}


async def test_a_chats_first_message_relabels_its_tab_without_sliding_the_underline(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first message names the tab; Textual's Tabs would slide the underline to the new label's width
    over 0.3 s, 18 frames of the tab bar and the screen below it while the first reply streams."""
    from textual.widgets import Tabs
    from textual.widgets._tabs import Underline

    from tests.rosechat.test_app import ready, replied, send

    slides: list[str] = []
    animate = Underline.animate
    monkeypatch.setattr(Underline, "animate", lambda self, name, *a, **k: (slides.append(name),
                                                                           animate(self, name, *a, **k))[1])
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.wait_for_scheduled_animations()
        slides.clear()
        tab = await send(pilot, "name this chat after me")
        await wait_for(pilot, lambda: replied(tab), "the reply")
        label = app.tabbed.get_tab(tab)
        assert "name this chat" in label.label.plain
        tabs, underline = app.tabbed.query_one(Tabs), app.tabbed.query_one(Underline)
        span = lambda: label.virtual_region.shrink(label.styles.gutter).column_span  # noqa: E731
        await wait_for(pilot, lambda: (underline.highlight_start, underline.highlight_end) == span(),
                       "the underline under the new label")
        assert slides == [] and tabs.active_tab is label
