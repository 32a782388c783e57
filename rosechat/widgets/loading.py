"""Loading you can see: the model loads in a thread worker; its stages show as a progress bar.

The worker hands each ``LoadProgress`` to ``on_progress`` (the app's event buffer, the channel
the engine's own events take); the app routes the newest to the ``LoadBar`` of this line and of
the KV panel. ``Loaded`` / ``Failed`` end the load. With a remote server there is nothing to load:
``RemoteConnector`` waits, on the same line, until the server answers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from textual import work
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.markup import escape
from textual.message import Message
from textual.timer import Timer
from textual.widgets import Label, ProgressBar, Static

from rosechat.config import Config

if TYPE_CHECKING:
    from engine import EngineProcess, LLMEngine, ModelSource
    from engine.events import LoadProgress

TICK_S = 0.5  # the elapsed time ticks between stages (converting a tokenizer reports nothing for seconds)


class LoadBar(Horizontal):
    """One line: the stage and the seconds since loading began, and a bar where the stage counts steps."""

    DEFAULT_CSS = """
    LoadBar { height: 1; width: 1fr; }
    LoadBar .load-stage { width: 1fr; color: $text-muted; text-wrap: nowrap; text-overflow: ellipsis; }
    LoadBar ProgressBar { width: auto; }
    LoadBar Bar { width: 24; }
    """

    def __init__(self, title: str, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.title = title
        self.progress: LoadProgress | None = None
        self._began = time.monotonic()
        self._ended: str | None = None  # the final line, once loading is over
        self._stopped = False
        self._clock: Timer | None = None

    def compose(self) -> ComposeResult:
        yield Label(escape(f"{self.title}…"), classes="load-stage")
        yield ProgressBar(total=None, show_eta=False)

    def on_mount(self) -> None:
        if self._stopped:  # stopped before it was mounted
            self.query(ProgressBar).remove()
        else:
            self._clock = self.set_interval(TICK_S, self._tick, name="load-clock")
        self._draw()

    @property
    def text(self) -> str:
        if self._ended is not None:
            return self._ended
        p, elapsed = self.progress, time.monotonic() - self._began
        if p is None:
            return f"{self.title}: starting… {elapsed:.0f} s"
        count = f" {p.done}/{p.total}" if p.total else ""
        return f"{self.title}: {p.stage}{count} · {elapsed:.0f} s"

    def show(self, progress: LoadProgress) -> None:
        if self._ended is not None:  # a report drained after the end: the end stays said
            return
        self.progress, self._began = progress, time.monotonic() - progress.elapsed_s
        if self.is_mounted:  # else on_mount draws it (a report may come before the bar is composed)
            self._draw()

    def stop(self) -> None:
        """No more reports: the clock stops, and the bar goes (an indeterminate one redraws 15 times a second)."""
        self._stopped = True
        if self._clock is not None:
            self._clock.stop()
        if self.is_mounted:
            self.query(ProgressBar).remove()

    def end(self, text: str) -> None:
        """Loading failed: the line says so, and stops."""
        self._ended = text
        self.stop()
        if self.is_mounted:
            self._tick()

    def _draw(self) -> None:
        if (p := self.progress) is not None:
            for bar in self.query(ProgressBar):
                bar.update(total=p.total or None, progress=p.done)
        self._tick()

    def _tick(self) -> None:
        # a query, not query_one: a report can come while the line is being removed (its label gone first)
        for label in self.query(".load-stage").results(Label):
            label.update(escape(self.text))


class StageLog(Static):
    """The stages so far, each with how long it took: the KV panel's view of a load."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__("", id=id)
        self.stages: list[tuple[str, float]] = []  # (stage, seconds since loading began when it started)

    def add(self, progress: LoadProgress) -> None:
        if not self.stages or self.stages[-1][0] != progress.stage:
            self.stages.append((progress.stage, progress.elapsed_s))
            lines = [f"✓ {stage:<44} {end - start:5.1f} s"
                     for (stage, start), (_, end) in zip(self.stages, self.stages[1:])]
            self.update(escape("\n".join(lines)))


