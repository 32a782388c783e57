"""The rosechat Textual app: chat tabs over one in-process engine, and the KV-cache panel.

Threads: the model loads in a thread worker; the engine then runs on its own ``EngineThread``,
whose callback only appends to an ``EventBuffer``. A 30 Hz timer posts one ``EngineEvents``
message when something is pending, and its handler applies the coalesced batch on the UI thread
(so engine events are serialised with key presses and actions like any other message).
"""

from __future__ import annotations

import asyncio
import os
import re
import sqlite3
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.markup import escape
from textual.message import Message
from textual.widgets import Footer, Header, Label, LoadingIndicator, TabbedContent

from rosechat.bridge import EventBuffer
from rosechat.commands import RoseChatCommands
from rosechat.config import Config
from rosechat.history import HistoryStore
from rosechat.screens import (
    ConversationDeleted,
    ConversationRenamed,
    ConversationsScreen,
    SystemPromptScreen,
    TextPromptScreen,
)
from rosechat.widgets.chat import ChatInput, ChatMessage, ChatTab, MessageView, ReplyStats
from rosechat.widgets.kv_panel import PALETTE, KVPanel, OwnerStyle

if TYPE_CHECKING:
    from engine import EngineThread, LLMEngine, ModelSource
    from engine.events import CacheSnapshot, EngineError, Finished, TurnStarted

DRAIN_HZ = 30
_CODE_FENCE = re.compile(r"^[ \t]*(?:```|~~~)[^\n]*\n(.*?)\n?[ \t]*(?:```|~~~)[ \t]*$", re.DOTALL | re.MULTILINE)
NEW_CHAT = "New chat"


def _title_from(text: str, limit: int = 40) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1].rstrip() + "…"


