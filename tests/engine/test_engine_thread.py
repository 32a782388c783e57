"""EngineThread without any UI: concurrency, abort, fork while busy, shutdown, failure isolation."""

from __future__ import annotations

import threading
import time

import pytest

from engine import (
    CacheSnapshot,
    EngineError,
    EngineThread,
    Finished,
    LLMEngine,
    SamplingParams,
    TokenDelta,
    TurnPreempted,
    TurnStarted,
)
from tests.helpers import make_tiny_model


class Recorder:
    def __init__(self) -> None:
        self.events: list = []
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)

    def __call__(self, event) -> None:
        with self.cond:
            self.events.append(event)
            self.cond.notify_all()

    def of(self, kind, request_id: str | None = None) -> list:
        with self.lock:
            matches = [e for e in self.events if isinstance(e, kind)]
            return [e for e in matches if request_id is None or e.request_id == request_id]

    def wait(self, predicate, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not predicate():
                left = deadline - time.monotonic()
                assert left > 0, "timed out waiting for engine events"
                self.cond.wait(left)

    def finished(self, rid: str) -> Finished | EngineError | None:
        done = [e for e in self.events if isinstance(e, Finished | EngineError) and e.request_id == rid]
        return done[0] if done else None

    def wait_done(self, *rids: str) -> None:
        self.wait(lambda: all(self.finished(r) for r in rids))

    def text(self, rid: str, index: int = 0) -> str:
        return "".join(e.text for e in self.of(TokenDelta, rid) if e.index == index)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("thread") / "m", "llama", max_position_embeddings=1024))


@pytest.fixture
def running(model_dir: str):
    rec = Recorder()
    eng = LLMEngine.from_pretrained(model_dir, block_size=8, num_blocks=256)
    et = EngineThread(eng, rec)
    et.start()
    yield eng, et, rec
    et.shutdown()
    assert not et.is_alive


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]


def test_concurrent_submits_from_several_threads(running) -> None:
    eng, et, rec = running
    rids: list[str] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        cid = et.new_conversation()
        rid = et.submit_turn(cid, chat(f"hello number {i}"), SamplingParams(max_tokens=16, ignore_eos=True))
        with lock:
            rids.append(rid)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rec.wait_done(*rids)
    for rid in rids:
        done = rec.finished(rid)
        assert isinstance(done, Finished) and done.usage.completion_tokens == 16
        assert rec.text(rid) == done.texts[0]  # the streamed deltas add up to the final text
    assert rec.of(CacheSnapshot)


def test_abort_mid_stream_frees_the_blocks(running) -> None:
    eng, et, rec = running
    rid = et.submit_turn(et.new_conversation(), chat("go on"), SamplingParams(max_tokens=400, ignore_eos=True))
    rec.wait(lambda: len(rec.of(TokenDelta, rid)) >= 3)
    et.abort(rid)
    rec.wait_done(rid)
    done = rec.finished(rid)
    assert isinstance(done, Finished) and done.finish_reasons == ("abort",)
    assert done.usage.completion_tokens < 400
    # Aborted in a conversation: its blocks stay parked for the next turn, until the tab closes.
    cid = done.conversation_id
    busy = et.submit_turn(et.new_conversation(), chat("again"), SamplingParams(max_tokens=400, ignore_eos=True))
    rec.wait(lambda: rec.of(TokenDelta, busy))
    et.drop_conversation(cid)
    et.drop_conversation(rec.of(TokenDelta, busy)[0].conversation_id)  # dropped while generating
    et.request_snapshot()
    rec.wait(lambda: any(cid not in {o for owners in s.owners for o in owners} and s.used_blocks == 0
                         for s in rec.of(CacheSnapshot)))
    assert not et._request_conv and not eng.has_unfinished_requests()


