"""A long chat's log folds what lies far above the view (issue 27: a layout's cost grew with the chat),
without a change anyone can see: the same height, the same places, and all of it back when scrolled to."""

from __future__ import annotations

from pathlib import Path

from rosechat.widgets.chat import ChatMessage, MessageView
from rosechat.widgets.chat_log import ChatLog
from tests.rosechat.test_app import SIZE, make_app, ready, replied, send, wait_for

PARAGRAPH = "The dragon sat by the river and opened a book she had found in the ruins of the old library. " * 2


async def _long_chat(pilot, turns: int = 20) -> tuple[ChatLog, list[ChatMessage]]:
    log = pilot.app.active_tab.log_view
    messages = []
    for i in range(turns):
        for message in (ChatMessage("user", f"question {i}"), ChatMessage("assistant", "\n\n".join([PARAGRAPH] * 3))):
            await log.add(message)
            messages.append(message)
    await wait_for(pilot, lambda: all(v.size for v in _views(log)), "the chat to be laid out")
    assert log.virtual_size.height > 8 * log.size.height
    log.scroll_end(animate=False)
    await wait_for(pilot, lambda: log.scroll_y == log.max_scroll_y > 0, "the log at its end")
    return log, messages


def _views(log: ChatLog) -> list[MessageView]:
    return list(log.query_children(MessageView))


def _on_screen(log: ChatLog) -> dict[MessageView, object]:
    return {view: view.region for view in _views(log) if view.display and view.region.overlaps(log.region)}


async def test_a_fold_hides_what_is_far_above_and_changes_nothing_seen(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        log, _ = await _long_chat(pilot)
        height, seen, scroll_y = log.virtual_size.height, _on_screen(log), log.scroll_y
        log.fold()
        await wait_for(pilot, lambda: any(not v.display for v in _views(log)) and log._spacer.size.height > 0,
                       "the fold laid out")
        await pilot.pause()
        hidden = [v for v in _views(log) if not v.display]
        assert len(hidden) > len(_views(log)) // 2
        assert log.virtual_size.height == height and log.scroll_y == scroll_y
        assert _on_screen(log) == seen  # every message in view where it was
        # what it hid lies more than a screen above the view; the first message shown does not
        assert hidden == _views(log)[: len(hidden)]

        log.scroll_to(y=0, animate=False)  # the user scrolls up: all of it again, the spacer gone
        await wait_for(pilot, lambda: all(v.display for v in _views(log)), "the fold undone")
        await wait_for(pilot, lambda: log._spacer.size.height == 0, "the spacer gone")
        assert log.virtual_size.height == height

        log.scroll_end(animate=False)
        await wait_for(pilot, lambda: log.scroll_y == log.max_scroll_y, "the log at its end again")
        log.fold()
        await wait_for(pilot, lambda: not all(v.display for v in _views(log)), "folded again")
        await pilot.resize_terminal(SIZE[0] - 20, SIZE[1])  # new heights: nothing stays folded
        await wait_for(pilot, lambda: all(v.display for v in _views(log)), "the fold undone by a new width")


async def test_the_context_marker_goes_with_the_message_it_stands_above(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        log, messages = await _long_chat(pilot)
        log.fold()
        await wait_for(pilot, lambda: not messages[0].view.display, "the fold")
        await log.mark_context(messages, 2, 256)  # above a folded message: folded with it
        (marker,) = log.query(".context-marker")
        assert not marker.display and marker in log._folded
        await log.mark_context(messages, len(messages) - 2, 256)  # above one in view: shown
        assert marker.display and marker not in log._folded
        await log.mark_context(messages, 0, 256)
        assert not log.query(".context-marker") and all(w.is_attached for w in log._folded)


async def test_a_reply_that_ends_folds_the_log(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        log, _ = await _long_chat(pilot)
        assert all(v.display for v in _views(log))
        tab = await send(pilot, "one more question")
        await wait_for(pilot, lambda: replied(tab), "the reply")
        await wait_for(pilot, lambda: not _views(log)[0].display, "the log folded once the reply ended")
        assert _views(log)[-1].display and tab.messages[-1].view is _views(log)[-1]


async def test_a_log_folds_when_its_tab_is_shown_again(tmp_path: Path) -> None:
    """A fold asked for while the tab is hidden (a reply that ended there) finds nothing laid out; showing the
    tab folds the log."""
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        log, _ = await _long_chat(pilot)
        tab = app.active_tab
        await pilot.press("ctrl+n")
        await wait_for(pilot, lambda: app.active_tab is not tab and not log.size, "the tab hidden")
        log.fold()
        assert all(v.display for v in _views(log))  # nothing to measure: nothing folded
        app.tabbed.activate(tab)
        await wait_for(pilot, lambda: not _views(log)[0].display, "the log folded once shown")
        assert _views(log)[-1].display



async def test_a_fold_on_a_log_being_removed_does_nothing(tmp_path: Path) -> None:
    """A fold asked for after a refresh (a reply's end, the tab shown again) may run while the tab closes: Textual
    removes the log's children first, so it finds no spacer. It does nothing (it raised NoMatches, which ended
    the app, in a full suite's run of test_a_reply_in_progress_is_kept_on_tab_close_and_on_quit)."""
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        log, _ = await _long_chat(pilot)
        await log.query_one(".fold-spacer").remove()  # as the log's removal does first
        log.fold()
        assert all(v.display for v in _views(log)) and app.return_code is None
