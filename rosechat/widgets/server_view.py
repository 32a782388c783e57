"""The KV panel for a remote server that reports only numbers (vLLM, SGLang, llama.cpp's /metrics):
cache usage as a bar and a sparkline over time, prefix-cache hits, running, waiting, preemptions.
A `rosechat serve` server sends its whole block map instead, drawn by the panel's own map."""

from __future__ import annotations

from collections import deque

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Sparkline, Static

from rosechat.server_stats import ServerStats

HISTORY = 120  # readings kept for the sparkline (about two minutes of a running reply)
NO_DATA = ("This server reports no KV data. vLLM, SGLang (--enable-metrics) and llama.cpp's server "
           "(--metrics) do on /metrics; `rosechat serve` sends its whole block map.")


def usage_bar(fraction: float, width: int) -> Text:
    filled = round(max(0.0, min(1.0, fraction)) * width)
    return Text.assemble(("█" * filled, "bold #5fb3f6"), ("░" * (width - filled), "dim"))


def stats_line(s: ServerStats) -> Text:
    parts = []
    if s.prefix_hit_rate is not None:
        parts.append(f"prefix hits {100 * s.prefix_hit_rate:.1f}%")
    if s.running is not None or s.waiting is not None:
        parts.append(f"{s.running if s.running is not None else '?'} running, "
                     f"{s.waiting if s.waiting is not None else '?'} waiting")
    if s.preemptions is not None:
        parts.append(f"{s.preemptions:,} preemptions")
    return Text(" · ".join(parts) or "no cache figures", no_wrap=True, overflow="ellipsis")


class ServerView(Vertical):
    DEFAULT_CSS = """
    ServerView { height: 1fr; }
    ServerView #srv-usage, ServerView #srv-line { height: auto; }
    ServerView Sparkline { height: 1fr; min-height: 1; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.usage: deque[float] = deque(maxlen=HISTORY)
        self.last: ServerStats | None = None

    def compose(self) -> ComposeResult:
        yield Static("", id="srv-usage")
        yield Sparkline([], summary_function=max, id="srv-spark")
        yield Static("", id="srv-line")

    def show(self, stats: ServerStats) -> None:
        self.last = stats
        if stats.kv_usage is not None:
            self.usage.append(stats.kv_usage)
        if not self.is_mounted:
            return
        spark, usage = self.query_one(Sparkline), self.query_one("#srv-usage", Static)
        line = self.query_one("#srv-line", Static)
        if not stats.server:
            usage.update(NO_DATA)
            spark.display = False
            line.update("")
            return
        spark.display = bool(self.usage)
        spark.data = list(self.usage)
        if stats.kv_usage is None:
            usage.update(f"{stats.server}: no cache usage reported")
        else:
            width = max(10, (usage.size.width or 60) - 24)
            usage.update(Text.assemble(("KV cache ", "dim"), usage_bar(stats.kv_usage, width),
                                       f" {100 * stats.kv_usage:.1f}% used"))
        line.update(stats_line(stats))

    def on_mount(self) -> None:
        if self.last is not None:
            self.show(self.last)
