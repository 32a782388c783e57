"""Golden traces: fixed sessions on the demo model replay to exactly the recorded events and tokens.

They pin the engine's observable behaviour (events, token ids, cache counters) across refactors.
Timing fields (ttft, tok/s, totals, snapshot times) are left out. Each session is scripted so it
is deterministic: commands are queued before the engine thread starts or from its own event
callback (so they land between two known steps), sampling is greedy or seeded.

Re-record (only when a behaviour change is intended):
    PYTHONPATH=$PWD python -m tests.engine.test_golden_traces --record
"""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine import (
    CacheSnapshot,
    EngineError,
    EngineThread,
    Finished,
    LLMEngine,
    SamplingParams,
    TokenDelta,
)

GOLDEN = Path(__file__).parent / "golden"
TIMING = {"ttft_s", "total_s", "tokens_per_s", "sample_tokens_per_s", "time"}
# empty unless a request (or the engine's config, or a model with sliding windows) asks, and none here does: left out
ASKED_FOR = {"logprobs", "prompt_logprobs", "constrained", "sample_guesses", "spec_drafts", "spec_draft_tokens",
             "spec_accepted_tokens", "spec_accepted_per_pos", "spec_guess_blocks", "spec_returned_blocks",
             "spec_recent_guesses", "spec_recent_rejected", "group", "group_names"}
SYSTEM = {"role": "system", "content": "you are a helpful assistant and answer briefly"}


def make_engine(**overrides: Any) -> LLMEngine:
    # plain decoding: the traces are of its steps (speculation's are in test_spec_decode.py and test_spec_trace.py)
    opts = dict(device="cpu", dtype="float32", block_size=4, num_blocks=256, seed=0, speculative_config=None)
    return LLMEngine.from_pretrained("demo", **{**opts, **overrides})


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        d = {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)
             if f.name not in TIMING and not (f.name in ASKED_FOR and not getattr(obj, f.name))}
        return {"type": type(obj).__name__, **d}
    if isinstance(obj, tuple | list):
        return [_plain(x) for x in obj]
    return obj


def _snapshot(eng: LLMEngine) -> dict:
    return _plain(eng.cache_snapshot())


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


class Session:
    """Runs one scripted engine-thread session; `script(session, event)` reacts on the engine thread."""

    def __init__(self, eng: LLMEngine) -> None:
        self.eng = eng
        self.trace: list = []
        self.done = threading.Event()
        self.et = EngineThread(eng, self._on_event, snapshot_interval=0.1)
        self.script: Callable[[Session, Any], None] = lambda s, e: None
        self.state: dict[str, Any] = {}

    def _on_event(self, event: Any) -> None:
        if isinstance(event, CacheSnapshot):  # sent by time: not deterministic; see below
            return
        self.trace.append(_plain(event))
        if isinstance(event, Finished | EngineError):  # the cache right after a request ends
            self.trace.append(_snapshot(self.eng))
        try:
            self.script(self, event)
        except Exception as e:  # pragma: no cover - a broken script must not hang the test
            self.trace.append({"script_error": repr(e)})
            self.done.set()

    def run(self, timeout: float = 300.0) -> list:
        self.et.start()
        assert self.done.wait(timeout), "session did not finish"
        self.et.shutdown()
        return self.trace


# ---------------------------------------------------------------------------- thread sessions
def s_multiturn() -> list:
    """Three greedy turns of one conversation, each appending to the last (prefix reuse)."""
    s = Session(make_engine())
    cid = s.et.new_conversation()
    history = [SYSTEM, user("hello, who are you?")]
    s.et.submit_turn(cid, history, SamplingParams(max_tokens=10))
    asks = ["tell me more", "and then?"]

    def script(s: Session, e: Any) -> None:
        if isinstance(e, Finished):
            history.append({"role": "assistant", "content": e.texts[0]})
            if not asks:
                s.done.set()
                return
            history.append(user(asks.pop(0)))
            s.et.submit_turn(cid, list(history), SamplingParams(max_tokens=10))

    s.script = script
    return s.run()


