"""Speculative decoding with a draft model (engine/draft.py): the target's own tokens, greedy or seeded, whatever
the draft guesses; the draft's KV follows the target's accepted tokens through rejections, preemption and
conversation turns; a draft with another vocabulary is refused at load."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine import LLMEngine, SamplingParams, SpeculativeConfig
from engine.draft import DraftModelProposer, check_vocabulary
from tests.engine.test_spec_decode import PROMPTS
from tests.helpers import make_tiny_model, tiny_tokenizer

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The target; a noisy copy of it (agrees on most guesses, not all); an unrelated random model with the
    same tokenizer and one layer (agrees on next to none)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("draft")
    target = make_tiny_model(root / "target", "llama", seed=3)
    model = AutoModelForCausalLM.from_pretrained(target)
    noise = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=noise) * 0.1 * p.std())
    model.save_pretrained(root / "noisy")
    for f in target.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, root / "noisy" / f.name)
    other = make_tiny_model(root / "other", "llama", seed=4, num_hidden_layers=1)
    return {"target": str(target), "noisy": str(root / "noisy"), "other": str(other)}


def _engine(models: dict[str, str], draft: str | None, k: int = 3, **kw) -> LLMEngine:
    kw.setdefault("num_blocks", 128)
    spec = {"method": "draft_model", "model": models[draft], "num_speculative_tokens": k} if draft else None
    return LLMEngine.from_pretrained(models["target"], speculative_config=spec, block_size=4, **kw)


def _run(eng: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[list[int]]]:
    """Every request's samples' tokens; the target's and the draft's pools keep their invariants at each step."""
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    done, steps = {}, 0
    while eng.has_unfinished_requests():
        steps += 1
        assert steps < 1000, "no progress"
        done.update((o.request_id, o) for o in eng.step() if o.finished)
        eng.block_manager.check_invariants()
        if isinstance(eng.scheduler.proposer, DraftModelProposer):
            eng.scheduler.proposer.bm.check_invariants()
    assert all(done[i].error is None for i in ids)
    return [[o.token_ids for o in done[i].outputs] for i in ids]


def _proposer(eng: LLMEngine) -> DraftModelProposer:
    proposer = eng.scheduler.proposer
    assert isinstance(proposer, DraftModelProposer)
    return proposer


def test_the_target_drafting_for_itself_has_every_greedy_guess_kept(models: dict[str, str]) -> None:
    spec = _engine(models, "target")
    params = [GREEDY, GREEDY, SamplingParams(max_tokens=9, temperature=0, ignore_eos=True), GREEDY]
    assert _run(spec, PROMPTS, params) == _run(_engine(models, None), PROMPTS, params)
    s = spec.scheduler
    assert s.spec_draft_tokens > 3 * len(PROMPTS) and s.spec_accepted_tokens == s.spec_draft_tokens
    assert s.spec_accepted_per_pos[0] == s.spec_steps and s.spec_accepted_per_pos[2] > s.spec_steps / 2
    # four sequences at once: one draft forward per guess position per step, not per sequence
    assert _proposer(spec).forwards <= 3 * s.spec_steps / 2


@pytest.mark.parametrize("draft", ["noisy", "other"])
def test_another_draft_keeps_the_plain_greedy_tokens(models: dict[str, str], draft: str) -> None:
    spec, plain = _engine(models, draft), _engine(models, None)
    params = [GREEDY] * len(PROMPTS)
    assert _run(spec, PROMPTS, params) == _run(plain, PROMPTS, params)
    s = spec.scheduler
    assert s.spec_draft_tokens > 0
    if draft == "noisy":  # both kept and rejected guesses: rollbacks of the target's and the draft's KV
        assert 0.3 * s.spec_draft_tokens < s.spec_accepted_tokens < s.spec_draft_tokens
    # only accepted blocks are published
    assert set(spec.block_manager.hash_to_block) == set(plain.block_manager.hash_to_block)


def test_seeded_samples_match_plain_decoding(models: dict[str, str]) -> None:
    params = [SamplingParams(max_tokens=20, temperature=0.7, top_k=5, seed=7 + i, n=1 + i % 2, ignore_eos=True)
              for i in range(len(PROMPTS))]  # fmt: skip
    spec = _engine(models, "noisy")
    got = _run(spec, PROMPTS, params)
    assert got == _run(_engine(models, None), PROMPTS, params)
    assert [len(samples) for samples in got] == [1, 2, 1, 2]
    assert spec.scheduler.spec_accepted_tokens > 0


def _check_guesses(eng: LLMEngine, draft_path: str) -> list[int]:
    """Make eng's proposer assert that each guess list is what the draft model computes from scratch on the
    target's tokens (its KV kept in step); returns the list of guess counts, filled as it runs."""
    reference = LLMEngine.from_pretrained(draft_path, block_size=4, num_blocks=64)
    proposer, counts = _proposer(eng), []
    propose = proposer.propose_batch

    def checking(wanted):
        got = propose(wanted)
        for seq, _ in wanted:
            tokens = list(seq.token_ids)
            for guess in got.get(seq.seq_id, []):
                assert guess == int(reference.score(tokens)[-1].argmax()), "a guess from stale draft KV"
                tokens.append(guess)
            counts.append(len(got.get(seq.seq_id, [])))
        return got

    proposer.propose_batch = checking
    return counts


