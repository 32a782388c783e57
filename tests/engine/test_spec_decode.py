"""Speculative decoding (prompt lookup): the same tokens as plain decoding, greedy or seeded, through the dense
and the packed (one-call C++) decode paths; an unseeded draw has the plain one's distribution; the cache keeps
only what stood (the prefix cache publishes the same blocks as plain decoding), under preemption and across
turns of a conversation."""

from __future__ import annotations

import collections
import random

import pytest
import torch

from engine import LLMEngine, SamplingParams
from engine.spec_decode import (
    COST_WINDOW,
    MAX_PAUSE_STEPS,
    PAUSE_STEPS,
    NgramIndex,
    NgramProposer,
    SpecState,
    SpeculativeConfig,
    StepCost,
    accepted,
)
from tests.helpers import TRITON_ON, make_tiny_model

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# prompts whose endings recur in them, so the proposer has something to guess
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8],
    [20, 21, 22, 23, 20, 21, 22, 23, 20, 21],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 40, 41, 42],
    [60, 61, 62, 63],
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("spec") / "m", "llama", seed=3))


def _engine(path: str, spec: dict | None, **kw) -> LLMEngine:
    kw.setdefault("num_blocks", 128)
    return LLMEngine.from_pretrained(path, speculative_config=spec, block_size=4, **kw)


def _drain(eng: LLMEngine) -> list:
    """Step until idle; the finished outputs. Every step checks the block invariants, and none may stall."""
    finished, steps = [], 0
    while eng.has_unfinished_requests():
        steps += 1
        assert steps < 1000, f"no progress: {eng.groups}"
        finished += [out for out in eng.step() if out.finished]
        eng.block_manager.check_invariants()
    return finished


