"""The loading line: loads the model in a thread worker and shows how far it is."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from textual import work
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.markup import escape
from textual.message import Message
from textual.widgets import Label, LoadingIndicator

from rosechat.config import Config

if TYPE_CHECKING:
    from engine import LLMEngine, ModelSource


class ModelLoader(Vertical):
    """Loads weights (seconds to minutes) off the UI thread; posts ``Loaded`` or ``Failed``."""

    class Loaded(Message):
        def __init__(self, llm: LLMEngine, model: ModelSource, notice: str | None) -> None:
            super().__init__()
            self.llm, self.model, self.notice = llm, model, notice

    class Failed(Message):
        def __init__(self, error: str) -> None:
            super().__init__()
            self.error = error

    class Progress(Message, bubble=False):
        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    def __init__(
        self,
        config: Config,
        model: ModelSource | None,
        notice: str | None,
        factory: Callable[..., LLMEngine] | None,
        *,
        id: str | None = None,
    ) -> None:
        super().__init__(id=id)
        self.config = config
        self.model = model  # None: chosen from the config by the worker
        self.notice = notice  # why the demo model runs instead of the configured one
        self.factory = factory  # tests may pass one; default LLMEngine.from_pretrained
        self.finished = False

    def compose(self) -> ComposeResult:
        yield LoadingIndicator()
        name = self.model.display_name if self.model else self.config.model.name
        yield Label(f"Loading {escape(name)}…", id="loading-label")

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
        from engine import LLMEngine
        from rosechat.model_choice import ModelChoiceError, choose_model

        kwargs = self.config.engine_kwargs()
        factory = self.factory or (lambda src, progress: LLMEngine.from_pretrained(src, progress, **kwargs))
        try:
            if self.model is None:  # the command line chose it already; tests may not have
                self.model, self.notice = choose_model(self.config)
            model, name = self.model, self.model.display_name
            self._post(self.Progress(f"Loading {name}…"))
            llm = factory(model, lambda line: self._post(self.Progress(f"Loading {name}: {line}")))
        except ModelChoiceError as e:
            self._post(self.Failed(str(e)))
        except Exception as e:  # a broken checkpoint...: say so; the app stays up to say it
            self._post(self.Failed(f"{type(e).__name__}: {e}"))
        else:
            self._post(self.Loaded(llm, model, self.notice))

    def on_model_loader_progress(self, event: Progress) -> None:
        if not self.finished:
            self.query_one("#loading-label", Label).update(escape(event.text))

    def on_model_loader_loaded(self, _: Loaded) -> None:
        self.finished = True
        self.display = False

    def on_model_loader_failed(self, event: Failed) -> None:
        self.finished = True
        self.query_one(LoadingIndicator).display = False
        self.query_one("#loading-label", Label).update(escape(f"Could not load the model: {event.error}"))
