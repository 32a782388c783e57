"""The rosechat Textual app: chat tabs over one backend, and the KV-cache panel.

Threads: the model loads in a thread worker (``ModelLoader``); the engine then runs on its own thread, whose event
callback only appends to an ``EventBuffer``. A 30 Hz timer posts one ``EngineEvents`` message when
something is pending; its handler drains the coalesced batch on the UI thread and routes each
request's events, as typed messages, to the tab that owns the request. The tabs do the rest.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Footer, Header

from rosechat.backend import Backend, local_backend, remote_backend
from rosechat.bridge import EventBuffer
from rosechat.commands import RoseChatCommands
from rosechat.config import Config
from rosechat.history import HistoryStore
from rosechat.keys import use_alt_digits
from rosechat.saver import Saver
from rosechat.screens import ConversationDeleted, ConversationsScreen, SystemPromptScreen, TextPromptScreen
from rosechat.terminal import TerminalWatch
from rosechat.widgets.chat import ChatInput
from rosechat.widgets.kv_panel import KVPanel, OwnerStyle
from rosechat.widgets.loading import LoadBar, ModelLoader
from rosechat.widgets.reply import ReplyFailed, ReplyFinished, reply_messages
from rosechat.widgets.tab import NEW_CHAT, ChatTab
from rosechat.widgets.tabs import ChatTabs

if TYPE_CHECKING:
    from engine import CacheSnapshot, LLMEngine, ModelSource, SamplingParams

DRAIN_HZ = 30

# ESC + digit (alt+digit in tmux, screen, xterm, ...) reaches the app as alt+1…alt+9, not as
# the macOS glyphs Textual makes of it ("¡", "™", ...): see rosechat/keys.py
use_alt_digits()


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
        # terminal does not keep them for itself (or type characters with alt). alt+digit has no
        # character (use_alt_digits above), so the input box never types it, priority or not.
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

    class RemoteReachable(Message):
        """The remote server answers: its backend can start."""

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
        self.engine: Backend | None = None
        self.events = EventBuffer()
        self.requests: dict[str, ChatTab] = {}  # request id -> the tab it replies in (until it ends)
        self.last_snapshot: CacheSnapshot | None = None
        self.model_notice = model_notice  # why the demo model runs instead of the configured one
        self.load_error: str | None = None  # why no model could be loaded
        self.saver = Saver(history, self._model_name, self.notify)
        self._drain_posted = False
        self._terminal = TerminalWatch(self._exit_from_thread)
        self._stop_connecting = threading.Event()  # wakes the remote server's connect loop at exit

    # ------------------------------------------------------------------ layout and start-up
    def compose(self) -> ComposeResult:
        yield Header()
        if not self.config.remote.url:
            yield ModelLoader(self.config, self.model, self.model_notice, self._engine_factory, self.events.push,
                              id="loading")
        else:
            with Vertical(id="loading"):
                yield LoadBar(f"Connecting to {self.config.remote.url}", id="loading-bar")
        yield ChatTabs(id="tabs")
        panel = KVPanel(id="kv")
        panel.display = self.config.ui.show_kv_panel
        yield panel
        yield Footer()

    async def on_mount(self) -> None:
        self.theme = self.config.ui.theme
        self.sub_title = f"loading {self._model_name()}…"
        await self.new_tab()
        self.set_interval(1 / DRAIN_HZ, self._poll_events, name="engine-events")  # loading reports through it too
        if self.config.remote.url:  # a server: nothing to load, but it may not be up yet
            self._connect_remote()
        if not self.is_headless:
            self._terminal.start()

    def _exit_from_thread(self) -> None:
        if (loop := self._loop) is not None:
            loop.call_soon_threadsafe(self.exit)

    def _model_name(self) -> str:
        if self.llm is not None:
            return self.llm.info.name
        if self.config.remote.url:
            return self.config.remote.model or self.config.remote.url
        return self.model.display_name if self.model is not None else self.config.model.name

    @property
    def tabbed(self) -> ChatTabs:
        return self.query_one("#tabs", ChatTabs)

    @property
    def kv_panel(self) -> KVPanel:
        return self.query_one("#kv", KVPanel)

    @property
    def tabs(self) -> list[ChatTab]:
        return list(self.query(ChatTab))  # in tab order; empty (not an error) while closing

    @property
    def active_tab(self) -> ChatTab | None:
        return self.tabbed.active_tab

    @work(thread=True, exclusive=True, group="engine", exit_on_error=False)
    def _connect_remote(self) -> None:
        """Until the server answers (down, or loading its model), say so each second; messages queue meanwhile.
        Once it answers, a failure later on (it went away) shows in the tab that meets it."""
        from engine.events import LoadProgress
        from rosechat.remote import unreachable

        r, began = self.config.remote, time.monotonic()
        for attempt in range(1, 1 << 62):
            if (why := unreachable(r.url, self.config.remote_api_key(), r.connect_timeout)) is None:
                self.post_message(self.RemoteReachable())
                return
            self.events.push(LoadProgress(f"{why}; retrying", attempt, 0, time.monotonic() - began))
            if self._stop_connecting.wait(1.0):
                return

    @on(RemoteReachable)
    async def _remote_reachable(self) -> None:
        r = self.config.remote
        await self.query("#loading").remove()
        await self._backend_ready(remote_backend(self.config, self.events.push),
                                  f"remote · {r.model or 'server default'} · {r.url}")

    @on(ModelLoader.Failed)
    def _model_failed(self, event: ModelLoader.Failed) -> None:
        self.load_error = event.error
        self.sub_title = "no model"
        self.kv_panel.load_failed(event.error)
        for tab in self.tabs:
            tab.unsend_queued("the model did not load")
        self.notify(event.error, title="Model failed to load", severity="error", timeout=30)

    @on(ModelLoader.Loaded)
    async def _model_loaded(self, event: ModelLoader.Loaded) -> None:
        self.model, self.model_notice = event.model, event.notice
        self.llm = event.llm
        info = self.llm.info
        if self.model_notice:
            self.notify(self.model_notice, title="Model not found", severity="warning", timeout=15)
        await self._backend_ready(local_backend(self.llm, self.events.push),
                                  " · ".join([info.name, info.runs_on, info.dtype]))

    async def _backend_ready(self, backend: Backend, sub_title: str) -> None:
        self.engine, self.sub_title = backend, sub_title
        for tab in self.tabs:
            if tab.engine_cid is None:
                tab.connect(self.engine)
        self.engine.request_snapshot()  # the panel's first map ends its loading view, shown or not
        for tab in self.tabs:  # what was typed while loading, in order, a tab's first message first
            await self._send_queued(tab)

    async def _send_queued(self, tab: ChatTab) -> None:
        if self.engine is not None and (rid := await tab.send_queued(self.sampling_params(1))) is not None:
            self.requests[rid] = tab

    @on(ChatTab.Idle)
    async def _tab_idle(self, event: ChatTab.Idle) -> None:
        await self._send_queued(event.tab)

    # The chat's own actions: under a dialog (conversations, system prompt, rename) their keys would act
    # on the tabs behind it (ctrl+w closing one unseen), so they wait until it closes
    TAB_ACTIONS = frozenset({"new_tab", "close_tab", "fork", "next_tab", "previous_tab", "goto_tab", "stop",
                             "regenerate", "cycle", "copy_reply", "copy_code", "system_prompt", "conversations"})

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        return not (action in self.TAB_ACTIONS and isinstance(self.screen, ModalScreen))

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

    def _can_start(self, tab: ChatTab) -> bool:
        """A model runs and ``tab`` is not replying; if not, say so (the input keeps its text)."""
        if self._check_ready() and tab.generating:
            self.notify("This tab is still replying (escape stops it).", severity="warning")
        return self.engine is not None and not tab.generating

    def sampling_params(self, n: int) -> SamplingParams:
        """What a reply with ``n`` alternatives is sampled with: config.toml's [sampling] over the model's
        own generation defaults (a subclass may change them: `rosechat bench app` runs every reply to max_tokens)."""
        from engine import SamplingParams

        model_defaults = self.llm.info.generation_defaults if self.llm is not None else {}  # a server: its own
        return SamplingParams(**self.config.sampling_kwargs(n, model_defaults))

    # ------------------------------------------------------------------ engine events
    def _poll_events(self) -> None:
        if not self._drain_posted and self.events.pending:
            self._drain_posted = True
            self.post_message(self.EngineEvents())

    async def on_rose_chat_app_engine_events(self, _: EngineEvents) -> None:
        self._drain_posted = False
        batch = self.events.drain()
        for rid, message in reply_messages(batch):
            end = isinstance(message, (ReplyFinished, ReplyFailed))  # its last: the route ends with it
            tab = self.requests.pop(rid, None) if end else self.requests.get(rid)
            if (tab is None or not tab.post_message(message)) and isinstance(message, ReplyFailed):
                self.notify(message.error.message, title="Engine error", severity="error", timeout=10)
        for error in batch.engine_errors:  # no request's: the engine's own
            self.notify(error.message, title="Engine error", severity="error", timeout=10)
        if batch.snapshot is not None:
            self.last_snapshot = batch.snapshot
            for panel in self.query(KVPanel):  # none once the app is closing: a late snapshot is dropped
                panel.show(batch.snapshot, self.owner_styles())
        if batch.server_stats is not None:
            for panel in self.query(KVPanel):
                panel.show_server(batch.server_stats)
        if batch.loading and self.engine is None:  # the engine's first snapshot ends the load
            for bar in self.query("#loading-bar").results(LoadBar):
                bar.show(batch.loading[-1])
            for panel in self.query(KVPanel):
                for progress in batch.loading:
                    panel.show_loading(progress)

    def owner_styles(self) -> dict[str, OwnerStyle]:
        return {t.engine_cid: OwnerStyle(t.chat_title, t.color) for t in self.tabs if t.engine_cid}

    # ------------------------------------------------------------------ tabs
    async def new_tab(
        self, title: str = NEW_CHAT, system_prompt: str | None = None, *, fork_of: ChatTab | None = None
    ) -> ChatTab:
        prompt = self.config.chat.system_prompt if system_prompt is None else system_prompt
        tab = ChatTab(title, color=self.tabbed.next_color(), system_prompt=prompt, saver=self.saver)
        await self.tabbed.open(tab)
        if self.engine is not None:
            tab.connect(self.engine, fork_of)
        return tab

    async def action_new_tab(self) -> None:
        await self.new_tab()

    async def action_close_tab(self) -> None:
        if (tab := self.active_tab) is not None:
            await self.tabbed.close(tab)
            if not self.tabs:
                await self.new_tab()

    def action_next_tab(self) -> None:
        self.tabbed.switch(1)

    def action_previous_tab(self) -> None:
        self.tabbed.switch(-1)

    def action_goto_tab(self, number: int) -> None:
        self.tabbed.goto(number)

    async def action_fork(self) -> None:
        src = self.active_tab
        if src is None or not self._can_start(src):
            return
        tab = await self.new_tab(f"{src.chat_title} (fork)", src.system_prompt, fork_of=src)
        await tab.copy_from(src)
        self.notify(f"Forked {src.chat_title!r}: the new tab shares its KV blocks.")

    # ------------------------------------------------------------------ chatting
    @on(ChatInput.Submitted)
    async def _submitted(self, event: ChatInput.Submitted) -> None:
        event.stop()
        tab = event.input.query_ancestor(ChatTab)  # its own tab: not necessarily the active one
        text = event.value.strip()
        if not text:  # only spaces and newlines: nothing to send, nothing worth keeping
            event.input.value = ""
            return
        if self.engine is None and self.load_error is None:  # loading: kept, and sent once it is ready
            event.input.value = ""
            await tab.queue(text)
            return
        if not self._can_start(tab):
            return
        event.input.value = ""
        await self.send(tab, text)

    async def send(self, tab: ChatTab, text: str) -> str:
        """Add a user message to ``tab`` and start the reply; returns the request id."""
        rid = await tab.send(text, self.sampling_params(1))
        self.requests[rid] = tab  # before the next drain can run (same thread): no event is missed
        return rid

    def action_stop(self) -> None:
        if (tab := self.active_tab) is not None:
            tab.stop()

    async def action_regenerate(self) -> None:
        tab = self.active_tab
        if tab is None or not self._can_start(tab):
            return
        if (rid := await tab.regenerate(self.sampling_params(self.config.chat.alternatives))) is not None:
            self.requests[rid] = tab

    async def action_cycle(self, step: int) -> None:
        if (tab := self.active_tab) is not None:
            await tab.cycle(step)

    def action_copy_reply(self) -> None:
        if (tab := self.active_tab) is not None:
            tab.copy_reply()

    def action_copy_code(self) -> None:
        if (tab := self.active_tab) is not None:
            tab.copy_code()

    # ------------------------------------------------------------------ panel, dialogs, history
    def action_toggle_kv(self) -> None:
        panel = self.kv_panel
        panel.display = not panel.display
        if panel.display:
            if self.last_snapshot is not None:
                panel.show(self.last_snapshot, self.owner_styles())
            if self.engine is not None:
                self.engine.request_snapshot()

    @work(group="dialog")
    async def action_system_prompt(self) -> None:
        if (tab := self.active_tab) is not None:
            prompt = await self.push_screen_wait(SystemPromptScreen(tab.system_prompt, tab.chat_title))
            if prompt is not None:
                tab.set_system_prompt(prompt)

    @work(group="dialog")
    async def action_rename(self) -> None:
        if (tab := self.active_tab) is not None:
            await self.rename(tab.chat_title, tab.history_id, tab)

    async def rename(self, current: str, history_id: str | None, tab: ChatTab | None = None) -> str | None:
        """The one rename flow, for a tab (the palette) or a saved conversation (the list): ask
        for the title (in a worker), save it, retitle the tab and every open tab showing it."""
        title = await self.push_screen_wait(TextPromptScreen("New title", current))
        if not title:
            return None
        if history_id is not None:
            self.saver.call(self.history.rename, history_id, title)
        for t in self.tabs:
            if t is tab or (history_id is not None and t.history_id == history_id):
                t.chat_title = title  # a reactive: the tab relabels itself
        return title

    def export_directory(self) -> Path:
        return self.export_dir or self.config.export_path()

    def action_export(self) -> Path | None:
        tab = self.active_tab
        if tab is None or tab.history_id is None:
            self.notify("Nothing to export yet: this conversation has no saved messages.")
            return None
        path = self.saver.call(self.history.export_markdown, tab.history_id, self.export_directory())
        if path is not None:
            self.notify(f"Exported to {path}", title="Export")
        return path

    @work(group="dialog")
    async def action_conversations(self) -> None:
        screen = ConversationsScreen(self.history, self.export_directory, self.rename)
        if (history_id := await self.push_screen_wait(screen)) is not None:
            await self.open_saved(history_id)

    async def open_saved(self, history_id: str) -> ChatTab | None:
        """Open a saved conversation in a tab (or switch to it). Its KV is computed on the next turn."""
        for tab in self.tabs:
            if tab.history_id == history_id:
                self.tabbed.activate(tab)
                return tab
        conv = self.saver.call(self.history.load, history_id)
        if conv is None:
            return None
        tab = await self.new_tab(conv.title, conv.system_prompt)
        await tab.load_saved(conv)
        return tab

    @on(ConversationDeleted)
    def _deleted(self, event: ConversationDeleted) -> None:
        for tab in self.tabs:
            if tab.history_id == event.history_id:
                tab.forget_saved()

    # ------------------------------------------------------------------ shutdown
    def run(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().run(*args, **kwargs)
        finally:  # fully closed (driver included): the terminal watch can stand down
            self._terminal.stop()

    async def on_unmount(self) -> None:
        # The tabs have kept their partial replies as they unmounted.
        self._stop_connecting.set()
        await self.shutdown_engine()

    async def shutdown_engine(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            # join() blocks; off the event loop so the UI can finish closing meanwhile.
            await asyncio.to_thread(engine.shutdown, 5.0)
