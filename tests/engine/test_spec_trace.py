"""Speculation in the KV map: a snapshot marks the blocks that held guesses as they were checked and the blocks a
rollback gave back since the previous snapshot, consistently with the block manager; nothing is recorded before
anyone looks, or without a proposer."""

from __future__ import annotations

import pytest

from engine import LLMEngine, SamplingParams
from engine.block_manager import cdiv
from engine.events import CACHED, FREE, NULL, USED, CacheSnapshot
from engine.spec_decode import SpecTrace
from tests.helpers import make_tiny_model

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PROMPT = [20, 21, 22, 23, 20, 21, 22, 23, 20, 21]  # repeats: the proposer always has something to guess


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("trace") / "m", "llama", seed=3))


def _engine(path: str, spec: dict | None) -> LLMEngine:
    return LLMEngine.from_pretrained(path, speculative_config=spec, block_size=4, num_blocks=64)


def _consistent(eng: LLMEngine, snap: CacheSnapshot) -> None:
    bm = eng.block_manager
    states = [snap.state.count(s) for s in (FREE, CACHED, USED, NULL)]
    assert sum(states) == snap.num_blocks
    assert snap.used_blocks == bm.num_usable_blocks - bm.num_free_blocks
    assert snap.free_blocks + snap.cached_blocks == bm.num_free_blocks
    assert all(snap.state[b] == USED for b in snap.spec_guess_blocks)
    assert all(snap.state[b] in (FREE, CACHED) for b in snap.spec_returned_blocks)
    assert not set(snap.spec_guess_blocks) & set(snap.spec_returned_blocks)


def test_each_snapshot_marks_what_the_checks_since_the_last_did(model_dir: str) -> None:
    """One greedy chat, a snapshot after every step, each checked against the sequence's block table as the step
    scheduled it (guesses appended) and as it left it (rejected guesses rolled back)."""
    eng = _engine(model_dir, NGRAM)
    assert eng.scheduler.spec_trace is None  # nobody has looked: nothing is recorded
    eng.cache_snapshot()
    rid = eng.add_request(PROMPT, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    (seq,) = eng.groups[rid].seqs
    schedule, seen = eng.scheduler.schedule, {}

    def watched():
        batch = schedule()
        seen.update(table=list(seq.block_table), length=len(seq), guesses=seq.num_draft_tokens)
        return batch

    eng.scheduler.schedule = watched
    s, bs, marked = eng.scheduler, eng.block_manager.block_size, {"guess": 0, "returned": 0, "rejected": 0}
    while eng.has_unfinished_requests():
        drafted, kept = s.spec_draft_tokens, s.spec_accepted_tokens
        eng.step()
        snap = eng.cache_snapshot()
        _consistent(eng, snap)
        k, end = seen["guesses"], seen["length"]
        assert (snap.spec_recent_guesses, snap.spec_recent_rejected) == (
            s.spec_draft_tokens - drafted, s.spec_draft_tokens - drafted - (s.spec_accepted_tokens - kept))
        assert snap.spec_recent_guesses == k
        if not eng.has_unfinished_requests():  # finished: its blocks went back, none of them marked
            assert not snap.spec_guess_blocks and set(snap.spec_returned_blocks) <= set(seen["table"])
            break
        guessed = set(seen["table"][(end - k) // bs : cdiv(end, bs)] if k else [])  # the guesses' blocks
        assert snap.spec_returned_blocks == tuple(sorted(set(seen["table"]) - set(seq.block_table)))
        assert snap.spec_guess_blocks == tuple(sorted(guessed - set(snap.spec_returned_blocks)))
        assert set(snap.spec_returned_blocks) <= guessed  # only blocks of rejected guesses go back
        assert len(seq.block_table) <= cdiv(seq.num_computed_tokens + 1, bs)  # room for the next token, no more
        marked["guess"] += bool(snap.spec_guess_blocks)
        marked["returned"] += len(snap.spec_returned_blocks)
        marked["rejected"] += snap.spec_recent_rejected
    assert marked["guess"] > 3 and marked["returned"] > 0 and marked["rejected"] > 0, marked
    # the next snapshot has nothing new to tell
    snap = eng.cache_snapshot()
    assert (snap.spec_guess_blocks, snap.spec_returned_blocks, snap.spec_recent_guesses) == ((), (), 0)


def test_marks_gather_between_snapshots_and_name_each_block_as_it_is_now(model_dir: str) -> None:
    """Several steps between two snapshots: returned blocks are those still free, guess blocks those still held;
    the counts add up. Without a proposer nothing is ever recorded."""
    eng = _engine(model_dir, NGRAM)
    eng.cache_snapshot()
    eng.add_request(PROMPT, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    total = 0
    while eng.has_unfinished_requests():
        for _ in range(5):
            if eng.has_unfinished_requests():
                eng.step()
        snap = eng.cache_snapshot()
        _consistent(eng, snap)
        total += snap.spec_recent_guesses
    assert total == eng.scheduler.spec_draft_tokens > 0

    plain = _engine(model_dir, None)
    plain.cache_snapshot()
    plain.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0))
    assert plain.scheduler.spec_trace is None and plain.cache_snapshot().spec_recent_guesses == 0


def test_a_block_taken_again_after_its_rollback_is_no_longer_returned() -> None:
    trace = SpecTrace()
    trace.checked([[3, 7, 9]], 6, 10, 4, rejected=3)  # positions 6..9: blocks 7 and 9 (block size 4)
    trace.returned([9])
    assert trace.guess_blocks == {7} and trace.returned_blocks == {9} and (trace.guesses, trace.rejected) == (4, 3)
    state = [FREE] * 12
    state[3] = state[7] = USED
    marks = trace.marks(state)
    assert (marks["spec_guess_blocks"], marks["spec_returned_blocks"]) == ((7,), (9,))
    state[9] = USED  # another sequence took it since: drawn as what it is now
    assert trace.marks(state)["spec_returned_blocks"] == ()
    trace.checked([[3, 7, 9]], 8, 12, 4, rejected=0)  # it held guesses again
    assert trace.guess_blocks == {7, 9} and not trace.returned_blocks