def test_guesses_are_the_drafts_greedy_continuation_after_rejections_and_preemption(models: dict[str, str]) -> None:
    """The draft's KV stays in step through rolled-back guesses, preempted and resumed sequences, and a pool too
    small for all."""
    spec = _engine(models, "noisy", num_blocks=40)  # 6 sequences of up to 44 tokens: some preempted
    checked = _check_guesses(spec, models["noisy"])
    prompts = [p + [70 + i] for i in range(2) for p in PROMPTS[:3]]
    params = [SamplingParams(max_tokens=32, temperature=0.3, top_k=3, seed=i, ignore_eos=True) for i in range(6)]
    assert _run(spec, prompts, params) == _run(_engine(models, None), prompts, params)
    s, proposer = spec.scheduler, _proposer(spec)
    assert s.preemptions > 0 and 0 < s.spec_accepted_tokens < s.spec_draft_tokens and sum(checked) > 20
    # drafts of finished sequences are freed at the next step that guesses: only the new request's is left
    _run(spec, PROMPTS[:1], [GREEDY])
    (left,) = proposer.drafts.values()
    assert left.target.token_ids[: len(PROMPTS[0])] == PROMPTS[0]
    proposer._collect()
    assert not proposer.drafts and proposer.bm.num_free_blocks == proposer.bm.num_blocks


def test_guesses_cut_short_by_the_token_budget(models: dict[str, str]) -> None:
    """A step's budget checks fewer guesses than the draft made; the token after them is often the draft's next
    guess, whose KV the draft holds already (found in review: it then fed no token and took another's logits)."""
    spec = _engine(models, "target", k=4, max_num_batched_tokens=7)
    checked = _check_guesses(spec, models["target"])
    params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)] * len(PROMPTS)
    assert _run(spec, PROMPTS, params) == _run(_engine(models, None), PROMPTS, params)
    s = spec.scheduler
    assert sum(checked) > s.spec_draft_tokens > 0  # some guesses were cut


def test_a_conversations_next_turn_reuses_its_draft_kv(models: dict[str, str]) -> None:
    replies = []
    for draft in (None, "target"):
        eng, got = _engine(models, draft), []
        cid = eng.start_conversation()
        history = list(PROMPTS[1])
        for _ in range(3):  # each turn extends the parked sequence the last one left
            before = _proposer(eng).draft_tokens if draft else 0
            rid = eng.submit_turn(cid, history, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
            out = [o for o in _drain(eng) if o.request_id == rid][0]
            got.append(out.outputs[0].token_ids)
            if draft and len(got) > 1:  # the draft catches up from where the last turn left it, not from 0
                assert _proposer(eng).draft_tokens - before < len(history)
            history = history + out.outputs[0].token_ids + [20, 21]
        replies.append(got)
    assert replies[0] == replies[1]


def _drain(eng: LLMEngine) -> list:
    finished = []
    while eng.has_unfinished_requests():
        finished += [o for o in eng.step() if o.finished]
    return finished


def test_a_draft_with_another_vocabulary_is_refused_at_load(models: dict[str, str], tmp_path: Path) -> None:
    bigger = make_tiny_model(tmp_path / "bigger", "llama", seed=5, vocab_size=640)
    spec = {"model": str(bigger), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=r"cannot draft for .*640 ids, the target's 512.*share the target's tokenizer"):
        LLMEngine.from_pretrained(models["target"], speculative_config=spec)
    # the same size, other tokens
    tok = tiny_tokenizer()
    renamed = tiny_tokenizer()
    renamed.add_tokens(["<extra>"])
    as_loaded = lambda t, name: SimpleNamespace(config=SimpleNamespace(vocab_size=512), tokenizer=t, name=name)  # noqa: E731
    with pytest.raises(ValueError, match=r"differ in 1 token ids \(id \d+ is None for the target, '<extra>' for the"):
        check_vocabulary(as_loaded(tok, "t"), as_loaded(renamed, "d"))
    check_vocabulary(as_loaded(tok, "t"), as_loaded(tiny_tokenizer(), "d"))  # the same: accepted


def test_draft_model_config_as_vllm_takes_it() -> None:
    c = SpeculativeConfig.parse('{"model": "smollm2-135m-instruct", "num_speculative_tokens": 5}')
    assert (c.method, c.model, c.num_speculative_tokens) == ("draft_model", "smollm2-135m-instruct", 5)
    with pytest.raises(ValueError, match="draft_model takes a model"):
        SpeculativeConfig.parse({"method": "draft_model"})
    with pytest.raises(ValueError, match="and only it does"):
        SpeculativeConfig.parse({"method": "ngram", "model": "x"})
    with pytest.raises(ValueError, match="quantization must be"):
        SpeculativeConfig.parse({"model": "x", "quantization": "q3"})


def test_a_sliding_window_model_drafting_for_itself(tmp_path: Path) -> None:
    """Gemma 2's windowed layers: the draft's pool has the target's KV cache groups too."""
    path = str(make_tiny_model(tmp_path / "g", "gemma2", seed=1))
    spec = LLMEngine.from_pretrained(path, speculative_config={"model": path, "num_speculative_tokens": 3},
                                     block_size=4, num_blocks=128)
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)] * 2
    assert _run(spec, PROMPTS[:2], params) == _run(LLMEngine.from_pretrained(path, block_size=4, num_blocks=128),
                                                   PROMPTS[:2], params)
    s = spec.scheduler
    assert s.spec_draft_tokens > 0 and s.spec_accepted_tokens == s.spec_draft_tokens
    assert _proposer(spec).bm.windows == spec.block_manager.windows and len(spec.block_manager.windows) == 2
