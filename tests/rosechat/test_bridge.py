"""EventBuffer: the engine thread pushes, the UI drains one coalesced batch."""

from __future__ import annotations

import threading

from engine.events import CacheSnapshot, EngineError, Finished, TokenDelta, Usage
from rosechat.bridge import EventBuffer


def snap(t: float) -> CacheSnapshot:
    return CacheSnapshot(num_blocks=1, block_size=16, state=(0,), refcount=(0,), owners=((),), time=t)


def test_drain_coalesces_deltas_and_keeps_the_latest_snapshot() -> None:
    buf = EventBuffer()
    assert not buf.pending and not buf.drain()
    buf.push(TokenDelta("r1", "c1", 0, "Hel"))
    buf.push(snap(1.0))
    buf.push(TokenDelta("r2", "c2", 1, "x"))
    buf.push(TokenDelta("r1", "c1", 0, "lo"))
    buf.push(TokenDelta("r2", "c2", 0, "y"))
    fin = Finished("r1", "c1", ("Hello",), ("stop",), Usage(3, 3, 2), 0.1, 0.2, 10.0)
    buf.push(fin)
    err = EngineError("r3", "c3", "boom")
    buf.push(err)
    buf.push(snap(2.0))
    assert buf.pending
    batch = buf.drain()
    assert batch.deltas == {("r1", 0): "Hello", ("r2", 1): "x", ("r2", 0): "y"}
    assert list(batch.deltas) == [("r1", 0), ("r2", 1), ("r2", 0)]  # order of first arrival
    assert batch.ends == [fin, err]
    assert batch.snapshot.time == 2.0
    assert not buf.pending and not buf.drain()


def test_concurrent_pushes_lose_nothing() -> None:
    buf = EventBuffer()
    drained: list[str] = []
    done = threading.Event()

    def producer() -> None:
        for i in range(5000):
            buf.push(TokenDelta("r", "c", 0, str(i % 10)))
        done.set()

    t = threading.Thread(target=producer)
    t.start()
    while not done.is_set() or buf.pending:
        drained.append(buf.drain().deltas.get(("r", 0), ""))
    t.join()
    assert "".join(drained) == "".join(str(i % 10) for i in range(5000))