def _bounded(eng: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = {out.request_id: out for out in _drain(eng)}
    return [done[i] for i in ids]


def _run(eng: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[list[int]]]:
    outs = _bounded(eng, prompts, params)
    assert all(out.error is None for out in outs)
    return [[o.token_ids for o in out.outputs] for out in outs]


def test_proposer_takes_the_longest_latest_match() -> None:
    p = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1))
    assert p.propose([1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]  # latest "1 2 3", not the first
    assert p.propose([7, 1, 2, 8, 2], 3) == [8, 2]  # only "2" recurs: one token of context, what follows it
    assert p.propose([1, 2, 3, 4], 3) == []  # nothing recurs
    assert p.propose([5, 5, 5, 5], 2) == [5]  # overlapping matches: the latest has one token after it
    assert NgramProposer(SpeculativeConfig(prompt_lookup_min=2)).propose([7, 1, 2, 8, 2], 3) == []


def _lookup(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The rule by its definition: the longest suffix (n_max down to n_min) with an earlier occurrence followed by
    a token; what follows its latest such occurrence."""
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        starts = [s for s in range(size - n) if tokens[s : s + n] == tokens[size - n :]]
        if starts:
            return tokens[starts[-1] + n : starts[-1] + n + k]
    return []


@pytest.mark.parametrize("n_min,n_max", [(1, 3), (2, 4), (3, 3)])
def test_the_growing_index_proposes_what_a_scan_of_the_whole_sequence_does(n_min: int, n_max: int) -> None:
    """A sequence's index is extended as its tokens grow, one or several a step (a check keeps several),
    and a new request's longer prompt starts it over."""
    rng = random.Random(n_min * 10 + n_max)
    for _ in range(20):
        index, tokens = NgramIndex(n_min, n_max), [rng.randrange(6) for _ in range(rng.randrange(1, 12))]
        for _ in range(60):
            k = rng.randrange(1, 6)
            assert index.propose(tokens, k) == _lookup(tokens, k, n_min, n_max), tokens
            tokens += [rng.randrange(6) for _ in range(rng.choice((1, 1, 1, 3)))]
        shorter = tokens[: rng.randrange(1, len(tokens))]
        assert index.propose(shorter, 4) == _lookup(shorter, 4, n_min, n_max)


def test_accepted_counts_the_leading_matches() -> None:
    assert accepted([4, 5, 6], [4, 5, 9, 1]) == 2
    assert accepted([4, 5, 6], [1, 5, 6, 1]) == 0
    assert accepted([4, 5, 6], [4, 5, 6, 7]) == 3


@pytest.mark.parametrize("bad, message", [
    ('{"method": "eagle"}', "not supported"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"k": 3}, "unknown key"),
    ("{not json", "not JSON"),
    ({"prompt_lookup_min": 5, "prompt_lookup_max": 2}, "must not exceed"),
])  # fmt: skip
def test_bad_config_is_refused_by_name(bad, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(bad)
    assert SpeculativeConfig.parse("") is None and SpeculativeConfig.parse({}) is None
    assert SpeculativeConfig.parse('{"num_speculative_tokens": 2}').num_speculative_tokens == 2


def test_speculation_is_prompt_lookup_by_default_and_off_when_asked(model_dir: str) -> None:
    """What every user gets with no option (the app, serve, the Python API): "auto", prompt lookup with k = 4,
    the same greedy tokens as plain decoding; "off" / None: none."""
    assert SpeculativeConfig.parse("auto") == SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    assert SpeculativeConfig.parse(" Off ") is None and SpeculativeConfig.parse(None) is None
    default = LLMEngine.from_pretrained(model_dir, block_size=4, num_blocks=128)  # no speculative_config
    assert isinstance(default.scheduler.proposer, NgramProposer) and default.scheduler.proposer.k == 4
    off = [_engine(model_dir, "off"), _engine(model_dir, None)]
    assert [eng.scheduler.proposer for eng in off] == [None, None]
    greedy = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)] * len(PROMPTS)
    assert _run(default, PROMPTS, greedy) == _run(off[0], PROMPTS, greedy)
    assert default.scheduler.spec_draft_tokens > 0 and off[0].scheduler.spec_draft_tokens == 0


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_greedy_tokens_and_published_blocks_match_plain_decoding(model_dir: str, quantization: str) -> None:
    params = [
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=33, temperature=0, repetition_penalty=1.1, repetition_window=64, ignore_eos=True),
        SamplingParams(max_tokens=25, temperature=0, ignore_eos=True, stop_token_ids=[44]),
        SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
    ]
    plain, spec = _engine(model_dir, None, quantization=quantization), _engine(model_dir, NGRAM,
                                                                                 quantization=quantization)
    assert _run(spec, PROMPTS, params) == _run(plain, PROMPTS, params)
    s = spec.scheduler
    assert 0 < s.spec_accepted_tokens < s.spec_draft_tokens, "both kept and rejected guesses are exercised"
    # The prefix cache holds the same blocks: none with a rejected guess's KV under a hash.
    assert set(spec.block_manager.hash_to_block) == set(plain.block_manager.hash_to_block)


def test_through_the_triton_kernels_greedy_tokens_match_plain_decoding(model_dir: str) -> None:
    """The check rows through the Triton attention kernels: interpreted here, compiled on a GPU, where plain
    decode steps replay CUDA graphs and speculative steps (several rows a sequence) run eagerly beside them."""
    opts = dict(attention_backend="triton", **TRITON_ON)
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)] * 2
    plain, spec = _engine(model_dir, None, **opts), _engine(model_dir, NGRAM, **opts)
    assert _run(spec, PROMPTS[:2], params) == _run(plain, PROMPTS[:2], params)
    assert 0 < spec.scheduler.spec_accepted_tokens
    assert set(spec.block_manager.hash_to_block) == set(plain.block_manager.hash_to_block)


def test_seeded_samples_match_plain_decoding(model_dir: str) -> None:
    params = [SamplingParams(max_tokens=30, temperature=0.3, top_k=3, top_p=0.9, seed=11 + i, n=1 + i % 2,
                             ignore_eos=True) for i in range(len(PROMPTS))]  # fmt: skip
    spec = _engine(model_dir, NGRAM)
    assert _run(spec, PROMPTS, params) == _run(_engine(model_dir, None), PROMPTS, params)
    assert spec.scheduler.spec_accepted_tokens > 0


