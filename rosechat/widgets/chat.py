"""The pieces of a chat tab: the message box, one message (Markdown, streamed) and its figures."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.geometry import Region
from textual.message import Message
from textual.strip import Strip
from textual.timer import Timer
from textual.visual import VisualType
from textual.widget import Widget
from textual.widgets import Markdown, Static, TextArea
from textual.widgets.markdown import MarkdownStream
from textual.widgets.text_area import TextAreaTheme

from rosechat.widgets.reply_markdown import LaidOutOnce, ReplyMarkdown

ROLE_LABELS = {"user": "You", "assistant": "Assistant", "system": "System"}

# A streaming reply is not redrawn for every piece of text the engine sends (30 a second): its
# text is written to the Markdown in batches, the first at once, then at most every
# REDRAW_INTERVAL seconds, and less often when redrawing is costly, so that the redraws take about
# REDRAW_SHARE of the UI thread (its CPU time since the last write / REDRAW_SHARE: all of it, typing
# and event delivery too, since a layout runs after the write, on the screen's timer), but never less
# often than every REDRAW_MAX seconds. A redraw is milliseconds of Python on a small CPU (Textual
# re-parses the reply's last block and repaints it), tens when the reply grows a line (the screen is
# laid out again, twice: see reply_markdown.py), and
# while the UI thread runs, the in-process engine waits for the GIL after each of its kernels: on a
# 2-core machine, redrawing at 30 Hz held SmolLM2-135M to ~28 tokens/s where the engine alone
# decodes ~90-100. The UI thread's CPU clock is read once per write, not per piece of text: under
# load, time.thread_time() (a system call, unlike time.monotonic()) took ~80 us on average and up to
# 5 ms on a 2-core machine, the GIL held throughout. A reply in a tab not shown keeps its text and
# writes it when the tab is shown (or the reply ends): with four tabs streaming, three redraws in
# four drew nothing anyone could see (`rosechat bench app` measures the app against the engine).
# REDRAW_SHARE was 0.25: on the AVX2 machine the app kept 73 % (1 tab) and 74 % (4 tabs) of the engine's
# tok/s; at 0.1, 78-79 % and 83 % (each redraw re-lays out the screen, ~15-25 ms of Python, and the
# UI thread's time comes straight out of the engine's two kernel threads on a 2-core machine).
# At 0.07 (a redraw that cost 10 ms of the UI thread is followed by the next after 143 ms, not 100), on the
# Intel AVX-512 machine, rounds alternated in one process: UI 0.77 -> 0.65 ms/token, app/engine 0.84 -> 0.91.
# At 0.04 (AMD Zen 5, 2 cores, the default scheduler: no chrt), alternated in one process, 12 rounds each:
# a 256-token reply at ~250 tok/s is written 3.8 times, not 6.2 (6.5 layouts, not 8.8), UI 0.79 -> 0.44 ms/token,
# app/engine 0.83 -> 0.88. A slow reply (a few words a write, no new line) costs ~2 ms a write: still 10 a second.
REDRAW_INTERVAL = 0.1
REDRAW_SHARE = 0.04
REDRAW_MAX = 0.5


class ChatInput(TextArea):
    """The message box. Enter sends; ctrl+j or alt+enter (shift+enter in terminals that report it)
    starts a new line; a multi-line paste keeps every line. No key is taken from the text typed."""

    BINDINGS = [
        # priority: TextArea itself turns enter into a newline before ordinary bindings run
        Binding("enter", "submit", "Send", show=False, priority=True),
        Binding("ctrl+j,alt+enter,shift+enter", "newline", "New line", show=False, priority=True),
    ]

    @dataclass
    class Submitted(Message):
        input: ChatInput
        value: str

    PLACEHOLDER = "Message (Enter sends, ctrl+j: new line)"
    JSON_PLACEHOLDER = "JSON mode: each reply is a JSON object (alt+j or /json: off)"

    def __init__(self, *, classes: str | None = None) -> None:
        super().__init__(soft_wrap=True, tab_behavior="focus", compact=True, classes=classes,
                         placeholder=self.PLACEHOLDER)
        self._css_theme: TextAreaTheme | None = None  # the theme object its CSS was applied to, and from what
        self._css_key: tuple[object, ...] = ()

    @property
    def value(self) -> str:
        return self.text

    @value.setter
    def value(self, text: str) -> None:
        self.load_text(text)
        self.move_cursor(self.document.end)

    def render_lines(self, crop: Region) -> list[Strip]:
        # TextArea applies its theme's CSS (~2 ms of Python) at every call, whether a line is drawn or
        # not: at each key typed, each cursor blink, and each frame whose changes touch the box's rows.
        # It is applied in render_line instead, when what it reads has changed.
        return Widget.render_lines(self, crop)

    def render_line(self, y: int) -> Strip:
        theme = self._theme
        if theme is not None:
            # What apply_css reads: the box's style, the app's theme, the component classes' CSS
            # (new objects whenever the stylesheet is applied to the box), and focus, hover, disabled
            # (private attributes of Textual 8's: where one is gone, a fresh object() makes every call apply)
            styles = getattr(self, "_component_styles", None)
            key = (self.app.current_theme.name, self.rich_style, getattr(self, "_pseudo_classes_cache_key", object()),
                   tuple(styles.values()) if isinstance(styles, dict) else object())
            if theme is not self._css_theme or key != self._css_key:
                theme.apply_css(self)
                self._css_theme, self._css_key = theme, key
        return super().render_line(y)

    def action_submit(self) -> None:
        # A priority binding runs at the app as enter arrives, ahead of the keys typed just before
        # it that still wait in this widget's queue: read the text once they are in.
        self.call_later(lambda: self.post_message(self.Submitted(self, self.text)))

    def action_newline(self) -> None:
        self.insert("\n")


_REASONS = {"length": "max tokens reached", "context": "context full", "abort": "stopped", "stopped": "stopped",
            "error": "cut short by an error"}


@dataclass(frozen=True)
class ReplyStats:
    """One reply's own figures (an alternative's, not its group's), as shown and as saved."""

    tokens: int | None = None
    ttft_s: float | None = None
    tokens_per_s: float | None = None
    finish_reason: str | None = None  # "stop", "length", "context" (the context's limit), "stopped", "error"
    guesses_kept: float | None = None  # speculative decoding: the share of its guesses that stood

    def line(self) -> str:
        parts = [] if self.tokens is None else [f"{self.tokens} tokens"]
        if self.ttft_s is not None:
            parts.append(f"TTFT {self.ttft_s:.2f} s")
        if self.tokens_per_s:
            parts.append(f"{self.tokens_per_s:.1f} tok/s")
        if self.guesses_kept is not None:
            parts.append(f"{100 * self.guesses_kept:.0f}% of guesses kept")
        if self.finish_reason in _REASONS:
            parts.append(_REASONS[self.finish_reason])
        return " · ".join(parts)


