"""The chat tabs: which one is active, and focus that follows it."""

from __future__ import annotations

from textual import on
from textual.widgets import TabbedContent

from rosechat.widgets.kv_panel import PALETTE
from rosechat.widgets.tab import ChatTab


class ChatTabs(TabbedContent):
    """The app picks the active tab and focus follows it, never the reverse (see
    ``ChatTab.on_descendant_focus``): a late focus request cannot switch the user back."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
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