def test_unseeded_draws_have_the_plain_distribution(model_dir: str) -> None:
    """Unseeded rows share torch's global stream, which speculation draws from differently: the tokens differ
    run to run, their distribution must not. The guesses are the greedy continuation (often kept, often not, at
    temperature 1, top-k 3); two-sample chi-square over the (2nd, 3rd) output tokens."""
    prompt, count = PROMPTS[0], 400
    greedy = _run(_engine(model_dir, None), [prompt], [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)])
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=3, ignore_eos=True)] * count
    tallies = []
    for spec in (None, NGRAM):
        torch.manual_seed(0)
        eng = _engine(model_dir, spec, num_blocks=400)
        if spec:
            eng.scheduler.proposer.propose = lambda ids, k, index=None: greedy[0][0][len(ids) - len(prompt) :][:k]
            eng.scheduler.proposer.kind = lambda seq: 0  # guesses at every step, of one kind
        outs = _run(eng, [prompt] * count, params)
        tallies.append(collections.Counter(tuple(o[0][1:]) for o in outs))
    s = eng.scheduler
    assert 30 < s.spec_accepted_tokens < s.spec_draft_tokens - 30  # many kept, many rejected
    plain, spec_counts = tallies
    cells = [c for c in set(plain) | set(spec_counts) if plain[c] + spec_counts[c] >= 10]
    chi2 = sum((plain[c] - spec_counts[c]) ** 2 / (plain[c] + spec_counts[c]) for c in cells)
    p_value = torch.special.gammaincc(torch.tensor((len(cells) - 1) / 2), torch.tensor(chi2 / 2)).item()  # chi2 sf
    assert len(cells) >= 4 and p_value > 1e-3, (plain, spec_counts)


def test_preemption_and_conversation_turns_keep_the_plain_tokens(model_dir: str) -> None:
    params = [SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)] * 6
    prompts = [p + [70 + i] for i in range(2) for p in PROMPTS[:3]]
    small = _engine(model_dir, NGRAM, num_blocks=40)  # 6 sequences of up to 64 tokens: some wait, some preempted
    assert _run(small, prompts, params) == _run(_engine(model_dir, None), prompts, params)
    assert small.scheduler.preemptions > 0 and small.scheduler.spec_accepted_tokens > 0

    replies = []
    for spec in (None, NGRAM):
        eng, got = _engine(model_dir, spec), []
        cid = eng.start_conversation()
        history = list(PROMPTS[1])
        for _ in range(3):  # each turn extends the parked sequence the last one left
            rid = eng.submit_turn(cid, history, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
            out = [o for o in _drain(eng) if o.request_id == rid][0]
            got.append(out.outputs[0].token_ids)
            history = history + out.outputs[0].token_ids + [20, 21]
        replies.append(got)
    assert replies[0] == replies[1]


def test_a_sequence_whose_guesses_fail_pauses_then_tries_again() -> None:
    state = SpecState()
    assert state.budget(4) == 4
    for _ in range(3):
        state.record(4, 4)
    assert state.budget(4) == 4
    state.record(4, 1)
    assert state.budget(4) == 3  # fewer guesses as fewer stand
    while not state.paused:
        state.record(4, 0)
    assert [state.budget(4) for _ in range(PAUSE_STEPS)] == [0] * PAUSE_STEPS
    assert state.budget(4) == 2  # back, at half the guesses


def _pause_after_failing(state: SpecState) -> int:
    while not state.paused:
        state.record(2, 0)
    steps = 0
    while state.budget(4) == 0:
        steps += 1
    return steps


def test_tries_that_fail_again_pause_longer_until_guesses_stand_again() -> None:
    """Free chat under a repetition penalty keeps a quarter of its guesses: a try every 16 steps cost more than
    it gained, so each pause doubles the last (to a bound) until a check keeps half its guesses."""
    state = SpecState()
    pauses = [_pause_after_failing(state) for _ in range(6)]
    assert pauses == [PAUSE_STEPS, 2 * PAUSE_STEPS, 4 * PAUSE_STEPS, 8 * PAUSE_STEPS, MAX_PAUSE_STEPS, MAX_PAUSE_STEPS]
    assert MAX_PAUSE_STEPS == 8 * PAUSE_STEPS
    state.record(2, 1)  # half stood: editing text again
    assert _pause_after_failing(state) == PAUSE_STEPS


def test_guesses_are_judged_by_the_rate_of_their_kind_learned_over_all_sequences() -> None:
    """A 4-gram's guesses stood 87 % of the time in greedy chat, a 2-gram's 52 % (36 % under the app's
    repetition penalty): the chance a check is judged by is its n-gram length's, learned from every sequence's
    checks until the sequence has its own; and a guess's chance is taken given the ones before it stood."""
    from types import SimpleNamespace

    proposer = NgramProposer(SpeculativeConfig(prompt_lookup_max=4, prompt_lookup_min=2))
    seq = SimpleNamespace(seq_id=7, token_ids=[1, 2, 3, 4, 9, 1, 2, 3, 4], spec=SpecState())
    assert proposer.kind(seq) == 4 and proposer.propose_batch([(seq, 2)]) == {7: [9, 1]}
    seq.token_ids += [8, 6, 3, 4]  # "6 3 4" is new, "3 4" is not
    assert proposer.kind(seq) == 2
    seq.token_ids += [11]
    assert proposer.kind(seq) is None
    learned: dict[int, float] = {}
    first, second = SpecState(kind=2), SpecState()
    first.record(4, 0, learned)  # its first 2-gram guess failed: its own rate halfway from the prior
    assert learned == {2: pytest.approx(0.7)} and first.rate_of(2, learned) == pytest.approx(0.5)
    assert second.rate_of(2, learned) == pytest.approx(0.7) and second.rate_of(4, learned) == 1.0
    second.kind = 2
    second.record(4, 2, learned)  # 2 of the 3 guesses tried stood (the 4th was never tried)
    assert second.rate_of(2, learned) == pytest.approx(0.7 + 0.5 * (2 / 3 - 0.7))
    assert learned[2] == pytest.approx(0.7 + 0.3 * (2 / 3 - 0.7))
    assert second.rate == pytest.approx(1.0 + 0.3 * (2 / 3 - 1.0))
    first.record(1, 1, learned)
    assert first.rate_of(2, learned) == pytest.approx(0.5 + 0.3 * 0.5)  # its own, not the others'


def test_a_sliding_window_model_keeps_the_plain_tokens(tmp_path) -> None:
    """Gemma 2's windowed layers attend each guess's own window (the rows' keys end at their positions)."""
    path = str(make_tiny_model(tmp_path / "g", "gemma2", seed=1))
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)] * 2
    spec = _engine(path, NGRAM)
    assert _run(spec, PROMPTS[:2], params) == _run(_engine(path, None), PROMPTS[:2], params)
    assert spec.scheduler.spec_steps > 0