def s_fork_and_drop() -> list:
    """A turn, a fork, a turn on each (seeded), drop the source, one more on the fork."""
    s = Session(make_engine())
    a = s.et.new_conversation()
    hist = [SYSTEM, user("write a short poem about the sea")]
    p = SamplingParams(max_tokens=9, temperature=0.9, top_p=0.95, seed=11)
    s.et.submit_turn(a, hist, p)
    st = s.state

    def script(s: Session, e: Any) -> None:
        if not isinstance(e, Finished | EngineError):
            return
        st["n"] = st.get("n", 0) + 1
        if st["n"] == 1:
            base = hist + [{"role": "assistant", "content": e.texts[0]}]
            b = s.et.fork_conversation(a)
            st["b"], st["base"] = b, base
            s.et.submit_turn(a, base + [user("again")], p)
            s.et.submit_turn(b, base + [user("something else")], dataclasses.replace(p, seed=12))
        elif st["n"] == 3:
            s.et.drop_conversation(a)
            s.et.submit_turn(st["b"], st["base"] + [user("something else"), user("more")], SamplingParams(max_tokens=6))
        elif st["n"] == 4:
            s.done.set()

    s.script = script
    return s.run()


def s_n_samples() -> list:
    """n=3 seeded samples with a stop string, then a next turn on the first sample, and a plain
    (non-conversation) history as its own conversation with n=2 greedy."""
    s = Session(make_engine())
    cid = s.et.new_conversation()
    hist = [SYSTEM, user("give me three names")]
    s.et.submit_turn(cid, hist, SamplingParams(max_tokens=12, temperature=1.0, top_k=50, n=3, seed=3, stop=["e"]))
    c2 = s.et.new_conversation()
    s.et.submit_turn(c2, [user("count")], SamplingParams(max_tokens=5, n=2))
    st = s.state

    def script(s: Session, e: Any) -> None:
        if not isinstance(e, Finished | EngineError):
            return
        st["n"] = st.get("n", 0) + 1
        if e.conversation_id == cid and st.get("next") is None:
            st["next"] = True
            more = hist + [{"role": "assistant", "content": e.texts[0]}, user("another")]
            s.et.submit_turn(cid, more, SamplingParams(max_tokens=8, temperature=0.7, seed=5, repetition_penalty=1.3))
        elif st["n"] == 3:
            s.done.set()

    s.script = script
    return s.run()


def s_abort() -> list:
    """Abort mid-reply after three deltas, abort an unknown id, then a next turn reuses the conversation."""
    s = Session(make_engine())
    cid = s.et.new_conversation()
    hist = [SYSTEM, user("tell me a long story")]
    rid = s.et.submit_turn(cid, hist, SamplingParams(max_tokens=40, temperature=1.0, seed=9))
    other = s.et.new_conversation()
    s.et.submit_turn(other, [user("short one")], SamplingParams(max_tokens=20))
    st = s.state

    def script(s: Session, e: Any) -> None:
        if isinstance(e, TokenDelta) and e.request_id == rid:
            st["deltas"] = st.get("deltas", 0) + 1
            if st["deltas"] == 3:
                s.et.abort(rid)
                s.et.abort("turn-999")
        if isinstance(e, Finished | EngineError):
            st["n"] = st.get("n", 0) + 1
            if e.request_id == rid:
                s.et.submit_turn(cid, hist + [{"role": "assistant", "content": e.texts[0]}, user("go on")],
                                 SamplingParams(max_tokens=6))
            if st["n"] == 3:
                s.done.set()

    s.script = script
    return s.run()


def s_preemption() -> list:
    """A small pool: three concurrent conversations run out of blocks, get preempted and resume;
    parked conversations lose their blocks to newer work; a second round reuses what is left."""
    s = Session(make_engine(num_blocks=24, max_num_seqs=3, max_num_batched_tokens=64))
    convs = [s.et.new_conversation() for _ in range(3)]
    hists = {c: [user(f"conversation {i}: say a lot of words")] for i, c in enumerate(convs)}
    for i, c in enumerate(convs):
        s.et.submit_turn(c, hists[c], SamplingParams(max_tokens=22, temperature=0.8, seed=20 + i))
    st = s.state

    def script(s: Session, e: Any) -> None:
        if not isinstance(e, Finished | EngineError):
            return
        st["n"] = st.get("n", 0) + 1
        if st["n"] <= 3 and isinstance(e, Finished):
            c = e.conversation_id
            hists[c] = hists[c] + [{"role": "assistant", "content": e.texts[0]}, user("more")]
            s.et.submit_turn(c, hists[c], SamplingParams(max_tokens=8))
        if st["n"] == 6:
            s.done.set()

    s.script = script
    return s.run()