class ModelLoader(Vertical):
    """Loads weights (seconds to minutes) off the UI thread; posts ``Loaded`` or ``Failed``.

    By default the model loads and runs in an ``EngineProcess`` (a child: the engine does not share the UI's
    GIL); a factory (tests pass one) builds an ``LLMEngine`` in this process instead."""

    class Loaded(Message):
        def __init__(self, engine: LLMEngine | EngineProcess, model: ModelSource, notice: str | None) -> None:
            super().__init__()
            self.engine, self.model, self.notice = engine, model, notice

    class Failed(Message):
        def __init__(self, error: str) -> None:
            super().__init__()
            self.error = error

    def __init__(
        self,
        config: Config,
        model: ModelSource | None,
        notice: str | None,
        factory: Callable[..., LLMEngine] | None,
        on_progress: Callable[[LoadProgress], None],
        *,
        id: str | None = None,
    ) -> None:
        super().__init__(id=id)
        self.config = config
        self.model = model  # None: chosen from the config by the worker
        self.notice = notice  # why the demo model runs instead of the configured one
        self.factory = factory  # tests may pass one (an LLMEngine here); default an EngineProcess
        self.on_progress = on_progress  # thread-safe, never blocks (the app's EventBuffer.push)
        self.finished = False
        self._process: EngineProcess | None = None  # until the app takes it (ended if the app closes first)
        self._closed = False

    def compose(self) -> ComposeResult:
        yield LoadBar(self.model.display_name if self.model else self.config.model.name, id="loading-bar")

    def on_mount(self) -> None:
        self.load()

    def _post(self, message: Message) -> None:
        """From the loader thread: never blocks on the UI, so a closing app cannot hang it."""
        try:
            self.post_message(message)
        except RuntimeError:  # the event loop is closed: the app has gone
            pass

    @work(thread=True, exclusive=True, group="engine", exit_on_error=False)
    def load(self) -> None:
        from engine import EngineLoadError, EngineProcess
        from rosechat.model_choice import ModelChoiceError, choose_model

        try:
            if self.model is None:  # the command line chose it already; tests may not have
                self.model, self.notice = choose_model(self.config)
            model = self.model
            if self._closed:  # the app closed meanwhile: start nothing
                return
            if self.factory is not None:
                engine: LLMEngine | EngineProcess = self.factory(model, self.on_progress)
            else:
                self._process = EngineProcess(model, self.config.engine_kwargs(), self.on_progress)
                engine = self._process.start()  # the child's load error: EngineLoadError, said as it is
        except (ModelChoiceError, EngineLoadError) as e:
            self._post(self.Failed(str(e)))
        except Exception as e:  # a broken checkpoint...: say so; the app stays up to say it
            self._post(self.Failed(f"{type(e).__name__}: {e}"))
        else:
            self._post(self.Loaded(engine, model, self.notice))

    def take(self) -> None:
        """The app has the engine: unmounting no longer ends it."""
        self._process = None

    def on_unmount(self) -> None:
        self._closed = True
        if self._process is not None:  # the app closes before it took the engine (loading, or just loaded)
            self._process.cancel()

    def on_model_loader_loaded(self, _: Loaded) -> None:
        self.finished = True  # the app takes the engine, then removes this (its clock and bar with it)

    def on_model_loader_failed(self, event: Failed) -> None:
        self.finished = True
        self.query_one(LoadBar).end(f"Could not load the model: {event.error}")


class RemoteConnector(Vertical):
    """Waits off the UI thread until the remote server answers (it may be down, or loading its
    model), saying so each second on its bar; posts ``Reachable`` then. Messages typed meanwhile
    queue. A failure later on (the server went away) shows in the tab that meets it."""

    class Reachable(Message):
        """The remote server answers: its backend can start."""

    def __init__(self, config: Config, on_progress: Callable[[LoadProgress], None], *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.config = config
        self.on_progress = on_progress  # thread-safe, never blocks (the app's EventBuffer.push)
        self._stop = threading.Event()  # wakes the connect loop when the app closes

    def compose(self) -> ComposeResult:
        yield LoadBar(f"Connecting to {self.config.remote.url}", id="loading-bar")

    def on_mount(self) -> None:
        self.connect()

    def on_unmount(self) -> None:
        self._stop.set()

    @work(thread=True, exclusive=True, group="engine", exit_on_error=False)
    def connect(self) -> None:
        from engine.events import LoadProgress
        from rosechat.remote import unreachable

        r, began = self.config.remote, time.monotonic()
        for attempt in range(1, 1 << 62):
            if (why := unreachable(r.url, self.config.remote_api_key(), r.connect_timeout)) is None:
                self.post_message(self.Reachable())
                return
            self.on_progress(LoadProgress(f"{why}; retrying", attempt, 0, time.monotonic() - began))
            if self._stop.wait(1.0):
                return