def test_fork_while_another_conversation_generates(running) -> None:
    eng, et, rec = running
    a = et.new_conversation()
    first = et.submit_turn(a, chat("first"), SamplingParams(max_tokens=8, ignore_eos=True))
    rec.wait_done(first)
    b = et.new_conversation()
    busy = et.submit_turn(b, chat("keep talking"), SamplingParams(max_tokens=120, ignore_eos=True))
    rec.wait(lambda: len(rec.of(TokenDelta, busy)) >= 2)
    fork = et.fork_conversation(a)
    et.request_snapshot()
    # The fork shares a's blocks while b keeps generating.
    rec.wait(lambda: any(any({a, fork} <= set(o) for o in s.owners) for s in rec.of(CacheSnapshot)))
    history = chat("first") + [{"role": "assistant", "content": rec.finished(first).texts[0]}]
    on_fork = et.submit_turn(fork, history + [{"role": "user", "content": "and?"}], SamplingParams(max_tokens=4))
    rec.wait_done(busy, on_fork)
    assert isinstance(rec.finished(busy), Finished) and rec.finished(busy).usage.completion_tokens == 120
    fork_turn = rec.finished(on_fork)
    assert isinstance(fork_turn, Finished)
    assert fork_turn.usage.prefilled_tokens < fork_turn.usage.prompt_tokens // 2  # reused a's KV


def test_shutdown_while_busy_is_prompt(model_dir: str) -> None:
    rec = Recorder()
    eng = LLMEngine.from_pretrained(model_dir, block_size=8, num_blocks=256)
    steps = []
    step = eng.step
    eng.step = lambda: steps.append(None) or step()  # count the steps the thread runs
    et = EngineThread(eng, rec)
    et.start()
    rids = [et.submit_turn(et.new_conversation(), chat(f"x{i}"), SamplingParams(max_tokens=800, ignore_eos=True))
            for i in range(4)]
    rec.wait(lambda: len(rec.of(TokenDelta, rids[0])) >= 2)
    before = len(steps)
    et.shutdown(timeout=60)
    # Prompt = at most the step in progress (and one already past its stop check) runs after
    # shutdown, not the ~800 left of the requests.
    assert not et.is_alive and len(steps) - before <= 2


def test_an_injected_failure_ends_only_that_request(running) -> None:
    eng, et, rec = running
    good = et.submit_turn(et.new_conversation(), chat("fine"), SamplingParams(max_tokens=20, ignore_eos=True))
    bad = et.submit_turn(et.new_conversation(), chat("doomed"), SamplingParams(max_tokens=20, ignore_eos=True))
    rec.wait(lambda: rec.of(TokenDelta, bad))

    real = eng.outputs.append

    def sabotage(seq, token):  # runs on the engine thread: break one request's detokenizing
        if seq.group.request_id == bad:
            return 1 / 0
        return real(seq, token)

    eng.outputs.append = sabotage
    rec.wait_done(good, bad)
    assert isinstance(rec.finished(bad), EngineError) and "ZeroDivisionError" in rec.finished(bad).message
    assert isinstance(rec.finished(good), Finished) and rec.finished(good).usage.completion_tokens == 20
    # The engine goes on serving.
    again = et.submit_turn(et.new_conversation(), chat("still there?"), SamplingParams(max_tokens=5))
    rec.wait_done(again)
    assert isinstance(rec.finished(again), Finished)


def test_bad_request_becomes_an_error_event(running) -> None:
    eng, et, rec = running
    rid = et.submit_turn(et.new_conversation(), chat("word " * 2000), SamplingParams(max_tokens=8))
    rec.wait_done(rid)
    err = rec.finished(rid)
    assert isinstance(err, EngineError) and err.code == "context_length_exceeded"
    assert "the message is" in err.message and f"the context holds {eng.max_model_len}" in err.message
    assert not rec.of(TurnStarted, rid)


def test_reply_clamped_to_the_context_says_so(running) -> None:
    """max_tokens beyond what the context leaves is lowered, not refused; TurnStarted tells the UI."""
    eng, et, rec = running
    rid = et.submit_turn(et.new_conversation(), chat("x"), SamplingParams(max_tokens=10_000, ignore_eos=True))
    rec.wait_done(rid)
    (started,) = rec.of(TurnStarted, rid)
    assert started.max_tokens_clamped and started.max_tokens == eng.max_model_len - started.prompt_tokens
    assert started.dropped_messages == 0 and started.context_len == eng.max_model_len
    done = rec.finished(rid)
    assert isinstance(done, Finished) and done.finish_reasons == ("length",)
    assert done.usage.completion_tokens == started.max_tokens


def test_idle_thread_uses_no_cpu(running) -> None:
    eng, et, rec = running
    rid = et.submit_turn(et.new_conversation(), chat("hi"), SamplingParams(max_tokens=4))
    rec.wait_done(rid)
    wakeups = []
    has_work = eng.has_unfinished_requests
    eng.has_unfinished_requests = lambda: wakeups.append(None) or has_work()  # called once per loop turn
    threading.Event().wait(1.5)  # idle for a while: the thread should sleep on its queue throughout
    # A busy loop would turn thousands of times; an idle thread at most once more (the last snapshot).
    assert len(wakeups) <= 4, f"the idle engine thread woke {len(wakeups)} times in 1.5 s"