def s_context() -> list:
    """A context of 96 tokens: a long chat drops its oldest messages and clamps max_tokens; an
    over-long message is an error; too many samples for the pool is an error."""
    s = Session(make_engine(num_blocks=24))
    cid = s.et.new_conversation()
    hist = [SYSTEM]
    for i in range(5):
        hist += [user(f"question number {i} about things"), {"role": "assistant", "content": f"answer {i} " * 3}]
    hist.append(user("and the last question"))
    s.et.submit_turn(cid, hist, SamplingParams(max_tokens=60))
    st = s.state

    def script(s: Session, e: Any) -> None:
        if not isinstance(e, Finished | EngineError):
            return
        st["n"] = st.get("n", 0) + 1
        if st["n"] == 1:
            s.et.submit_turn(cid, hist + [{"role": "assistant", "content": e.texts[0]}, user("one more")],
                             SamplingParams(max_tokens=60))
        elif st["n"] == 2:
            s.et.submit_turn(cid, [SYSTEM, user("word " * 200)], SamplingParams(max_tokens=4))
        elif st["n"] == 3:
            c2 = s.et.new_conversation()
            s.et.submit_turn(c2, [user("hi")], SamplingParams(max_tokens=80, n=3))
        elif st["n"] == 4:
            s.done.set()

    s.script = script
    return s.run()


# ---------------------------------------------------------------------------- engine-level session
def s_engine_steps() -> list:
    """LLMEngine.step() directly: token ids, deltas and finish reasons of mixed requests."""
    eng = make_engine(num_blocks=40, max_num_batched_tokens=32)
    trace: list = []
    eng.add_request("the quick brown fox", SamplingParams(max_tokens=12), request_id="greedy")
    eng.add_request("one two three", SamplingParams(max_tokens=10, temperature=1.0, n=2, seed=1), request_id="n2")
    eng.add_request("stop here please", SamplingParams(max_tokens=14, temperature=1.2, seed=4, stop=["a", "o"]),
                    request_id="stopstr")
    eng.add_request(list(range(10, 60)), SamplingParams(max_tokens=8, temperature=0.6, top_k=5, min_p=0.05, seed=2,
                                                         repetition_penalty=1.5, repetition_window=4),
                    request_id="chunked")
    eng.add_request("ids stop", SamplingParams(max_tokens=10, stop_token_ids=[735], ignore_eos=True),
                    request_id="stopid")
    step = 0
    while eng.has_unfinished_requests():
        if step == 3:
            eng.abort("chunked")
        for out in eng.step():
            trace.append({
                "step": step, "request_id": out.request_id, "finished": out.finished, "deltas": out.deltas,
                "outputs": [[o.index, o.token_ids, o.text, o.finish_reason] for o in out.outputs],
                "prompt": out.prompt_token_ids, "usage": _plain(out.usage), "error": out.error,
            })
        step += 1
    trace.append(_snapshot(eng))
    return trace


SESSIONS: dict[str, Callable[[], list]] = {
    "multiturn": s_multiturn,
    "fork_and_drop": s_fork_and_drop,
    "n_samples": s_n_samples,
    "abort": s_abort,
    "preemption": s_preemption,
    "context": s_context,
    "engine_steps": s_engine_steps,
}


def _normalise(trace: list) -> list:
    return json.loads(json.dumps(trace))


@pytest.mark.parametrize("name", sorted(SESSIONS))
def test_golden_trace(name: str) -> None:
    expected = json.loads((GOLDEN / f"{name}.json").read_text())
    got = _normalise(SESSIONS[name]())
    assert got == expected


def record(names: list[str]) -> None:
    GOLDEN.mkdir(exist_ok=True)
    for name in names or sorted(SESSIONS):
        trace = _normalise(SESSIONS[name]())
        (GOLDEN / f"{name}.json").write_text(json.dumps(trace, indent=1) + "\n")
        print(f"{name}: {len(trace)} entries")


if __name__ == "__main__":
    if "--record" not in sys.argv:
        sys.exit("usage: python -m tests.engine.test_golden_traces --record [session ...]")
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")
    record([a for a in sys.argv[1:] if a != "--record"])
