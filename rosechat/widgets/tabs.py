"""The chat tabs: opening them (new, forked, saved), which one is active, and focus that follows it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual import on
from textual.widgets import TabbedContent

from rosechat.widgets.conversation import NEW_CHAT
from rosechat.widgets.kv_panel import PALETTE
from rosechat.widgets.tab import ChatTab

if TYPE_CHECKING:
    from rosechat.backend import Backend
    from rosechat.saver import Saver


class ChatTabs(TabbedContent):
    """The app picks the active tab and focus follows it, never the reverse (see
    ``ChatTab.on_descendant_focus``): a late focus request cannot switch the user back."""

    def __init__(self, saver: Saver, system_prompt: str, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.saver = saver  # the tabs save their messages through it
        self.system_prompt = system_prompt  # a new chat's (config.toml's [chat])
        self.backend: Backend | None = None  # what the tabs' conversations run on, once it runs
        self._colors = 0

    @property
    def tabs(self) -> list[ChatTab]:
        return list(self.query(ChatTab))  # in tab order

    @property
    def active_tab(self) -> ChatTab | None:
        pane = self.active_pane
        return pane if isinstance(pane, ChatTab) else None

    def next_color(self) -> str:
        """Each new tab's colour (its label, its blocks in the KV panel), in turn."""
        color = PALETTE[self._colors % len(PALETTE)]
        self._colors += 1
        return color

    async def new(
        self, title: str = NEW_CHAT, system_prompt: str | None = None, *, fork_of: ChatTab | None = None
    ) -> ChatTab:
        """Open a tab and make it the active one; its conversation starts on the backend if one runs
        (a fork's shares every KV block of ``fork_of``'s), else once it does (``connect``)."""
        prompt = self.system_prompt if system_prompt is None else system_prompt
        tab = ChatTab(title, color=self.next_color(), system_prompt=prompt, saver=self.saver)
        await self.open(tab)
        if self.backend is not None:
            tab.connect(self.backend, fork_of)
        return tab

    def connect(self, backend: Backend) -> None:
        """The backend runs: the tabs opened meanwhile start their conversations on it, as new ones will."""
        self.backend = backend
        for tab in self.tabs:
            if tab.engine_cid is None:
                tab.connect(backend)

    async def fork(self, src: ChatTab) -> ChatTab:
        """A new tab with ``src``'s conversation: the same messages, sharing its KV blocks."""
        tab = await self.new(f"{src.chat_title} (fork)", src.system_prompt, fork_of=src)
        await tab.copy_from(src)
        self.notify(f"Forked {src.chat_title!r}: the new tab shares its KV blocks.")
        return tab

    async def open_saved(self, history_id: str) -> ChatTab | None:
        """Open a saved conversation in a tab (or switch to the tab showing it). Its KV is computed on the next turn."""
        for tab in self.showing(history_id):
            self.activate(tab)
            return tab
        conv = self.saver.call(self.saver.history.load, history_id)
        if conv is None:
            return None
        tab = await self.new(conv.title, conv.system_prompt)
        await tab.load_saved(conv)
        return tab

    def showing(self, history_id: str) -> list[ChatTab]:
        """The tabs showing the saved conversation ``history_id``."""
        return [t for t in self.tabs if t.history_id == history_id]

    def retitle(self, title: str, history_id: str | None, tab: ChatTab | None = None) -> None:
        """``tab`` and every tab showing the saved conversation ``history_id`` take ``title``."""
        for t in self.tabs:
            if t is tab or (history_id is not None and t.history_id == history_id):
                t.chat_title = title  # a reactive: the tab relabels itself

    async def open(self, tab: ChatTab) -> None:
        await self.add_pane(tab)
        self.activate(tab)
        self.call_after_refresh(self.focus_active)  # once the new pane is laid out

    async def close(self, tab: ChatTab) -> None:
        tab.close()  # its reply is stopped (and kept as far as it got), its blocks freed
        await self.remove_pane(tab.id or "")
        self.focus_active()

    def activate(self, tab: ChatTab) -> None:
        self.active = tab.id or ""

    def switch(self, step: int) -> None:
        tabs, active = self.tabs, self.active_tab
        if tabs and active is not None:
            self.activate(tabs[(tabs.index(active) + step) % len(tabs)])

    def goto(self, number: int) -> None:
        """The tab numbered ``number`` (from 1), if there is one."""
        if 1 <= number <= len(tabs := self.tabs):
            self.activate(tabs[number - 1])

    def focus_active(self) -> None:
        """Focus the input of the tab active *now*. Every focus request goes through here, late
        ones included (after a refresh, a TabActivated handled after another switch), so focus
        never lands in a pane the user has left."""
        if (tab := self.active_tab) is not None:
            self.app.set_focus(tab.input)

    @on(TabbedContent.TabActivated)
    def _tab_activated(self) -> None:
        self.focus_active()  # this message may be stale: focus the tab active now
