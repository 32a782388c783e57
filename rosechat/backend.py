"""What the app talks to: a backend that runs conversations and reports events.

The app's own is an ``EngineProcess`` (the engine thread in a child process: engine/engine_process.py);
an ``EngineThread`` in this process is one too (a test's engine_factory); ``RemoteBackend``, a client of any
OpenAI-compatible server, is another (it also reports ``ServerStats``, a server's KV figures). Tabs see
only this interface, never which backend it is. Commands may be called from the UI thread and return at
once; results come back as engine events (``TurnStarted``, ``TokenDelta``,
``TurnPreempted``, ``Finished``, ``EngineError``, ``CacheSnapshot``) through the callback the
backend was built with.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine import LLMEngine, SamplingParams
    from engine.events import Event
    from rosechat.config import Config
    from rosechat.server_stats import ServerStats


class Backend(Protocol):
    def new_conversation(self, cache_salt: str | None = None) -> str:
        """A conversation id, usable at once; `cache_salt`: its cached KV is shared only with conversations
        of the same salt (vLLM's field; the app never sets one, `serve` passes its clients')."""
        ...

    def fork_conversation(self, conversation_id: str) -> str: ...

    def drop_conversation(self, conversation_id: str) -> None: ...

    def submit_turn(self, conversation_id: str, messages: list[dict[str, str]], params: SamplingParams) -> str:
        """Start a reply to ``messages`` (the whole conversation); returns its request id."""
        ...

    def abort(self, request_id: str) -> None: ...

    def request_snapshot(self) -> None: ...

    def shutdown(self, timeout: float = 5.0) -> None: ...


def local_backend(llm: LLMEngine, on_event: Callable[[Event], None]) -> Backend:
    """The engine in this process, on its own thread (started)."""
    from engine import EngineThread

    thread = EngineThread(llm, on_event)
    thread.start()
    return thread


def remote_backend(config: Config, on_event: Callable[[Event | ServerStats], None]) -> Backend:
    """An OpenAI-compatible server (config.remote), through the official client (started)."""
    from rosechat.remote import RemoteBackend

    r = config.remote
    backend = RemoteBackend(r.url, on_event, api_key=config.remote_api_key(), model=r.model or None,
                            timeout=r.timeout, connect_timeout=r.connect_timeout,
                            send=config.sampling_sent_to_remote())
    backend.start()
    return backend
