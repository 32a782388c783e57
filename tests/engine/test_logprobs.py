"""Logprobs: the sampled token's log-probability under the distribution it was drawn from (after the
repetition penalty and the temperature), checked against log_softmax of the engine's own logits."""

from __future__ import annotations

import pytest
import torch

from engine import LLMEngine, SamplingParams
from engine.sampler import apply_repetition_penalty
from tests.helpers import make_tiny_model


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    path = make_tiny_model(tmp_path_factory.mktemp("logprobs") / "m", "llama")
    return LLMEngine.from_pretrained(str(path), device="cpu", block_size=8, num_blocks=64)


def _reference(engine: LLMEngine, prompt: list[int], output: list[int], penalty: float = 1.0,
               temperature: float = 0.0) -> torch.Tensor:
    """[len(output), vocab] log-probabilities from score(): the engine's logits at each output position."""
    logits = engine.score(prompt + output)[len(prompt) - 1 : -1].float()
    if penalty != 1.0:  # over prompt + output so far, as SamplingParams without a window
        seen = [prompt + output[:i] for i in range(len(output))]
        logits = apply_repetition_penalty(logits, seen, torch.full((len(output),), penalty))
    return torch.log_softmax(logits / (temperature or 1.0), dim=-1)


@pytest.mark.parametrize("penalty,temperature", [(1.0, 0.0), (1.3, 0.0), (1.0, 0.8), (1.2, 0.6)])
def test_logprobs_are_log_softmax_of_the_engines_own_logits(engine: LLMEngine, penalty: float,
                                                            temperature: float) -> None:
    prompt = [5, 9, 14, 3, 22, 7, 11, 30, 2, 17]
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=3, repetition_penalty=penalty,
                            temperature=temperature, seed=4)
    out = engine.generate([prompt], params)[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 12
    ref = _reference(engine, prompt, out.token_ids, penalty, temperature)
    for i, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(float(ref[i, token]), abs=1e-4)
        top_v, top_i = ref[i].topk(3)
        assert [t for t, _ in lp.top] == top_i.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top_v.tolist(), abs=1e-4)
        if temperature == 0.0:  # greedy: the chosen token is the most likely one
            assert lp.top[0][0] == token


def test_only_the_rows_that_ask_get_logprobs_and_tokens_do_not_change(engine: LLMEngine) -> None:
    prompts = [[5, 9, 14, 3], [22, 7, 11, 30, 2]]
    plain = engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    mixed = engine.generate(prompts, [SamplingParams(max_tokens=8, ignore_eos=True, logprobs=0),
                                      SamplingParams(max_tokens=8, ignore_eos=True)])
    assert [o.outputs[0].token_ids for o in mixed] == [o.outputs[0].token_ids for o in plain]
    asked, other = mixed[0].outputs[0], mixed[1].outputs[0]
    assert other.logprobs is None
    assert asked.logprobs is not None and all(lp.top == () for lp in asked.logprobs)


def test_deltas_carry_the_logprobs_of_their_tokens(engine: LLMEngine) -> None:
    rid = engine.add_request([5, 9, 14, 3], SamplingParams(max_tokens=10, ignore_eos=True, logprobs=1, n=2,
                                                           temperature=1.0, seed=1))
    per_sample: dict[int, list] = {0: [], 1: []}
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == rid
            for (index, _), lps in zip(out.deltas, out.delta_logprobs):
                per_sample[index] += lps
            final = out
    assert final is not None and final.finished
    finished = final.events[-1]
    for o in final.outputs:
        assert per_sample[o.index] == o.logprobs == list(finished.logprobs[o.index])
        assert [lp.token_id for lp in o.logprobs] == o.token_ids


def test_logprobs_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-1)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


def test_prompt_logprobs_score_every_prompt_token_chunked_cached_and_preempted(tmp_path) -> None:
    """Each prompt token's log-probability given those before it, as score() gives them, in prefill chunks;
    a prompt already in the prefix cache is computed again (every position is needed); a tight pool that
    preempts a request does not score its prompt twice; and the reply is the one without prompt logprobs."""
    path = make_tiny_model(tmp_path / "m", "llama")
    eng = LLMEngine.from_pretrained(str(path), device="cpu", block_size=4, num_blocks=20, max_num_batched_tokens=8)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(4, 500, (n,), generator=gen).tolist() for n in (23, 17, 30, 9)]
    plain = eng.generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True))  # now in the prefix cache
    outs = eng.generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True, prompt_logprobs=3))
    assert eng.cache_snapshot().preemptions >= 1
    for prompt, out, ref in zip(prompts, outs, plain):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        pl = out.prompt_logprobs
        assert len(pl) == len(prompt) and pl[0] is None
        want = torch.log_softmax(eng.score(prompt)[:-1].float(), dim=-1)
        for i, lp in enumerate(pl[1:], start=1):
            assert lp.token_id == prompt[i] and abs(lp.logprob - want[i - 1, prompt[i]].item()) < 1e-4
            top = want[i - 1].topk(3)
            assert [t for t, _ in lp.top] == top.indices.tolist()
        assert out.usage.prefilled_tokens >= len(prompt)  # none of it came from the cache (a preempted one: twice)


def test_prompt_logprobs_of_a_new_conversation_whose_prefix_others_hold(tmp_path) -> None:
    """A parked conversation (a finished turn, not dropped) and the prefix cache both hold the prompt's
    start: a request for prompt logprobs takes neither and scores every token."""
    eng = LLMEngine.from_pretrained(str(make_tiny_model(tmp_path / "m", "llama")), device="cpu", block_size=4,
                                    num_blocks=64)
    base = [(i * 7) % 200 + 10 for i in range(4 * 4 + 5)]
    want = eng.generate([base], SamplingParams(max_tokens=1, prompt_logprobs=0))[0].prompt_logprobs
    dropped = eng.start_conversation()
    eng.submit_turn(dropped, base[:16] + [3, 4], SamplingParams(max_tokens=1))
    eng.generate([], SamplingParams())  # drains
    eng.drop_conversation(dropped)  # its full blocks stay in the prefix cache
    parked = eng.start_conversation()
    eng.submit_turn(parked, base[:8] + [5, 6, 7], SamplingParams(max_tokens=1))
    eng.generate([], SamplingParams())
    rid = eng.submit_turn(eng.start_conversation(), base, SamplingParams(max_tokens=1, prompt_logprobs=0))
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    got = done[rid].prompt_logprobs
    assert len(got) == len(base) and got[0] is None and None not in got[1:]
    assert [g.token_id for g in got[1:]] == base[1:]
    assert [g.logprob for g in got[1:]] == pytest.approx([w.logprob for w in want[1:]], abs=1e-4)


def test_logprobs_of_a_reply_held_to_a_grammar_are_finite() -> None:
    """Tokens the grammar masks are -inf: reported at vLLM's floor, so the JSON of the reply stays valid."""
    from engine import StructuredOutput

    eng = LLMEngine.from_pretrained("demo", device="cpu", num_blocks=32)
    out = eng.generate(["pick"], SamplingParams(max_tokens=8, logprobs=5, structured=StructuredOutput(
        choice=["yes", "no"])))[0].outputs[0]
    values = [v for lp in out.logprobs for v in (lp.logprob, *(x for _, x in lp.top))]
    assert out.text in ("yes", "no") and all(-9999.0 <= v <= 0 for v in values) and -9999.0 in values