@pytest.mark.parametrize("n", [1, 2, 3])
def test_n_samples_whose_prompt_ends_on_a_one_token_chunk(model_dir: str, n: int) -> None:
    """A budget of 10 leaves the 11-token prompt's last token for a step of its own: no guess before the
    first sampled token, where the group forks its samples (found in review: the request never ended)."""
    params = [SamplingParams(max_tokens=8, temperature=0.5, seed=1, n=n, ignore_eos=True)]
    got = [[o.token_ids for o in out.outputs] for spec in (None, NGRAM)
           for out in _bounded(_engine(model_dir, spec, max_num_batched_tokens=10), PROMPTS[:1], params)]
    assert got[0] == got[1] and len(got[0]) == n


def test_guesses_leave_a_token_for_every_later_decode(model_dir: str) -> None:
    """With a small token budget, guessing sequences must not crowd later ones out of a step."""
    eng = _engine(model_dir, NGRAM, max_num_batched_tokens=8)
    eng.scheduler.proposer.propose = lambda ids, k, index=None: [int(ids[-1])] * k  # always guesses, as much as allowed
    eng.scheduler.proposer.kind = lambda seq: 0  # guesses at every step, of one kind
    schedule, sat_out = eng.scheduler.schedule, []

    def watched():
        running = list(eng.scheduler.running)
        batch = schedule()
        sat_out.append(len(set(running) - set(batch.seqs)))
        return batch

    eng.scheduler.schedule = watched
    _bounded(eng, PROMPTS, [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)] * len(PROMPTS))
    assert eng.scheduler.spec_steps > 0 and sum(sat_out) == 0, sat_out