def test_a_preempted_turn_is_reported_and_resumes(model_dir: str) -> None:
    """Four long replies in a pool too small for all: some lose their blocks for a while. The UI
    hears when (TurnPreempted waiting=True) and when they are back (False), and nothing is lost."""
    rec = Recorder()
    eng = LLMEngine.from_pretrained(model_dir, block_size=8, num_blocks=24)  # 192 slots
    et = EngineThread(eng, rec)
    et.start()
    try:
        params = SamplingParams(max_tokens=80, ignore_eos=True)
        rids = [et.submit_turn(et.new_conversation(), chat(f"story {i}"), params) for i in range(4)]
        rec.wait_done(*rids)
        assert eng.scheduler.preemptions > 0
        events = rec.of(TurnPreempted)
        waited = {e.request_id for e in events if e.waiting}
        assert waited and waited <= set(rids)
        for rid in waited:  # reported back before it finished, or it finished while waiting to resume
            flags = [e.waiting for e in events if e.request_id == rid]
            assert flags[0] is True and all(a != b for a, b in zip(flags, flags[1:]))
        assert all(isinstance(rec.finished(r), Finished) and rec.finished(r).usage.completion_tokens == 80
                   for r in rids)
    finally:
        et.shutdown()


def test_failed_recovery_forgets_what_was_in_flight_and_keeps_serving(running) -> None:
    eng, et, rec = running
    real_step, real_fail_all = eng.step, eng.fail_all
    eng.step = lambda: (setattr(eng, "step", real_step), 1 / 0)[1]  # the next step fails once
    eng.fail_all = lambda message: (setattr(eng, "fail_all", real_fail_all), 1 / 0)[1]  # and so does recovery
    lost = et.submit_turn(et.new_conversation(), chat("lost"), SamplingParams(max_tokens=50, ignore_eos=True))
    rec.wait(lambda: any(e.request_id is None and "recovery failed" in e.message for e in rec.of(EngineError)))
    assert not eng.groups and rec.finished(lost) is None
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks  # nothing leaked
    again = et.submit_turn(et.new_conversation(), chat("still there?"), SamplingParams(max_tokens=5))
    rec.wait_done(again)
    assert isinstance(rec.finished(again), Finished)
    eng.block_manager.check_invariants()


def test_engine_thread_survives_a_step_that_fails_inside_the_scheduler(model_dir: str) -> None:
    """EngineThread promises to turn an engine bug into errors for the requests in flight and keep
    serving. A step that raises inside Scheduler.schedule() after popping a sequence from the waiting
    queue (here: an injected allocator failure; in real life any block-manager assertion) leaves that
    sequence WAITING but in no queue, so fail_all -> _release -> Scheduler.remove -> deque.remove
    raises ValueError out of the except handler, and the engine thread dies silently."""
    import threading

    from engine import EngineError, EngineThread, Finished

    eng = LLMEngine.from_pretrained(model_dir, block_size=4, num_blocks=64)
    events: list = []
    done = threading.Condition()

    def on_event(ev) -> None:
        with done:
            events.append(ev)
            done.notify_all()

    real_allocate = eng.block_manager.allocate
    calls = []

    def allocate_once_broken(seq, plan):
        calls.append(seq.seq_id)
        if len(calls) == 1:
            raise RuntimeError("injected allocator bug")
        return real_allocate(seq, plan)

    eng.block_manager.allocate = allocate_once_broken
    et = EngineThread(eng, on_event)
    et.start()
    try:
        msgs = [{"role": "user", "content": "hi"}]
        first = et.submit_turn(et.new_conversation(), msgs, SamplingParams(max_tokens=3))
        second = et.submit_turn(et.new_conversation(), msgs, SamplingParams(max_tokens=3))

        def ended(rid):
            return any(isinstance(e, Finished | EngineError) and e.request_id == rid for e in events)

        with done:
            done.wait_for(lambda: ended(first) and ended(second), timeout=3.0)
        assert et.is_alive, "the engine thread died"
        assert ended(first) and ended(second)
    finally:
        et.shutdown(timeout=1.0)