class Line(LaidOutOnce, Static):
    """A message's role, a user's text, a reply's footer: laid out again only when its height changes. A new
    footer ("generating…" to a reply's figures) is a repaint of its line, not a layout of the whole screen."""

    def update(self, content: VisualType = "", *, layout: bool = True) -> None:
        width, height = self.content_size
        super().update(content, layout=False)
        if layout:
            self._lay_out_if_resized(width, height)


class MessageView(LaidOutOnce, Vertical):
    """One message. An assistant reply may hold several alternatives; one is shown at a time."""

    def __init__(self, role: str, content: str = "", *, n: int = 1) -> None:
        super().__init__(classes=f"message -{role}")
        self.role = role
        self.texts = [content] + [""] * (n - 1)
        self.shown = 0
        self.stats: list[ReplyStats] = []  # per alternative, once finished
        self._stream: MarkdownStream | None = None
        self._unwritten = ""  # the shown alternative's text not yet written to the stream
        self._next_write = float("-inf")  # time.monotonic() when the next write is due (-inf: at once)
        self._last_write_cpu: float | None = None  # the UI thread's time.thread_time() at the last write
        self._write_timer: Timer | None = None  # writes the rest when it is due
        # The tab streams text in while the app may switch the alternative shown (two tasks):
        # each change of what is shown runs whole.
        self._lock = asyncio.Lock()

    def compose(self) -> ComposeResult:
        yield Line(ROLE_LABELS.get(self.role, self.role), classes="role")
        if self.role == "user":  # shown as typed: no Markdown
            yield Line(Text(self.texts[0]), classes="user-text")
        else:
            yield ReplyMarkdown(self.texts[0])
        yield Line("", classes="reply-footer")

    @property
    def markdown(self) -> Markdown:
        return self.query_one(Markdown)

    @property
    def text(self) -> str:
        return self.texts[self.shown]

    async def reset(self, n: int) -> None:
        """Start over for a regenerated reply with ``n`` alternatives."""
        async with self._lock:
            await self._stop_stream()
            self.texts, self.shown = [""] * n, 0
            await self.markdown.update("")
            self.set_footer("")

    async def add_delta(self, index: int, text: str) -> None:
        async with self._lock:
            while index >= len(self.texts):
                self.texts.append("")
            self.texts[index] += text
            if index == self.shown and text:
                self._unwritten += text
                if self._write_timer is None and not self._hidden():
                    if (wait := self._next_write - time.monotonic()) <= 0:
                        await self._write()
                    else:
                        self._write_timer = self.set_timer(wait, self._write_later, name="reply-redraw")

    def _hidden(self) -> bool:
        """In a tab not shown: the tabs' ContentSwitcher sets display none on the panes not shown."""
        return any(not node.display for node in self.ancestors_with_self)

    async def on_show(self) -> None:
        """Shown again (its tab chosen): the text kept meanwhile, at once."""
        async with self._lock:
            self._last_write_cpu = None  # the UI's work while it was hidden was not its redraws
            await self._write()

    async def _write_later(self) -> None:
        async with self._lock:
            self._write_timer = None
            if not self._hidden():  # hidden meanwhile: written when shown (on_show)
                await self._write()

    async def _write(self) -> None:
        """Write the text not yet shown to the Markdown stream (the lock held), and set when the next
        write is due: REDRAW_INTERVAL on, longer when the UI thread was busy since the last write."""
        if self._write_timer is not None:
            self._write_timer.stop()
            self._write_timer = None
        if not self._unwritten:
            return
        text, self._unwritten = self._unwritten, ""
        cpu = time.thread_time()
        busy = 0.0 if self._last_write_cpu is None else cpu - self._last_write_cpu
        self._next_write = time.monotonic() + min(max(REDRAW_INTERVAL, busy / REDRAW_SHARE), REDRAW_MAX)
        self._last_write_cpu = cpu
        if self._stream is None:
            self._stream = Markdown.get_stream(self.markdown)
        await self._stream.write(text)

    async def _stop_stream(self, *, write_rest: bool = False) -> None:
        """End streaming: with ``write_rest`` the text not yet written goes in first; without,
        it is dropped (the caller replaces what is shown)."""
        if write_rest:
            await self._write()
        elif self._write_timer is not None:
            self._write_timer.stop()
            self._write_timer = None
        self._unwritten, self._next_write = "", float("-inf")  # a next stream shows its first text at once
        self._last_write_cpu = None
        if self._stream is not None:
            stream, self._stream = self._stream, None
            await stream.stop()

    async def set_texts(self, texts: tuple[str, ...] | list[str]) -> None:
        """The final texts (from Finished): authoritative, in case a delta was lost or partial."""
        async with self._lock:
            await self._stop_stream(write_rest=True)  # what is shown is then self.text
            changed = list(texts) != self.texts
            self.texts = list(texts) or [""]
            self.shown = min(self.shown, len(self.texts) - 1)
            if changed:
                await self.markdown.update(self.text)

    async def show_alternative(self, index: int) -> None:
        """Show alternative ``index`` (modulo their number) and its footer: its own figures once the
        reply has finished, else which alternative streams."""
        async with self._lock:
            await self._stop_stream()
            self.shown = index % len(self.texts)
            await self.markdown.update(self.text)
        if self.stats:
            self.show_stats()
        else:
            self.set_footer(f"generating… alternative {self.shown + 1}/{len(self.texts)}")

    def show_stats(self) -> None:
        """The footer from the shown alternative's own figures (and which alternative it is)."""
        line = self.stats[self.shown].line() if self.shown < len(self.stats) else ""
        if len(self.texts) > 1:
            line += f" · alternative {self.shown + 1}/{len(self.texts)} (alt+←/→)"
        self.set_footer(line)

    def set_footer(self, text: str) -> None:
        footer = self.query_one(".reply-footer", Static)
        footer.update(text)
        footer.display = bool(text)


@dataclass
class ChatMessage:
    role: str
    content: str
    history_id: int | None = None  # row in the history store, once saved
    view: MessageView | None = field(default=None, repr=False)
    in_context: bool = True  # False: refused as longer than the context, never sent again
