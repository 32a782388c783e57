"""Hand-off from the engine thread to the UI thread.

The engine calls ``EventBuffer.push`` on its own thread for every event; that must never block,
so it only appends to a lock-protected list. The UI drains the buffer on a timer (~30 Hz; at once
as a reply ends, ``on_end``) and gets one coalesced ``Batch``: the text deltas of each (request,
sample) joined into one string, every ``Finished``/``EngineError`` in order, and only the newest
``CacheSnapshot`` (with the speculation marks of those it replaces, CacheSnapshot.after). A burst of
hundreds of tokens therefore costs the UI one update per reply per frame, not one message per token.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.events import (
    CacheSnapshot,
    EngineError,
    Event,
    Finished,
    LoadProgress,
    TokenDelta,
    TurnPreempted,
    TurnStarted,
)
from rosechat.server_stats import ServerStats


@dataclass
class Batch:
    # Apply in field order: a request's TurnStarted precedes its deltas, which precede its end.
    starts: list[TurnStarted] = field(default_factory=list)
    # (request id, sample index) -> text, in order of first arrival.
    deltas: dict[tuple[str, int], str] = field(default_factory=dict)
    preempted: dict[str, bool] = field(default_factory=dict)  # request id -> waiting for KV memory (latest)
    ends: list[Finished | EngineError] = field(default_factory=list)
    snapshot: CacheSnapshot | None = None
    server_stats: ServerStats | None = None  # a remote server's KV figures (newest)
    # how far the model's load is: the last report of each stage, in order (the newest last)
    loading: list[LoadProgress] = field(default_factory=list)

    @property
    def engine_errors(self) -> list[EngineError]:
        """Errors of no request (the engine's own)."""
        return [e for e in self.ends if isinstance(e, EngineError) and e.request_id is None]

    def __bool__(self) -> bool:
        return bool(self.starts or self.deltas or self.preempted or self.ends or self.snapshot is not None
                    or self.server_stats is not None or bool(self.loading))


class EventBuffer:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[Event] = []
        # Called (on the pushing thread, must not block) once a reply has ended and the engine thread has
        # pushed the cache snapshot that follows it: the UI drains then, not at its next tick (up to 1/30 s
        # later, the reply shown as still generating meanwhile). Not at the end itself: the snapshot taken
        # right after it would come in a later drain, and replace what the panel showed once the reply was done.
        self.on_end: Callable[[], None] | None = None
        self._ended = False  # a reply's end was pushed since the last drain, and no snapshot after it

    def push(self, event: Event | ServerStats | LoadProgress) -> None:
        """Engine thread: O(1), no allocation beyond the list slot."""
        wake = False
        with self._lock:
            self._events.append(event)
            if isinstance(event, (Finished, EngineError)):
                self._ended = True
            elif isinstance(event, CacheSnapshot):
                wake, self._ended = self._ended, False
        if wake and self.on_end is not None:
            self.on_end()

    @property
    def pending(self) -> bool:
        return bool(self._events)  # a racy read is fine: the next poll sees what it missed

    def drain(self) -> Batch:
        """UI thread: everything pushed since the last drain, coalesced."""
        with self._lock:
            events, self._events, self._ended = self._events, [], False
        batch = Batch()
        for event in events:
            if isinstance(event, TokenDelta):
                key = (event.request_id, event.index)
                batch.deltas[key] = batch.deltas.get(key, "") + event.text
            elif isinstance(event, TurnStarted):
                batch.starts.append(event)
            elif isinstance(event, TurnPreempted):
                batch.preempted[event.request_id] = event.waiting
            elif isinstance(event, CacheSnapshot):  # the newest, with what speculation did since the last drawn
                batch.snapshot = event if batch.snapshot is None else event.after(batch.snapshot)
            elif isinstance(event, (Finished, EngineError)):
                batch.ends.append(event)
            elif isinstance(event, ServerStats):
                batch.server_stats = event
            elif isinstance(event, LoadProgress):
                if batch.loading and batch.loading[-1].stage == event.stage:
                    batch.loading[-1] = event
                else:
                    batch.loading.append(event)
        return batch