def test_a_failed_sample_keeps_no_unchecked_guesses(model_dir: str) -> None:
    """Sample 0's detokenizer fails mid-step: its sibling's guesses are dropped, not reported as output."""
    eng = _engine(model_dir, NGRAM)
    eng.scheduler.proposer.propose = lambda ids, k, index=None: [int(ids[-1])] * k
    eng.scheduler.proposer.kind = lambda seq: 0  # guesses at every step, of one kind
    append = eng.outputs.append

    def failing(seq, token):
        if seq.index == 0 and seq.num_output_tokens >= 6:
            raise RuntimeError("detokenizer broke")
        return append(seq, token)

    eng.outputs.append = failing
    out = _bounded(eng, PROMPTS[1:2], [SamplingParams(max_tokens=20, temperature=0.8, seed=5, n=2,
                                                      ignore_eos=True)])[0]
    assert out.error is not None and eng.scheduler.spec_steps > 0
    assert all(len(o.token_ids) <= 6 for o in out.outputs), [o.token_ids for o in out.outputs]
    assert out.usage.completion_tokens == sum(len(o.token_ids) for o in out.outputs)


def test_each_reply_says_how_many_of_its_guesses_stood(model_dir: str) -> None:
    from engine import Finished
    from rosechat.widgets.chat import ReplyStats

    out = _bounded(_engine(model_dir, NGRAM), PROMPTS[1:2], [SamplingParams(max_tokens=30, temperature=0,
                                                                            ignore_eos=True)])[0]
    (finished,) = [e for e in out.events if isinstance(e, Finished)]
    ((guessed, kept),) = finished.sample_guesses
    assert 0 < kept <= guessed
    assert f"{100 * kept / guessed:.0f}% of guesses kept" in ReplyStats(30, 0.1, 50.0, "length", kept / guessed).line()
    plain = _bounded(_engine(model_dir, None), PROMPTS[1:2], [SamplingParams(max_tokens=5, temperature=0)])[0]
    assert [e.sample_guesses for e in plain.events if isinstance(e, Finished)] == [()]


def test_the_measured_cost_of_a_check_decides_how_many_guesses_pay(monkeypatch) -> None:
    """Where every row costs a row's work (a compute-bound CPU), a guess pays only at a high rate; where rows
    are nearly free (weight-bound), every guess does; not measured yet (one row count seen), k."""
    monkeypatch.setenv("ROSECHAT_SPEC_COST", "measured")
    cost = StepCost()
    cost.record(1, 0.010)
    assert cost.fit is None and cost.worth(4, 0.1, rows=1) == 4
    cost.record(5, 0.030)  # base 5 ms, 5 ms a row: a 5-row check costs 3 plain steps
    assert cost.fit == pytest.approx((0.005, 0.005))
    assert cost.worth(4, 0.4, rows=1) == 0  # 0.4 + 0.16 + ... never beats half a step a guess
    assert cost.worth(4, 0.95, rows=1) == 4  # an edit: the guesses stand
    assert cost.worth(4, 0.8, rows=1) == 3  # the 4th stands at 0.8 ** 4 = 0.41 < the half step it costs
    assert cost.worth(4, 0.8, rows=8) == 0  # eight decodes share a step: a guess delays all of them
    flat = StepCost()
    flat.record(1, 0.010)
    flat.record(9, 0.0101)
    assert flat.worth(4, 0.3, rows=1) == 4
    bent = StepCost()  # the first extra row costs most (one row's tiles are not several rows')
    for rows, ms in ((1, 6.3), (5, 11.0)):
        bent.record(rows, ms / 1000)
    assert bent.worth(4, 0.28, rows=1) == 1  # the line: a 2-row step 1.2 ms (18 %) over a plain one, 0.28 > 0.18
    bent.record(2, 0.0085)  # measured: 2.2 ms (35 %)
    assert bent.worth(4, 0.28, rows=1) == 0  # a guess that stands 28 % of the time no longer pays
    assert bent.worth(4, 0.9, rows=1) == 4  # an edit's still do: 5 rows cost 0.75 of a step more
    monkeypatch.setenv("ROSECHAT_SPEC_COST", "off")
    off = StepCost()
    off.record(1, 0.010)
    off.record(5, 0.030)
    assert off.fit is None and off.worth(4, 0.1, rows=1) == 4


