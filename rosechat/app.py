"""The rosechat Textual app: chat tabs over one backend, and the KV-cache panel.

The app lays the screen out and runs what its keys (rosechat/commands.py) and dialogs ask for. Its
``EngineLink`` (rosechat/engine_link.py) brings the backend up (a model loading in a thread worker,
or a remote server) and carries the backend's events to the tabs and the panel: a 30 Hz timer posts
one ``EngineEvents`` message when something is pending, and its handler has the link drain it.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from textual import on, work
from textual.app import App, ComposeResult
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Footer, Header

from rosechat.backend import Backend, local_backend, remote_backend
from rosechat.bridge import EventBuffer
from rosechat.commands import BINDINGS, TAB_ACTIONS, RoseChatCommands
from rosechat.config import Config
from rosechat.engine_link import DRAIN_HZ, EngineLink
from rosechat.history import HistoryStore
from rosechat.keys import use_alt_digits
from rosechat.saver import Saver
from rosechat.screens import ConversationDeleted, ConversationsScreen, SystemPromptScreen, TextPromptScreen
from rosechat.terminal import TerminalWatch
from rosechat.widgets.chat import ChatInput
from rosechat.widgets.kv_panel import KVPanel
from rosechat.widgets.loading import ModelLoader, RemoteConnector
from rosechat.widgets.tab import ChatTab
from rosechat.widgets.tabs import ChatTabs

if TYPE_CHECKING:
    from engine import CacheSnapshot, EngineInfo, LLMEngine, ModelSource, SamplingParams

# ESC + digit (alt+digit in tmux, screen, xterm, ...) reaches the app as alt+1…alt+9, not as
# the macOS glyphs Textual makes of it ("¡", "™", ...): see rosechat/keys.py
use_alt_digits()


class RoseChatApp(App[None]):
    CSS_PATH = "app.tcss"
    # Below 32 rows the screen gets "-short": a slimmer input and KV panel keep 8+ rows of chat
    VERTICAL_BREAKPOINTS = [(0, "-short"), (32, "-tall")]
    TITLE = "rosechat"
    COMMANDS = App.COMMANDS | {RoseChatCommands}

    BINDINGS = BINDINGS  # with the palette's entries, in rosechat/commands.py

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
        self._engine_factory = engine_factory  # tests may pass one (in this process); default an EngineProcess
        self.llm: LLMEngine | None = None  # the model, once loaded in this process (an engine_factory's)
        self.info: EngineInfo | None = None  # the model's, once loaded (None with a remote server)
        self.link = EngineLink(self, self.params_for)  # the backend, and its events to the tabs and the panel
        self.model_notice = model_notice  # why the demo model runs instead of the configured one
        self.saver = Saver(history, self._model_name, self.notify)
        self._terminal = TerminalWatch(self._exit_from_thread)

    # ------------------------------------------------------------------ layout and start-up
    def compose(self) -> ComposeResult:
        yield Header()
        if not self.config.remote.url:
            yield ModelLoader(self.config, self.model, self.model_notice, self._engine_factory, self.events.push,
                              id="loading")
        else:  # a server: nothing to load, but it may not be up yet
            yield RemoteConnector(self.config, self.events.push, id="loading")
        yield ChatTabs(self.saver, self.config.chat.system_prompt, id="tabs")
        panel = KVPanel(id="kv")
        panel.display = self.config.ui.show_kv_panel
        yield panel
        yield Footer()

    async def on_mount(self) -> None:
        self.theme = self.config.ui.theme
        self.sub_title = f"loading {self._model_name()}…"
        await self.tabbed.new()
        self.set_interval(1 / DRAIN_HZ, self._poll_events, name="engine-events")  # loading reports through it too
        self.events.on_end = self._poll_soon
        if not self.is_headless:
            self._terminal.start()

    def _exit_from_thread(self) -> None:
        if (loop := self._loop) is not None:
            loop.call_soon_threadsafe(self.exit)

    def _model_name(self) -> str:
        if self.info is not None:
            return self.info.name
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

    # The link's state, under the app's names (tests and tools read them)
    @property
    def engine(self) -> Backend | None:
        return self.link.backend

    @property
    def load_error(self) -> str | None:
        return self.link.load_error

    @property
    def events(self) -> EventBuffer:
        return self.link.events

    @property
    def requests(self) -> dict[str, ChatTab]:
        return self.link.requests

    @property
    def last_snapshot(self) -> CacheSnapshot | None:
        return self.link.last_snapshot

    @on(RemoteConnector.Reachable)
    async def _remote_reachable(self) -> None:
        r = self.config.remote
        await self.query("#loading").remove()
        self.sub_title = f"remote · {r.model or 'server default'} · {r.url}"
        await self.link.start(remote_backend(self.config, self.events.push))

    @on(ModelLoader.Failed)
    def _model_failed(self, event: ModelLoader.Failed) -> None:
        self.sub_title = "no model"
        self.link.failed(event.error)

    @on(ModelLoader.Loaded)
    async def _model_loaded(self, event: ModelLoader.Loaded) -> None:
        from engine import LLMEngine

        self.model, self.model_notice = event.model, event.notice
        if isinstance(event.engine, LLMEngine):
            self.llm = event.engine
            # What is alive now (the model's and tokenizer's objects, hundreds of thousands) lives as long as the
            # app: out of the collector's sight, a full collection walks only what came since. One walked them
            # all, and the engine thread that triggers it by allocating stalls meanwhile (~0.2-0.8 s on 2 cores).
            gc.freeze()
            backend: Backend = local_backend(self.llm, self.events.push)
        else:  # an EngineProcess: started and loaded, its events already going to the buffer
            backend = event.engine
        self.info = info = event.engine.info
        for loader in self.query("#loading").results(ModelLoader):  # ours now: its removal must not end it
            loader.take()
        await self.query("#loading").remove()
        if self.model_notice:
            self.notify(self.model_notice, title="Model not found", severity="warning", timeout=15)
        if info.notice:
            self.notify(info.notice, title="Model", timeout=10)
        self.sub_title = " · ".join([info.name, info.runs_on, info.dtype])
        await self.link.start(backend)

    @on(ChatTab.Idle)
    async def _tab_idle(self, event: ChatTab.Idle) -> None:
        await self.link.send_queued(event.tab)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        return not (action in TAB_ACTIONS and isinstance(self.screen, ModalScreen))

    @property
    def ready(self) -> bool:
        return self.engine is not None

    def params_for(self, tab: ChatTab, n: int) -> SamplingParams:
        """sampling_params, held to a JSON object where the tab is in JSON mode."""
        params = self.sampling_params(n)
        if tab.json_mode:
            from engine import StructuredOutput

            params = dataclasses.replace(params, structured=StructuredOutput(json_object=True))
        return params

    def sampling_params(self, n: int) -> SamplingParams:
        """What a reply with ``n`` alternatives is sampled with: config.toml's [sampling] over the model's
        own generation defaults (a subclass may change them: `rosechat bench app` runs every reply to max_tokens)."""
        from engine import SamplingParams

        model_defaults = self.info.generation_defaults if self.info is not None else {}  # a server: its own
        return SamplingParams(**self.config.sampling_kwargs(n, model_defaults))

    # ------------------------------------------------------------------ engine events
    def _poll_soon(self) -> None:
        """From the backend's thread, as a reply ends: poll now, on the UI's loop."""
        if (loop := self._loop) is not None:
            try:
                loop.call_soon_threadsafe(self._poll_events)
            except RuntimeError:  # the loop has closed: the app is gone
                pass

    def _poll_events(self) -> None:
        if self.link.poll():
            self.post_message(self.EngineEvents())

    async def on_rose_chat_app_engine_events(self, _: EngineEvents) -> None:
        self.link.drain()

    # ------------------------------------------------------------------ tabs
    async def action_new_tab(self) -> None:
        await self.tabbed.new()

    async def action_close_tab(self) -> None:
        if (tab := self.active_tab) is not None:
            await self.tabbed.close(tab)
            if not self.tabs:
                await self.tabbed.new()

    def action_next_tab(self) -> None:
        self.tabbed.switch(1)

    def action_previous_tab(self) -> None:
        self.tabbed.switch(-1)

    def action_goto_tab(self, number: int) -> None:
        self.tabbed.goto(number)

    async def action_fork(self) -> None:
        src = self.active_tab
        if src is None or not self.link.can_start(src):
            return
        await self.tabbed.fork(src)

    # ------------------------------------------------------------------ chatting
    @on(ChatInput.Submitted)
    async def _submitted(self, event: ChatInput.Submitted) -> None:
        event.stop()
        tab = event.input.query_ancestor(ChatTab)  # its own tab: not necessarily the active one
        text = event.value.strip()
        if not text:  # only spaces and newlines: nothing to send, nothing worth keeping
            event.input.value = ""
            return
        if text.lower() == "/json":  # a command, not a message
            event.input.value = ""
            self.toggle_json(tab)
            return
        if self.engine is None and self.load_error is None:  # loading: kept, and sent once it is ready
            event.input.value = ""
            await tab.queue(text)
            return
        if not self.link.can_start(tab):
            return
        event.input.value = ""
        await self.send(tab, text)

    async def send(self, tab: ChatTab, text: str) -> str:
        """Add a user message to ``tab`` and start the reply; returns the request id."""
        rid = await tab.send(text, self.params_for(tab, 1))
        self.requests[rid] = tab  # before the next drain can run (same thread): no event is missed
        return rid

    def action_toggle_json(self) -> None:
        if (tab := self.active_tab) is not None:
            self.toggle_json(tab)

    def toggle_json(self, tab: ChatTab) -> None:
        tab.json_mode = not tab.json_mode
        self.notify("JSON mode: each reply is a JSON object." if tab.json_mode else "JSON mode off.",
                    title=tab.chat_title)

    def action_stop(self) -> None:
        if (tab := self.active_tab) is not None:
            tab.stop()

    async def action_regenerate(self) -> None:
        tab = self.active_tab
        if tab is None or not self.link.can_start(tab):
            return
        if (rid := await tab.regenerate(self.params_for(tab, self.config.chat.alternatives))) is not None:
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
            self.link.refresh(panel)

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
        self.tabbed.retitle(title, history_id, tab)
        return title

    def export_directory(self) -> Path:
        return self.export_dir or self.config.export_path()

    def action_export(self) -> Path | None:
        tab = self.active_tab
        if tab is None or tab.history_id is None:
            self.notify("Nothing to export yet: this conversation has no saved messages.")
            return None
        return self.saver.export(tab.history_id, self.export_directory())

    @work(group="dialog")
    async def action_conversations(self) -> None:
        screen = ConversationsScreen(self.history, self.export_directory, self.rename)
        if (history_id := await self.push_screen_wait(screen)) is not None:
            await self.tabbed.open_saved(history_id)

    @on(ConversationDeleted)
    def _deleted(self, event: ConversationDeleted) -> None:
        for tab in self.tabbed.showing(event.history_id):
            tab.forget_saved()

    # ------------------------------------------------------------------ shutdown
    def run(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().run(*args, **kwargs)
        finally:  # fully closed (driver included): the terminal watch can stand down
            self._terminal.stop()

    async def on_unmount(self) -> None:
        # The tabs have kept their partial replies as they unmounted; a remote connector has stopped its loop.
        await self.link.shutdown()
