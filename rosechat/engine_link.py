"""The app's link to its backend: from loading to shutdown, and every event in between.

The model loads in a thread worker (``ModelLoader``; a remote server's ``RemoteConnector`` waits in
one); once it runs the link holds the backend, connects the tabs to it and sends what was typed
meanwhile, in order. If it never comes, the link holds why, and the queued messages stay unsent.

The backend's thread (and the loader's) only appends to the link's ``EventBuffer``. On the app's
30 Hz timer (and as a reply ends: ``EventBuffer.on_end``) ``poll`` says when something waits; the
app then posts itself one ``EngineEvents`` message, whose handler calls ``drain``: on the UI
thread, each request's events go, as typed messages, to the tab that owns the request (until its
last one), the newest cache snapshot and server figures to the KV panel, and load progress to the
load bars. The tabs do the rest.

Not a widget: it shows nothing. It finds the tabs, the panel and the load bars by query through
``app``: none once the app is closing, and what comes late is dropped.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rosechat.bridge import EventBuffer
from rosechat.widgets.kv_panel import KVPanel, OwnerStyle
from rosechat.widgets.loading import LoadBar
from rosechat.widgets.reply import ReplyFailed, ReplyFinished, reply_messages
from rosechat.widgets.tab import ChatTab
from rosechat.widgets.tabs import ChatTabs

if TYPE_CHECKING:
    from textual.app import App

    from engine import CacheSnapshot, SamplingParams
    from rosechat.backend import Backend

DRAIN_HZ = 30
UI_NICE = 5  # the UI thread's niceness once the engine's threads run (see lower_ui_priority)


def lower_ui_priority() -> None:
    """Linux: the calling thread (the UI's) at nice UI_NICE, once the engine's threads exist: they keep theirs,
    and so do the threads they start. On two cores the UI's ~11 % of CPU while a reply streams came out of
    the engine's second thread (a model step 4.5 -> 5.4 ms in the app; at nice 5, 4.9-5.0 ms, and the app's
    tok/s +6 %, `rosechat bench app --tabs 1 --repeats 5` twice each way); the scheduler still runs the UI
    within milliseconds (key echo p50 1.0 ms). Elsewhere, or where it is refused, nothing changes."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), UI_NICE))
    except (AttributeError, OSError):
        pass


GIL_SWITCH_S = 0.001  # the interpreter's switch interval once the engine runs (Python's default: 5 ms)


def share_the_gil() -> None:
    """For an engine in this process (an engine_factory's; the app's own runs in a child, beyond the GIL):
    a thread waiting for the GIL asks its holder to let go after GIL_SWITCH_S, not 5 ms. The engine thread
    needs the GIL between its kernels (the model's step releases it, a few milliseconds), and the UI thread
    holds it through a layout or a repaint (5-10 ms of Python while a reply streams): at 5 ms the engine
    waited out most of each one; at 1 ms more of the UI's work runs during the engine's kernels instead
    (`rosechat bench app`'s rounds under `chrt -f 10`, 5 ms and 1 ms alternated in one run on 2 cores, medians of 8:
    one tab 88 -> 93 % of the engine's tok/s, twice; four tabs 93 -> 98 %. Under the default scheduler, as a user
    runs it, the same alternation showed no difference: 86.2 against 86.7 %)."""
    sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_S))