def test_a_row_counts_time_is_the_median_of_its_recent_steps_not_its_first(monkeypatch) -> None:
    """A new row count's first step carries one-off costs (another process's burst, first use of its tiles);
    free chat checks rarely, so the first time must not stand for the row count for dozens of steps."""
    monkeypatch.setenv("ROSECHAT_SPEC_COST", "measured")
    cost = StepCost()
    for _ in range(3):
        cost.record(1, 0.004)
    cost.record(2, 0.011)  # a one-off
    assert cost.worth(4, 0.4, rows=1) == 0  # 2 rows at 2.75 plain steps: no guess pays at 0.4
    cost.record(2, 0.0048)
    cost.record(2, 0.005)
    assert cost.time(2) == pytest.approx(0.005)  # the middle of three, where a running average kept 0.0098
    assert cost.worth(4, 0.4, rows=1) == 1  # a guess at 0.4 beats the quarter step its row costs
    for _ in range(COST_WINDOW):
        cost.record(1, 0.006)  # the machine slowed down (or the context grew): only recent steps count
    assert cost.time(1) == pytest.approx(0.006)


def test_a_check_that_would_lose_is_not_taken_and_the_text_is_the_same(model_dir: str, monkeypatch) -> None:
    """Through the engine: where a row costs half a plain step, only the kinds of guesses that stand often are
    checked (each kind's first tries go by the optimistic starting rate): fewer guesses, more of them kept;
    where rows are nearly free every guess is. Greedy text equal to plain decoding either way."""
    monkeypatch.setenv("ROSECHAT_SPEC_COST", "measured")
    params = [SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)]
    plain = _run(_engine(model_dir, None), PROMPTS[1:2], params)
    drafts = {}
    for per_row in (1.0, 0.001):
        eng = _engine(model_dir, NGRAM)
        cost = eng.scheduler.step_cost
        cost.record(1, 1.0 + per_row)
        cost.record(5, 1.0 + 5 * per_row)
        monkeypatch.setattr(cost, "record", lambda rows, seconds: None)  # the machine's timing left out
        assert _run(eng, PROMPTS[1:2], params) == plain
        drafts[per_row] = eng.scheduler.spec_draft_tokens, eng.scheduler.spec_accepted_tokens
    (costly, costly_kept), (free, free_kept) = drafts[1.0], drafts[0.001]
    assert 0 < costly < free and costly_kept / costly > free_kept / free, drafts


def test_a_sequence_tries_one_guess_of_a_kind_before_the_others_rate_judges_it(model_dir: str, monkeypatch) -> None:
    """An edit after chats: every check so far says 2-grams rarely stand (the chats'), but this sequence's do. Its
    first guess of the kind is taken alone, whatever the prior, and its own rate decides from then on (judged by
    the chats' rate, an edit never guessed). Greedy text equal to plain decoding."""
    monkeypatch.setenv("ROSECHAT_SPEC_COST", "measured")
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)]
    prompt = PROMPTS[1]
    plain = _run(_engine(model_dir, None), [prompt], params)
    eng = _engine(model_dir, NGRAM)
    cost = eng.scheduler.step_cost
    cost.record(1, 2.0)
    cost.record(5, 6.0)  # a row costs half a plain step
    monkeypatch.setattr(cost, "record", lambda rows, seconds: None)  # the machine's timing left out
    continuation = plain[0][0]
    eng.scheduler.proposer.kind = lambda seq: 2
    eng.scheduler.proposer.propose = lambda ids, k, index=None: continuation[len(ids) - len(prompt) :][:k]
    eng.scheduler.guess_rates[2] = 0.1  # the chats' verdict: no check of 2-gram guesses pays at 0.1
    assert _run(eng, [prompt], params) == plain
    s = eng.scheduler
    assert s.spec_accepted_per_pos[0] == s.spec_steps  # every check's first guess stood ...
    assert s.spec_accepted_tokens == s.spec_draft_tokens > 8 and s.spec_steps > 4  # ... and it went on guessing
