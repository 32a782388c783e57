"""The KV-cache panel: every physical block as a cell, coloured by the tab that holds it.

It renders ``CacheSnapshot`` values only and never touches the engine. The map uses Textual's line
API: a snapshot is turned into one ``Strip`` per row once (runs of equal style merged into one
segment), so ~10 updates a second over a few thousand blocks stay cheap.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.message import Message
from textual.strip import Strip
from textual.widget import Widget
from textual.widgets import Static

from engine.events import CacheSnapshot, LoadProgress
from rosechat.server_stats import ServerStats
from rosechat.widgets.kv_cells import (
    CACHED_GLYPHS,
    GUESS_STYLE,
    K_CACHED,
    K_FREE,
    K_GUESS,
    K_NULL,
    K_RETURNED,
    K_SHARED,
    K_USED,
    PALETTE,
    RETURNED_STYLE,
    USED_GLYPHS,
    Cell,
    OwnerStyle,
    glyph,
    group_cells,
    owner_color,
)
from rosechat.widgets.loading import LoadBar, StageLog
from rosechat.widgets.server_view import ServerView

CELL_WIDTH = 2  # one glyph and a gap, so neighbouring blocks stay distinguishable


class BlockMap(Widget):
    """The grid of cells. Sized by its container; folds blocks into cells when the pool is larger."""

    DEFAULT_CSS = """
    BlockMap { width: 1fr; height: 1fr; }
    """

    class Resized(Message):
        """Its size changed: the panel's "1 cell = N blocks" follows."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.snapshot: CacheSnapshot | None = None
        self.owner_styles: Mapping[str, OwnerStyle] = {}
        self.blocks_per_cell = 1
        self.cells: list[Cell] = []
        self._strips: list[Strip] | None = None

    @property
    def capacity(self) -> int:
        return max(1, self.size.width // CELL_WIDTH) * max(1, self.size.height)

    def show(self, snapshot: CacheSnapshot, owner_styles: Mapping[str, OwnerStyle]) -> None:
        self.snapshot = snapshot
        self.owner_styles = owner_styles
        self._strips = None
        self.refresh()

    def on_resize(self) -> None:
        self._strips = None
        self.post_message(self.Resized())

    def color_of(self, owner: str | None) -> str:
        if owner is None:
            return "#888888"
        style = self.owner_styles.get(owner)
        return style.color if style else owner_color(owner)

    def _cell_segment(self, cell: Cell, base: Style) -> tuple[str, Style]:
        if cell.kind == K_GUESS:
            return "?", base + GUESS_STYLE
        if cell.kind == K_RETURNED:
            return "↩", base + RETURNED_STYLE
        if cell.kind == K_SHARED:
            digit = str(cell.refcount) if cell.refcount < 10 else "+"
            return digit, base + Style(color="#000000", bgcolor=self.color_of(cell.owner), bold=True)
        if cell.kind == K_USED:
            return glyph(USED_GLYPHS, cell.group), base + Style(color=self.color_of(cell.owner))
        if cell.kind == K_CACHED:
            return glyph(CACHED_GLYPHS, cell.group), base + Style(color="#7f8491")
        if cell.kind == K_NULL:
            return "×", base + Style(color="#4b5060")
        return "·", base + Style(color="#4b5060")

    def _build(self) -> list[Strip]:
        if self.snapshot is None or self.size.width < CELL_WIDTH:
            return []
        self.blocks_per_cell, self.cells = group_cells(self.snapshot, self.capacity)
        base = self.rich_style
        columns = max(1, self.size.width // CELL_WIDTH)
        strips = []
        for row_start in range(0, len(self.cells), columns):
            pieces: list[tuple[str, Style]] = []
            for cell in self.cells[row_start : row_start + columns]:
                pieces.append(self._cell_segment(cell, base))
                pieces.append((" ", base))
            strips.append(Strip(_merge(pieces)).adjust_cell_length(self.size.width, base))
        return strips

    def render_line(self, y: int) -> Strip:
        if self._strips is None:
            self._strips = self._build()
        if y < len(self._strips):
            return self._strips[y]
        return Strip.blank(self.size.width, self.rich_style)


def _merge(pieces: list[tuple[str, Style]]) -> list[Segment]:
    """Runs of equal style become one segment: a row is a handful of segments, not hundreds."""
    segments: list[Segment] = []
    text, style = "", None
    for piece, piece_style in pieces:
        if piece_style == style:
            text += piece
        else:
            if text:
                segments.append(Segment(text, style))
            text, style = piece, piece_style
    if text:
        segments.append(Segment(text, style))
    return segments


def _fmt_int(n: int) -> str:
    return f"{n:,}"


def stats_text(snapshot: CacheSnapshot, blocks_per_cell: int = 1, compact: bool = False) -> Text:
    """The numbers beside the map, label / value rows (`compact`: 7 rows, for short terminals)."""
    s = snapshot
    used = s.used_blocks
    if compact:
        rows = [
            ("used", f"{_fmt_int(used)}/{_fmt_int(s.num_blocks)} ({100 * used / max(1, s.num_blocks):.0f}%) "
                     f"of {s.block_size} tok"),
            ("cached", f"{_fmt_int(s.cached_blocks)}  free {_fmt_int(s.free_blocks)}"),
            ("shared", f"{_fmt_int(s.shared_blocks)}  saved {_fmt_int(s.blocks_saved)}"),
            ("prefix hits", f"{100 * s.hit_rate:.1f}% ({s.prefix_cache_hits:,} tok)"),
            ("CoW", f"{_fmt_int(s.cow_copies)}  preempt {_fmt_int(s.preemptions)}"),
            ("seqs", f"{s.num_running} run, {s.num_waiting} wait · {s.tokens_per_s:.0f} tok/s"),
        ]
    else:
        rows = _full_rows(s, used)
    if s.spec_draft_tokens and not compact:  # speculation on: how much of it stands
        rows.append(("guesses", f"{100 * s.spec_accepted_tokens / s.spec_draft_tokens:.0f}% kept "
                     f"({(s.spec_accepted_tokens + s.spec_drafts) / max(1, s.spec_drafts):.1f} tok/check)"))
    text = Text(no_wrap=True, overflow="ellipsis")
    for label, value in rows:
        text.append(f"{label:<12}", style="dim")
        text.append(value + "\n")
    text.append(f"1 cell = {blocks_per_cell} block{'s' if blocks_per_cell != 1 else ''}", style="italic dim")
    return text


def _full_rows(s: CacheSnapshot, used: int) -> list[tuple[str, str]]:
    return [
        ("blocks used", f"{_fmt_int(used)} / {_fmt_int(s.num_blocks)} ({100 * used / max(1, s.num_blocks):.0f}%)"),
        ("block size", f"{s.block_size} tokens"),
        ("cached", f"{_fmt_int(s.cached_blocks)}  free {_fmt_int(s.free_blocks)}"),
        ("shared", f"{_fmt_int(s.shared_blocks)} blocks"),
        ("saved", f"{_fmt_int(s.blocks_saved)} blocks by sharing"),
        ("prefix hits", f"{100 * s.hit_rate:.1f}% ({s.prefix_cache_hits:,}/{s.prefix_cache_queries:,} tok)"),
        ("CoW copies", _fmt_int(s.cow_copies)),
        ("preemptions", _fmt_int(s.preemptions)),
        ("seqs", f"{s.num_running} running, {s.num_waiting} waiting"),
        ("tokens/s", f"{s.tokens_per_s:.1f}"),
    ] + ([("groups", groups_line(s))] if len(s.group_names) > 1 else [])


def groups_line(s: CacheSnapshot) -> str:
    """The blocks each KV cache group holds, e.g. "█ full 43 · ▓ window 8: 3"."""
    return " · ".join(f"{glyph(USED_GLYPHS, g)} {name}{':' if ' ' in name else ''} {n}"
                      for g, (name, n) in enumerate(zip(s.group_names, s.group_blocks())))


def legend_text(snapshot: CacheSnapshot, owner_styles: Mapping[str, OwnerStyle], width: int = 80) -> Text:
    """The block kinds, then an entry per holder present (deduplicated by label; "{}" marks one whose reply is
    held to a grammar: JSON mode, a schema), wrapped between entries."""
    present: dict[str, str] = {}  # label -> colour, in order of first appearance
    constrained = set(snapshot.constrained)
    for holders in snapshot.owners:
        for owner in holders:
            style = owner_styles.get(owner)
            label, color = (style.label, style.color) if style else (owner[:10], owner_color(owner))
            present.setdefault(label + (" {}" if owner in constrained else ""), color)
    entries = [
        Text.assemble(("2", "bold #000000 on #bbbbbb"), " shared (refcount)"),
        Text.assemble(("▒", "#7f8491"), " cached"),
        Text.assemble(("·", "#4b5060"), " free"),
    ]
    if len(snapshot.group_names) > 1:  # sliding-window layers: each group's glyph, the null block's
        entries += [Text.assemble((glyph(USED_GLYPHS, g), "#bbbbbb"), f" {name}")
                    for g, name in enumerate(snapshot.group_names)]
        entries.append(Text.assemble(("×", "#4b5060"), " null"))
    if snapshot.spec_draft_tokens:  # speculation ran: its blocks, as the steps since the last snapshot left them
        entries += [Text.assemble(("?", GUESS_STYLE), " guesses"), Text.assemble(("↩", RETURNED_STYLE), " rolled back")]
    entries += [Text.assemble(("█", color), f" {label}") for label, color in present.items()]
    text = Text(no_wrap=True, overflow="ellipsis")
    line_length = 0
    for entry in entries:
        if line_length and line_length + 2 + entry.cell_len > width:
            text.append("\n")
            line_length = 0
        elif line_length:
            text.append("  ")
            line_length += 2
        text.append_text(entry)
        line_length += entry.cell_len
    return text


class KVStats(Widget):
    """The numbers beside the map: the full list where its 11 rows fit, else the compact 7. Chosen
    as it renders, from its own size, so no redraw can race the layout."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.snapshot: CacheSnapshot | None = None
        self.blocks_per_cell = 1

    def show(self, snapshot: CacheSnapshot, blocks_per_cell: int) -> None:
        self.snapshot, self.blocks_per_cell = snapshot, blocks_per_cell
        self.refresh()

    def render(self) -> Text:
        if self.snapshot is None:
            return Text("waiting for the engine…")
        return stats_text(self.snapshot, self.blocks_per_cell, compact=0 < self.size.height < 11)


class KVPanel(Widget):
    """Map on the left, numbers and legend on the right. Feed it with ``show(snapshot, owners)``."""

    DEFAULT_CSS = """
    KVPanel {
        height: 14;
        border: round $primary;
        border-title-color: $text;
        padding: 0 1;
    }
    KVPanel > Horizontal { height: 1fr; }
    KVPanel #kv-loading { height: 1fr; }
    KVPanel #kv-stages { height: 1fr; color: $text-muted; }
    KVPanel #kv-left { width: 1fr; height: 1fr; }
    KVPanel #kv-legend { height: auto; max-height: 3; }
    KVPanel #kv-stats { width: 36; height: 1fr; padding-left: 1; }
    """

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.snapshot: CacheSnapshot | None = None
        self.owner_styles: dict[str, OwnerStyle] = {}
        self.border_title = "KV cache"
        self._early_loading: list[LoadProgress] = []

    def compose(self) -> ComposeResult:
        loading = Vertical(id="kv-loading")
        loading.display = False  # until a load reports (no space taken meanwhile)
        with loading:
            yield LoadBar("Loading the model", id="kv-load-bar")
            yield StageLog(id="kv-stages")
        with Horizontal(id="kv-main"):
            with Vertical(id="kv-left"):
                yield BlockMap(id="kv-map")
                yield Static("", id="kv-legend")
            yield KVStats(id="kv-stats")
        yield ServerView(id="kv-server")

    def on_mount(self) -> None:
        self.query_one(ServerView).display = False
        for progress in self._early_loading:
            self.show_loading(progress)
        self._early_loading.clear()

    def _only(self, view: str) -> None:
        """Show one of the panel's views: the load, the block map or a remote server's figures. The
        load's stops for good once another shows (its clock and bar)."""
        for widget in self.query("#kv-loading, #kv-main, #kv-server"):
            widget.display = f"#{widget.id}" == view
        if view != "#kv-loading":
            for bar in self.query(LoadBar):
                bar.stop()

    def show_loading(self, progress: LoadProgress) -> None:
        """A stage of the model's load (until the engine's first snapshot)."""
        if not self.is_mounted:  # reports can come before the panel is composed: drawn on mount
            self._early_loading.append(progress)
        elif self.snapshot is None:
            self._only("#kv-loading")
            # queries, not query_one: at exit the panel's children go before it does
            for bar in self.query(LoadBar):
                bar.show(progress)
            for log in self.query(StageLog):
                log.add(progress)

    def load_failed(self, error: str) -> None:
        for bar in self.query(LoadBar):
            bar.end(f"Could not load the model: {error}")

    def show_server(self, stats: ServerStats) -> None:
        """A remote server's figures instead of the block map (it sends no map)."""
        self._only("#kv-server")
        for view in self.query(ServerView):
            view.show(stats)

    def show(self, snapshot: CacheSnapshot, owners: Mapping[str, OwnerStyle] | None = None) -> None:
        if self.snapshot is None and self.is_mounted:
            self._only("#kv-main")
        self.snapshot = snapshot
        if owners is not None:
            self.owner_styles = dict(owners)
        if not self.is_mounted or not self.display:
            return  # drawn when shown again (see on_show)
        self._draw()

    def on_show(self) -> None:
        if self.snapshot is not None:
            self._draw()

    def _draw(self) -> None:
        assert self.snapshot is not None
        try:
            block_map, stats = self.query_one(BlockMap), self.query_one(KVStats)
            legend = self.query_one("#kv-legend", Static)
        except NoMatches:  # being removed: at exit its children go first
            return
        block_map.show(self.snapshot, self.owner_styles)
        # The fold factor depends on the map's size, known once laid out; before that assume 1.
        per_cell = math.ceil(self.snapshot.num_blocks / block_map.capacity) if block_map.size.area else 1
        stats.show(self.snapshot, max(1, per_cell))
        width = legend.size.width or block_map.size.width or 80
        legend.update(legend_text(self.snapshot, self.owner_styles, width))

    def on_resize(self) -> None:
        if self.snapshot is not None:
            self.call_after_refresh(self._draw)

    def on_block_map_resized(self) -> None:
        if self.snapshot is not None and self.display:
            self._draw()


__all__ = ["BlockMap", "Cell", "K_CACHED", "K_FREE", "K_GUESS", "K_NULL", "K_RETURNED", "K_SHARED", "K_USED",
           "KVPanel", "KVStats", "OwnerStyle", "PALETTE", "group_cells", "groups_line", "legend_text", "owner_color",
           "stats_text"]