class EngineLink:
    """The backend (once it runs, or why it never will), its event buffer, and where each event goes."""

    def __init__(self, app: App[Any], params_for: Callable[[ChatTab, int], SamplingParams]) -> None:
        self.app = app
        self.params_for = params_for  # the app's: what a tab's queued message's reply is sampled with
        self.backend: Backend | None = None  # once it runs (None again once shut down)
        self.load_error: str | None = None  # why no model could be loaded
        self.events = EventBuffer()
        self.requests: dict[str, ChatTab] = {}  # request id -> the tab it replies in (until it ends)
        self.last_snapshot: CacheSnapshot | None = None
        self._drain_posted = False  # one drain message on its way at a time, however busy the UI is

    # ------------------------------------------------------------------ the backend's life
    async def start(self, backend: Backend) -> None:
        """The backend runs: the tabs start their conversations on it, and what was typed while it
        loaded is sent, in order, a tab's first message first."""
        self.backend = backend
        lower_ui_priority()
        share_the_gil()
        for tabbed in self.app.query(ChatTabs):  # none once the app is closing
            tabbed.connect(backend)
        backend.request_snapshot()  # the panel's first map ends its loading view, shown or not
        for tab in list(self.app.query(ChatTab)):
            await self.send_queued(tab)

    async def send_queued(self, tab: ChatTab) -> None:
        """The next message queued in ``tab``, if the backend runs and the tab is not replying."""
        if self.backend is not None and (rid := await tab.send_queued(self.params_for(tab, 1))) is not None:
            self.requests[rid] = tab

    def failed(self, error: str) -> None:
        """The model did not load: the panel says why, and queued messages stay, marked not sent."""
        self.load_error = error
        self.app.query_one("#kv", KVPanel).load_failed(error)
        for tab in list(self.app.query(ChatTab)):
            tab.unsend_queued("the model did not load")
        self.app.notify(error, title="Model failed to load", severity="error", timeout=30)

    def check_ready(self) -> bool:
        """Whether a model runs; if not, say why (loading, or failed to load): the input keeps its text."""
        if self.backend is not None:
            return True
        if self.load_error is not None:
            self.app.notify(f"No model is loaded: {self.load_error}\nQuit (ctrl+q) and start with a model that "
                            "loads.", title="No model", severity="error", timeout=10)
        else:
            self.app.notify("The model is still loading…", severity="warning")
        return False

    def can_start(self, tab: ChatTab) -> bool:
        """A model runs and ``tab`` is not replying; if not, say so (the input keeps its text)."""
        if self.check_ready() and tab.generating:
            self.app.notify("This tab is still replying (escape stops it).", severity="warning")
        return self.backend is not None and not tab.generating

    async def shutdown(self) -> None:
        backend, self.backend = self.backend, None
        if backend is not None:
            # join() blocks; off the event loop so the UI can finish closing meanwhile.
            await asyncio.to_thread(backend.shutdown, 5.0)

    # ------------------------------------------------------------------ events
    def refresh(self, panel: KVPanel) -> None:
        """``panel`` is shown again: the last snapshot at once, in the tabs' current colours and
        titles, and a fresh one asked for."""
        if self.last_snapshot is not None:
            panel.show(self.last_snapshot, self.owner_styles())
        if self.backend is not None:
            self.backend.request_snapshot()

    def poll(self) -> bool:
        """Whether the app should post a drain now: something waits, and no drain is on its way."""
        if self._drain_posted or not self.events.pending:
            return False
        self._drain_posted = True
        return True

    def drain(self) -> None:
        """Route everything pushed since the last drain."""
        self._drain_posted = False
        batch = self.events.drain()
        for rid, message in reply_messages(batch):
            end = isinstance(message, (ReplyFinished, ReplyFailed))  # its last: the route ends with it
            tab = self.requests.pop(rid, None) if end else self.requests.get(rid)
            if (tab is None or not tab.post_message(message)) and isinstance(message, ReplyFailed):
                self.app.notify(message.error.message, title="Engine error", severity="error", timeout=10)
        for error in batch.engine_errors:  # no request's: the engine's own
            self.app.notify(error.message, title="Engine error", severity="error", timeout=10)
        if batch.loading:  # before the snapshot: a load quicker than a drain shows its stages too (a map ends it)
            for bar in self.app.query("#loading-bar").results(LoadBar):
                bar.show(batch.loading[-1])
            for panel in self._panels():
                for progress in batch.loading:
                    panel.show_loading(progress)
        if batch.snapshot is not None:
            self.last_snapshot = batch.snapshot
            for panel in self._panels():  # none once the app is closing: a late snapshot is dropped
                # the owners (a walk over the tabs) only for a panel shown: a hidden one gets them when shown (refresh)
                panel.show(batch.snapshot, self.owner_styles() if panel.display else None)
        if batch.server_stats is not None:
            for panel in self._panels():
                panel.show_server(batch.server_stats)

    def _panels(self) -> list[KVPanel]:
        """The KV panel (none once the app is closing, or under a dialog), found by its id: a search that
        stops at it, near the top, where a query by type walks every widget (a long chat has hundreds) at
        each snapshot, ~10 a second."""
        panel = self.app.query_one_optional("#kv", KVPanel)
        return [] if panel is None else [panel]

    def owner_styles(self) -> dict[str, OwnerStyle]:
        """How the KV panel draws each tab's blocks: its title and colour, by conversation id."""
        return {t.engine_cid: OwnerStyle(t.chat_title, t.color) for t in self.app.query(ChatTab) if t.engine_cid}