class RoseChatApp(App[None]):
    CSS_PATH = "app.tcss"
    # Below 32 rows the screen gets "-short": a slimmer input and KV panel keep 8+ rows of chat
    VERTICAL_BREAKPOINTS = [(0, "-short"), (32, "-tall")]
    TITLE = "rosechat"
    COMMANDS = App.COMMANDS | {RoseChatCommands}

    BINDINGS = [
        # priority: the input box binds ctrl+w / ctrl+f / ctrl+k to editing keys.
        Binding("ctrl+n", "new_tab", "New", priority=True),
        Binding("ctrl+w", "close_tab", "Close", priority=True),
        Binding("ctrl+f", "fork", "Fork", priority=True),
        # Tabs: f5/f6 reach the app in every terminal; ctrl+pageup/down and alt+digit where the
        # terminal does not keep them for itself (or type characters with alt).
        Binding("f5", "previous_tab", "Prev tab", show=False, priority=True),
        Binding("f6", "next_tab", "Next tab", show=False, priority=True),
        Binding("ctrl+pagedown", "next_tab", "Next tab", show=False, priority=True),
        Binding("ctrl+pageup", "previous_tab", "Prev tab", show=False, priority=True),
        *[Binding(f"alt+{i}", f"goto_tab({i})", f"Tab {i}", show=False) for i in range(1, 10)],
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+r", "regenerate", "Alts", priority=True),
        Binding("alt+left", "cycle(-1)", "Prev alt", show=False),
        Binding("alt+right", "cycle(1)", "Next alt", show=False),
        Binding("ctrl+k", "toggle_kv", "KV", priority=True),
        Binding("ctrl+y", "copy_reply", "Copy reply", show=False, priority=True),
        Binding("alt+y", "copy_code", "Copy code", show=False, priority=True),
        Binding("f2", "toggle_kv", "KV cache", show=False),
        Binding("f3", "system_prompt", "System prompt", show=False),
        Binding("ctrl+o", "conversations", "Chats", priority=True),
        Binding("f4", "conversations", "Conversations", show=False),
    ]

    class EngineEvents(Message):
        """Something is waiting in the event buffer."""

    def __init__(
        self,
        config: Config,
        history: HistoryStore,
        *,
        model: ModelSource | None = None,
        model_notice: str | None = None,
        export_dir: Path | None = None,
        engine_factory: Callable[..., LLMEngine] | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.history = history
        self.model = model  # None: chosen from the config when loading starts
        self.export_dir = export_dir  # None: history.export_dir from the config
        self._engine_factory = engine_factory  # tests may pass one; default LLMEngine.from_pretrained
        self.llm: LLMEngine | None = None
        self.engine: EngineThread | None = None
        self.events = EventBuffer()
        self.requests: dict[str, ChatTab] = {}  # request id -> the tab it replies in
        self.last_snapshot: CacheSnapshot | None = None
        self.model_notice = model_notice  # why the demo model runs instead of the configured one
        self.load_error: str | None = None  # why no model could be loaded
        self._colors = 0
        self._drain_posted = False
        self._terminal_watch_done = threading.Event()

    # ------------------------------------------------------------------ layout and start-up
    def compose(self) -> ComposeResult:
        yield Header()
        with Vertical(id="loading"):
            yield LoadingIndicator()
            yield Label(f"Loading {escape(self.model.display_name if self.model else self.config.model.name)}…",
                        id="loading-label")
        yield TabbedContent(id="tabs")
        panel = KVPanel(id="kv")
        panel.display = self.config.ui.show_kv_panel
        yield panel
        yield Footer()

    async def on_mount(self) -> None:
        self.theme = self.config.ui.theme
        self.sub_title = f"loading {self.model.display_name if self.model else self.config.model.name}…"
        await self.new_tab()
        self.load_engine()
        if not self.is_headless and sys.__stdin__ is not None and sys.__stdin__.isatty():
            threading.Thread(target=self._watch_terminal, name="rosechat-terminal", daemon=True).start()

    def _watch_terminal(self) -> None:
        """Thread: quit once the terminal is gone (its window closed, ssh dropped). A process that
        outlives its session leader (as under `make run`) gets no SIGHUP; Textual's output thread
        dies on the hung-up tty, after which a screen update can block the event loop for good. So
        this runs off the loop: it asks the app to exit and ends the process if it cannot. (Saved
        history is committed message by message; nothing is left to show.)"""
        import termios

        fd = sys.__stdin__.fileno()
        while not self._terminal_watch_done.wait(1.0):
            try:
                termios.tcgetattr(fd)
            except (termios.error, OSError, ValueError):
                break
        else:
            return  # the app ended normally
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self.exit)
            except RuntimeError:  # the loop is closed: the app is ending anyway
                return
        if not self._terminal_watch_done.wait(3.0):
            os._exit(0)

    @property
    def tabbed(self) -> TabbedContent:
        return self.query_one("#tabs", TabbedContent)

    @property
    def kv_panel(self) -> KVPanel:
        return self.query_one("#kv", KVPanel)

    @property
    def tabs(self) -> list[ChatTab]:
        return list(self.query(ChatTab))  # in tab order; empty (not an error) while closing

    @property
    def active_tab(self) -> ChatTab | None:
        pane = self.tabbed.active_pane
        return pane if isinstance(pane, ChatTab) else None

    class ModelProgress(Message):
        """How far loading is (from the loader thread)."""

        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    class ModelLoaded(Message):
        def __init__(self, llm: LLMEngine) -> None:
            super().__init__()
            self.llm = llm

    class ModelFailed(Message):
        def __init__(self, error: str) -> None:
            super().__init__()
            self.error = error

    def _post(self, message: Message) -> None:
        """From the loader thread: never blocks on the UI, so a closing app cannot hang it."""
        try:
            self.post_message(message)
        except RuntimeError:  # the event loop is closed: the app has gone
            pass

    @work(thread=True, exclusive=True, group="engine", exit_on_error=False)
    def load_engine(self) -> None:
        """Thread worker: loading weights takes seconds to minutes; the loading line shows how far."""
        from engine import LLMEngine
        from rosechat.model_choice import ModelChoiceError, choose_model

        kwargs = self.config.engine_kwargs()
        factory = self._engine_factory or (lambda src, progress: LLMEngine.from_pretrained(src, progress, **kwargs))
        try:
            if self.model is None:  # the command line chose it already; tests may not have
                self.model, self.model_notice = choose_model(self.config)
            name = self.model.display_name
            self._post(self.ModelProgress(f"Loading {name}…"))
            llm = factory(self.model, lambda line: self._post(self.ModelProgress(f"Loading {name}: {line}")))
        except ModelChoiceError as e:
            self._post(self.ModelFailed(str(e)))
        except Exception as e:  # a broken checkpoint...: say so; the app stays up to say it
            self._post(self.ModelFailed(f"{type(e).__name__}: {e}"))
        else:
            self._post(self.ModelLoaded(llm))

    def on_rose_chat_app_model_progress(self, event: ModelProgress) -> None:
        if self.engine is None and self.load_error is None:
            self.query_one("#loading-label", Label).update(escape(event.text))

    def on_rose_chat_app_model_failed(self, event: ModelFailed) -> None:
        self.load_error = event.error
        self.query_one(LoadingIndicator).display = False
        self.query_one("#loading-label", Label).update(escape(f"Could not load the model: {event.error}"))
        self.sub_title = "no model"
        self.notify(event.error, title="Model failed to load", severity="error", timeout=30)

    def on_rose_chat_app_model_loaded(self, event: ModelLoaded) -> None:
        from engine import EngineThread

        llm = self.llm = event.llm
        self.engine = EngineThread(llm, self.events.push)
        self.engine.start()
        info = llm.info
        self.sub_title = " · ".join([info.name, info.device, info.dtype, info.backend])
        self.query_one("#loading").display = False
        for tab in self.tabs:
            if tab.engine_cid is None:
                tab.engine_cid = self.engine.new_conversation()
        self.set_interval(1 / DRAIN_HZ, self._poll_events, name="engine-events")
        if self.model_notice:
            self.notify(self.model_notice, title="Model not found", severity="warning", timeout=15)
        if self.kv_panel.display:
            self.engine.request_snapshot()

    @property
    def ready(self) -> bool:
        return self.engine is not None

    def _check_ready(self) -> bool:
        """Whether a model runs; if not, say why (loading, or failed to load) and keep the input."""
        if self.engine is not None:
            return True
        if self.load_error is not None:
            self.notify(f"No model is loaded: {self.load_error}\nQuit (ctrl+q) and start with a model that loads.",
                        title="No model", severity="error", timeout=10)
        else:
            self.notify("The model is still loading…", severity="warning")
        return False

    # ------------------------------------------------------------------ engine events
    def _poll_events(self) -> None:
        if not self._drain_posted and self.events.pending:
            self._drain_posted = True
            self.post_message(self.EngineEvents())

    async def on_rose_chat_app_engine_events(self, _: EngineEvents) -> None:
        from engine.events import Finished

        self._drain_posted = False
        batch = self.events.drain()
        for start in batch.starts:
            tab = self.requests.get(start.request_id)
            if tab is not None and tab.reply is not None:
                await self._turn_started(tab, start)
        for (rid, index), text in batch.deltas.items():
            tab = self.requests.get(rid)
            if tab is not None and tab.reply is not None:
                await tab.reply.add_delta(index, text)
        for rid, waiting in batch.preempted.items():
            tab = self.requests.get(rid)
            if tab is not None and tab.reply is not None:
                tab.reply.set_footer("waiting for KV memory: other replies took its blocks; it resumes where it was"
                                     if waiting else "generating… (escape stops)")
        for end in batch.ends:
            if isinstance(end, Finished):
                await self._reply_finished(end)
            else:
                self._engine_error(end)
        if batch.snapshot is not None:
            self.last_snapshot = batch.snapshot
            for panel in self.query(KVPanel):  # none once the app is closing: a late snapshot is dropped
                panel.show(batch.snapshot, self.owner_styles())

    async def _turn_started(self, tab: ChatTab, ev: TurnStarted) -> None:
        tab.turn = ev
        await tab.mark_context(ev.dropped_messages, ev.context_len)
        if ev.max_tokens_clamped:
            tab.reply.set_footer(f"generating… (escape stops) · the context leaves room for {ev.max_tokens} tokens")

    def owner_styles(self) -> dict[str, OwnerStyle]:
        return {t.engine_cid: OwnerStyle(t.chat_title, t.color) for t in self.tabs if t.engine_cid}

    async def _reply_finished(self, ev: Finished) -> None:
        tab = self.requests.pop(ev.request_id, None)
        if tab is None or tab.reply is None:
            return  # its tab was closed
        view = tab.reply
        await view.set_texts(ev.texts)
        message = tab.reply_replaces or ChatMessage("assistant", "")
        message.content, message.view = view.text, view
        tab.messages.append(message)
        tab.request_id, tab.reply, tab.reply_replaces = None, None, None
        tab.last_finished = ev
        turn = tab.turn if tab.turn is not None and tab.turn.request_id == ev.request_id else None
        clamped = turn is not None and turn.max_tokens_clamped
        counts = ev.sample_tokens or (ev.usage.completion_tokens,)
        rates = ev.sample_tokens_per_s or (ev.tokens_per_s,)
        view.stats = [
            ReplyStats(n, ev.ttft_s, tps, "context" if reason == "length" and clamped else reason)
            for n, tps, reason in zip(counts, rates, ev.finish_reasons)
        ]
        self._refresh_footer(view)
        self._save_reply(tab, message, view.stats[view.shown])

    def _save_reply(self, tab: ChatTab, message: ChatMessage, stats: ReplyStats) -> None:
        figures = dict(tokens=stats.tokens, ttft_s=stats.ttft_s, tokens_per_s=stats.tokens_per_s,
                       finish_reason=stats.finish_reason)
        if message.history_id is None:
            message.history_id = self._save(tab, message, **figures)
        else:
            self._db(self.history.update_message, message.history_id, message.content, **figures)

    def _keep_partial_reply(self, tab: ChatTab) -> None:
        """A reply cut short by closing its tab or quitting is saved as far as it got, "stopped"
        (as escape does). A regenerated reply in progress leaves the saved one as it was."""
        view = tab.reply
        if view is None or tab.reply_replaces is not None or not view.text.strip():
            return
        message = ChatMessage("assistant", view.text, view=view)
        self._save_reply(tab, message, ReplyStats(finish_reason="stopped"))

    def _refresh_footer(self, view: MessageView) -> None:
        line = view.stats[view.shown].line() if view.shown < len(view.stats) else ""
        if len(view.texts) > 1:
            line += f" · alternative {view.shown + 1}/{len(view.texts)} (alt+←/→)"
        view.set_footer(line)

    def _engine_error(self, ev: EngineError) -> None:
        tab = self.requests.pop(ev.request_id, None) if ev.request_id else None
        if tab is not None and ev.code == "context_length_exceeded":
            self._exclude_last_user_message(tab, ev.message)
        if tab is not None and tab.reply is not None:
            tab.reply.set_footer(f"error: {ev.message}")
            tab.reply.add_class("-error")
            if tab.reply_replaces is not None:  # the reply being replaced stays the last message
                tab.messages.append(tab.reply_replaces)
            tab.request_id, tab.reply, tab.reply_replaces = None, None, None
        self.notify(ev.message, title="Engine error", severity="error", timeout=10)

    def _exclude_last_user_message(self, tab: ChatTab, why: str) -> None:
        """A message longer than the context stays in the log and the saved history, but the
        model never sees it again: later turns go on without it."""
        users = [m for m in tab.messages if m.role == "user" and m.in_context]
        if users and users[-1] is tab.messages[-1]:
            message = users[-1]
            message.in_context = False
            if message.view is not None:
                message.view.add_class("-excluded")
                message.view.set_footer(f"not sent to the model: {why}")

    # ------------------------------------------------------------------ history (short transactions)
    def _db(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (sqlite3.Error, KeyError, OSError) as e:
            self.notify(f"{type(e).__name__}: {e}", title="History not saved", severity="error")
            return None

    def _save(self, tab: ChatTab, message: ChatMessage, **stats: Any) -> int | None:
        """Save a completed message, creating the saved conversation on its first message."""
        if tab.history_id is None:
            model = self.llm.info.name if self.llm is not None else self.config.model.name
            tab.history_id = self._db(self.history.create_conversation, tab.chat_title, tab.system_prompt, model)
            if tab.history_id is None:
                return None
        return self._db(self.history.add_message, tab.history_id, message.role, message.content, **stats)

    # ------------------------------------------------------------------ tabs
    def _label(self, tab: ChatTab) -> str:
        return f"[{tab.color}]●[/] {escape(_title_from(tab.chat_title, 24))}"

    def _relabel(self, tab: ChatTab) -> None:
        self.tabbed.get_tab(tab).label = self._label(tab)

    async def new_tab(
        self, title: str = NEW_CHAT, system_prompt: str | None = None, *, fork_of: ChatTab | None = None
    ) -> ChatTab:
        color = PALETTE[self._colors % len(PALETTE)]
        self._colors += 1
        prompt = self.config.chat.system_prompt if system_prompt is None else system_prompt
        tab = ChatTab(title, color=color, system_prompt=prompt)
        await self.tabbed.add_pane(tab)
        self._relabel(tab)
        if self.engine is not None:
            if fork_of is not None and fork_of.engine_cid is not None:
                tab.engine_cid = self.engine.fork_conversation(fork_of.engine_cid)
            else:
                tab.engine_cid = self.engine.new_conversation()
        self.tabbed.active = tab.id or ""
        tab.update_system_line()
        self.call_after_refresh(self._focus_active_input)  # once the new pane is laid out
        return tab

    def _focus_active_input(self) -> None:
        """Focus the input of the tab active *now*. Every focus request goes through here, late
        ones included (after a refresh, a TabActivated handled after another switch), so focus
        never lands in a pane the user has left."""
        if (tab := self.active_tab) is not None:
            self.set_focus(tab.input)

    async def action_new_tab(self) -> None:
        await self.new_tab()

    async def action_close_tab(self) -> None:
        tab = self.active_tab
        if tab is None:
            return
        self._keep_partial_reply(tab)
        if self.engine is not None:
            if tab.request_id is not None:
                self.engine.abort(tab.request_id)
            if tab.engine_cid is not None:
                self.engine.drop_conversation(tab.engine_cid)  # frees its blocks
        if tab.request_id is not None:
            self.requests.pop(tab.request_id, None)
        await self.tabbed.remove_pane(tab.id or "")
        if not self.tabs:
            await self.new_tab()
        else:
            self._focus_active_input()

    def _switch(self, step: int) -> None:
        tabs, active = self.tabs, self.active_tab
        if tabs and active is not None:
            self.tabbed.active = tabs[(tabs.index(active) + step) % len(tabs)].id or ""

    def action_next_tab(self) -> None:
        self._switch(1)

    def action_previous_tab(self) -> None:
        self._switch(-1)

    def action_goto_tab(self, number: int) -> None:
        tabs = self.tabs
        if 1 <= number <= len(tabs):
            self.tabbed.active = tabs[number - 1].id or ""

    @on(TabbedContent.TabActivated)
    def _tab_activated(self, event: TabbedContent.TabActivated) -> None:
        self._focus_active_input()  # this message may be stale: focus the tab active now

    async def action_fork(self) -> None:
        src = self.active_tab
        if src is None or not self._check_ready():
            return
        if src.generating:
            self.notify("Wait for the reply to finish (or stop it with escape) before forking.")
            return
        tab = await self.new_tab(f"{src.chat_title} (fork)", src.system_prompt, fork_of=src)
        for m in src.messages:
            copy = ChatMessage(m.role, m.content)
            tab.messages.append(copy)
            await tab.add_message(copy)
            if src.history_id is not None:  # a saved conversation forks into a saved one
                copy.history_id = self._save(tab, copy)
        self.notify(f"Forked {src.chat_title!r}: the new tab shares its KV blocks.")

    # ------------------------------------------------------------------ chatting
    @on(ChatInput.Submitted)
    async def _submitted(self, event: ChatInput.Submitted) -> None:
        event.stop()
        tab = event.input.query_ancestor(ChatTab)  # its own tab: not necessarily the active one
        text = event.value.strip()
        if tab is None:
            return
        if not text:  # only spaces and newlines: nothing to send, nothing worth keeping
            event.input.value = ""
            return
        if not self._check_ready():
            return
        if tab.generating:
            self.notify("This tab is still replying (escape stops it).", severity="warning")
            return
        event.input.value = ""
        await self.send(tab, text)

    async def send(self, tab: ChatTab, text: str) -> str:
        """Add a user message to ``tab`` and start the reply; returns the request id."""
        message = ChatMessage("user", text)
        tab.messages.append(message)
        await tab.add_message(message)
        if tab.chat_title == NEW_CHAT:
            tab.chat_title = _title_from(text)
            self._relabel(tab)
        message.history_id = self._save(tab, message)
        return await self._start_reply(tab, n=1)

    async def _start_reply(self, tab: ChatTab, n: int, replaces: ChatMessage | None = None) -> str:
        from engine import SamplingParams

        assert self.engine is not None and tab.engine_cid is not None
        if replaces is not None and replaces.view is not None:
            view = replaces.view
            await view.reset(n)
        else:
            view = await tab.add_message(ChatMessage("assistant", ""), n=n)
        params = SamplingParams(**self.config.sampling_kwargs(n, self.llm.info.generation_defaults))
        rid = self.engine.submit_turn(tab.engine_cid, tab.chat_messages(), params)
        # Registered before the next drain can run (same thread), so no delta is missed.
        tab.request_id, tab.reply, tab.reply_replaces = rid, view, replaces
        self.requests[rid] = tab
        view.stats = []
        view.set_footer("generating… (escape stops)")
        tab.log_view.anchor()
        return rid

    def action_stop(self) -> None:
        tab = self.active_tab
        if tab is not None and tab.request_id is not None and self.engine is not None:
            self.engine.abort(tab.request_id)
            if tab.reply is not None:
                tab.reply.set_footer("stopping…")

    async def action_regenerate(self) -> None:
        tab = self.active_tab
        if tab is None or not self._check_ready():
            return
        if tab.generating:
            self.notify("This tab is still replying (escape stops it).", severity="warning")
            return
        last = tab.last_assistant()
        if last is None:
            self.notify("No reply to regenerate yet.")
            return
        tab.messages.pop()  # the prompt is everything before it
        await self._start_reply(tab, n=self.config.chat.alternatives, replaces=last)

    async def action_cycle(self, step: int) -> None:
        tab = self.active_tab
        if tab is None:
            return
        message = None if tab.generating else tab.last_assistant()
        view = tab.reply if tab.generating else (message.view if message else None)
        if view is None or len(view.texts) < 2:
            self.notify("No alternatives here: ctrl+r samples some.", timeout=3)
            return
        await view.show_alternative(view.shown + step)
        if view.stats:
            self._refresh_footer(view)
        else:
            view.set_footer(f"generating… alternative {view.shown + 1}/{len(view.texts)}")
        if message is not None:  # the shown alternative is the one the conversation continues with
            message.content = view.text
            if message.history_id is not None:
                self._save_reply(tab, message, view.stats[view.shown])


    def _last_reply_text(self) -> str | None:
        tab = self.active_tab
        message = tab.last_assistant() if tab is not None else None
        if message is None or not message.content.strip():
            self.notify("No reply to copy yet.", timeout=3)
            return None
        return message.content

    def action_copy_reply(self) -> None:
        """Copy the last reply (the alternative shown) through the terminal's clipboard (OSC 52)."""
        if (text := self._last_reply_text()) is not None:
            self.copy_to_clipboard(text)
            self.notify(f"Copied the reply ({len(text):,} characters).", timeout=3)

    def action_copy_code(self) -> None:
        """Copy the last fenced code block of the last reply, without its fences."""
        if (text := self._last_reply_text()) is None:
            return
        blocks = _CODE_FENCE.findall(text)
        if not blocks:
            self.notify("The last reply has no code block (ctrl+y copies all of it).", timeout=3)
            return
        self.copy_to_clipboard(blocks[-1])
        self.notify(f"Copied the code block ({blocks[-1].count(chr(10)) + 1} lines).", timeout=3)

    # ------------------------------------------------------------------ panel, prompts, history
    def action_toggle_kv(self) -> None:
        panel = self.kv_panel
        panel.display = not panel.display
        if panel.display:
            if self.last_snapshot is not None:
                panel.show(self.last_snapshot, self.owner_styles())
            if self.engine is not None:
                self.engine.request_snapshot()

    def action_system_prompt(self) -> None:
        tab = self.active_tab
        if tab is None:
            return

        def done(prompt: str | None) -> None:
            if prompt is None or prompt == tab.system_prompt:
                return
            tab.system_prompt = prompt
            tab.update_system_line()
            if tab.history_id is not None:
                self._db(self.history.set_system_prompt, tab.history_id, prompt)
            self.notify("System prompt updated; it applies from the next reply.")

        self.push_screen(SystemPromptScreen(tab.system_prompt, tab.chat_title), done)

    def action_rename(self) -> None:
        tab = self.active_tab
        if tab is None:
            return

        def done(title: str | None) -> None:
            if title:
                tab.chat_title = title
                self._relabel(tab)
                if tab.history_id is not None:
                    self._db(self.history.rename, tab.history_id, title)

        self.push_screen(TextPromptScreen("New title", tab.chat_title), done)

    def export_directory(self) -> Path:
        return self.export_dir or self.config.export_path()

    def action_export(self) -> Path | None:
        tab = self.active_tab
        if tab is None or tab.history_id is None:
            self.notify("Nothing to export yet: this conversation has no saved messages.")
            return None
        path = self._db(self.history.export_markdown, tab.history_id, self.export_directory())
        if path is not None:
            self.notify(f"Exported to {path}", title="Export")
        return path

    def action_conversations(self) -> None:
        async def done(history_id: str | None) -> None:
            if history_id is not None:
                await self.open_saved(history_id)

        self.push_screen(ConversationsScreen(self.history, self.export_directory), done)

    async def open_saved(self, history_id: str) -> ChatTab | None:
        """Open a saved conversation in a tab (or switch to it). Its KV is computed on the next turn."""
        for tab in self.tabs:
            if tab.history_id == history_id:
                self.tabbed.active = tab.id or ""
                return tab
        conv = self._db(self.history.load, history_id)
        if conv is None:
            return None
        tab = await self.new_tab(conv.title, conv.system_prompt)
        tab.history_id = conv.id
        for m in conv.messages:
            message = ChatMessage(m.role, m.content, history_id=m.id)
            tab.messages.append(message)
            view = await tab.add_message(message)
            if m.role == "assistant":
                view.stats = [ReplyStats(m.tokens, m.ttft_s, m.tokens_per_s, m.finish_reason)]
                self._refresh_footer(view)
        return tab

    @on(ConversationRenamed)
    def _renamed(self, event: ConversationRenamed) -> None:
        for tab in self.tabs:
            if tab.history_id == event.history_id:
                tab.chat_title = event.title
                self._relabel(tab)

    @on(ConversationDeleted)
    def _deleted(self, event: ConversationDeleted) -> None:
        for tab in self.tabs:
            if tab.history_id == event.history_id:
                # Its rows are gone: the next message saves the tab as a new conversation.
                tab.history_id = None
                for m in tab.messages:
                    m.history_id = None

    # ------------------------------------------------------------------ shutdown
    def run(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().run(*args, **kwargs)
        finally:  # fully closed (driver included): the terminal watch can stand down
            self._terminal_watch_done.set()

    async def on_unmount(self) -> None:
        for tab in set(self.requests.values()):  # plain objects: no DOM needed while closing
            self._keep_partial_reply(tab)
        await self.shutdown_engine()

    async def shutdown_engine(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            # join() blocks; off the event loop so the UI can finish closing meanwhile.
            await asyncio.to_thread(engine.shutdown, 5.0)
