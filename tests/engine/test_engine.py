"""LLMEngine end to end: greedy parity with transformers, batch invariance under sharing and
preemption, conversation KV reuse, chunked prefill, and bad input."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLMEngine, ModelNotFoundError, RequestError, SamplingParams
from tests.helpers import TINY_VOCAB, TRITON_ON, drain_checked, make_tiny_model, reference_model

# arch, config overrides: GQA ratio 3 with head_dim 48, head_dim 64 with a tied head and llama3
# RoPE scaling, Qwen2 biases, Qwen3 q/k norm, Mistral, Phi-3, GPT-2 learned positions (tied).
PARITY_MODELS = {
    "llama-gqa3-hd48": ("llama", dict(hidden_size=288, num_attention_heads=6, num_key_value_heads=2)),
    "llama-tied-hd64-llama3rope": (
        "llama",
        dict(
            hidden_size=256,
            num_attention_heads=4,
            num_key_value_heads=4,
            tie_word_embeddings=True,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {}),
    "phi3-window16": ("phi3", dict(sliding_window=16)),  # fused qkv / gate_up tensors, outgrown window
    "gpt2": ("gpt2", {}),
}
MAX_NEW = 32


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("parity")
    return {name: str(make_tiny_model(root / name, arch, **kw)) for name, (arch, kw) in PARITY_MODELS.items()}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("llama") / "m", "llama", max_position_embeddings=512))


def random_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, TINY_VOCAB) for _ in range(n)] for n in lengths]


def assert_greedy_matches(ref, prompt: list[int], ours: list[int], tol: float = 1e-3) -> None:
    """Same ids as transformers' generate; where they differ, the divergence must be a near-tie:
    fed prompt + our output, transformers scores every token we chose within tol of its best."""
    with torch.no_grad():
        theirs = ref.generate(
            torch.tensor([prompt]), max_new_tokens=len(ours), do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
    if theirs == ours:
        return
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1 : -1].float()
    chosen = logits.gather(1, torch.tensor(ours)[:, None])[:, 0]
    gap = (logits.max(dim=1).values - chosen).max().item()
    assert gap <= tol, f"output diverges from transformers beyond a near-tie (gap {gap}):\n{ours}\n{theirs}"


@pytest.mark.parametrize("name", list(PARITY_MODELS))
def test_greedy_parity_torch_backend(model_dirs: dict[str, str], name: str) -> None:
    eng = LLMEngine.from_pretrained(model_dirs[name], attention_backend="torch", block_size=8, num_blocks=128)
    prompts = random_prompts(hash(name) % 1000, [1, 7, 8, 9, 23, 40])
    outs = eng.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    ref = reference_model(model_dirs[name])
    for prompt, out in zip(prompts, outs, strict=True):
        assert len(out.outputs[0].token_ids) == MAX_NEW
        assert_greedy_matches(ref, prompt, out.outputs[0].token_ids)


@pytest.mark.parametrize("name", list(PARITY_MODELS))
def test_greedy_parity_triton_backend(model_dirs: dict[str, str], name: str) -> None:
    # The Triton kernels run interpreted on CPU: slow, so a smaller case.
    eng = LLMEngine.from_pretrained(model_dirs[name], attention_backend="triton", block_size=8, num_blocks=64,
                                    **TRITON_ON)
    prompts = random_prompts(7, [5, 17])
    outs = eng.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    ref = reference_model(model_dirs[name])
    for prompt, out in zip(prompts, outs, strict=True):
        assert_greedy_matches(ref, prompt, out.outputs[0].token_ids)


def test_batch_invariance_under_sharing_and_preemption(llama_dir: str) -> None:
    """16+ requests with shared prefixes, n > 1 groups and forks on a pool small enough to preempt
    several times: every greedy output equals the same request run alone on a large pool."""
    rng = random.Random(3)
    system = [rng.randrange(4, TINY_VOCAB) for _ in range(37)]
    prompts = [system + [rng.randrange(4, TINY_VOCAB) for _ in range(rng.randrange(1, 20))] for _ in range(16)]
    params = [SamplingParams(max_tokens=rng.randrange(8, 24), n=1 + (i % 4 == 0) * 2, ignore_eos=True)
              for i in range(16)]

    alone = []
    for prompt, p in zip(prompts, params):
        solo = LLMEngine.from_pretrained(llama_dir, block_size=4, num_blocks=512)
        alone.append(solo.generate([prompt], p)[0].outputs[0].token_ids)

    eng = LLMEngine.from_pretrained(llama_dir, block_size=4, num_blocks=64, max_num_batched_tokens=64)
    ids = [eng.add_request(prompt, p) for prompt, p in zip(prompts, params)]
    # Two conversations forked from one another, generating next to the requests.
    conv = eng.start_conversation()
    eng.submit_turn(conv, prompts[0], SamplingParams(max_tokens=6, ignore_eos=True))
    done = drain_checked(eng)
    fork = eng.fork_conversation(conv)
    turn = [t for t in done.values() if t.conversation_id == conv][0]
    history = prompts[0] + turn.outputs[0].token_ids
    a = eng.submit_turn(conv, history + [11, 12, 13], SamplingParams(max_tokens=10, ignore_eos=True))
    b = eng.submit_turn(fork, history + [21, 22], SamplingParams(max_tokens=10, ignore_eos=True))
    more = [eng.add_request(prompt, p) for prompt, p in zip(prompts[:4], params[:4])]
    done.update(drain_checked(eng))

    for rid, want, p in zip(ids + more, alone + alone[:4], params + params[:4]):
        out = done[rid]
        assert len(out.outputs) == p.n
        for completion in out.outputs:  # greedy: every sample of a group is the same
            assert completion.token_ids == want, f"{rid} differs from its isolated run"
    solo = LLMEngine.from_pretrained(llama_dir, block_size=4, num_blocks=512)
    assert done[a].outputs[0].token_ids == solo.generate([history + [11, 12, 13]], SamplingParams(
        max_tokens=10, ignore_eos=True))[0].outputs[0].token_ids
    assert done[b].outputs[0].token_ids == solo.generate([history + [21, 22]], SamplingParams(
        max_tokens=10, ignore_eos=True))[0].outputs[0].token_ids
    snap = eng.cache_snapshot()
    print(f"preemptions={snap.preemptions} cow_copies={snap.cow_copies} hit_rate={snap.hit_rate:.2f}")
    assert snap.preemptions >= 3
    assert snap.cow_copies >= 3
    assert snap.prefix_cache_hits > 0


def test_conversation_turns_prefill_only_new_tokens(llama_dir: str) -> None:
    eng = LLMEngine.from_pretrained(llama_dir, block_size=8, num_blocks=256)
    bs = 8
    system = "You are a helpful assistant that answers in short words. " * 6
    conv = eng.start_conversation()
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "hello there"}]
    first = _drain_one(eng, eng.submit_turn(conv, msgs, SamplingParams(max_tokens=12, ignore_eos=True)))
    assert first.usage.prefilled_tokens == first.usage.prompt_tokens
    msgs += [{"role": "assistant", "content": first.outputs[0].text}, {"role": "user", "content": "and then?"}]
    second = _drain_one(eng, eng.submit_turn(conv, msgs, SamplingParams(max_tokens=12, ignore_eos=True)))
    # New = past what the conversation holds (prompt 1 + reply 1); a reply whose text re-tokenizes
    # differently counts from the first differing token.
    held = first.prompt_token_ids + first.outputs[0].token_ids
    prompt2 = second.prompt_token_ids
    assert prompt2[: len(first.prompt_token_ids)] == first.prompt_token_ids
    same = next((i for i, (x, y) in enumerate(zip(held, prompt2)) if x != y), min(len(held), len(prompt2)))
    new_tokens = len(prompt2) - same
    print(f"turn 2: prompt {second.usage.prompt_tokens}, new {new_tokens}, prefilled {second.usage.prefilled_tokens}")
    assert second.usage.prefilled_tokens <= new_tokens + bs
    # The reply's own tokens are kept even where its text would re-tokenize differently.
    assert prompt2[: len(held) - 1] == held[:-1]

    # Regenerating the reply (same history as turn 2) recomputes nothing but the last prompt token.
    again = _drain_one(eng, eng.submit_turn(conv, msgs, SamplingParams(max_tokens=4, n=3, ignore_eos=True)))
    assert again.prompt_token_ids == second.prompt_token_ids and again.usage.prefilled_tokens == 1

    # A second conversation with the same system prompt reuses its blocks through the prefix cache.
    sys_len = len(eng.render_chat([{"role": "system", "content": system}])) - 3  # minus the generation prompt
    assert sys_len >= 200 // 4
    other = eng.start_conversation()
    third = _drain_one(eng, eng.submit_turn(other, [msgs[0], {"role": "user", "content": "something else"}],
                                            SamplingParams(max_tokens=4, ignore_eos=True)))
    print(f"second conversation: prompt {third.usage.prompt_tokens}, prefilled {third.usage.prefilled_tokens}")
    assert third.usage.prefilled_tokens <= third.usage.prompt_tokens - (sys_len // bs) * bs


def test_system_prompt_of_200_tokens_is_shared(llama_dir: str) -> None:
    eng = LLMEngine.from_pretrained(llama_dir, block_size=16, num_blocks=256)
    system = random_prompts(5, [200])[0]
    a = _drain_one(eng, eng.submit_turn(eng.start_conversation(), system + [7, 8, 9], SamplingParams(max_tokens=4)))
    b = _drain_one(eng, eng.submit_turn(eng.start_conversation(), system + [5, 6, 7, 8, 9, 10],
                                        SamplingParams(max_tokens=4)))
    assert a.usage.prefilled_tokens == 203
    print(f"second conversation with a 200-token system prompt prefilled {b.usage.prefilled_tokens} of 206")
    # every system-prompt token is reused: the 12 full blocks and the 8 tokens of the partly filled
    # 13th (shared from the first conversation, copied on the second's first write into it)
    assert b.usage.prefilled_tokens == 206 - 200


def test_fork_shares_every_block_until_it_diverges(llama_dir: str) -> None:
    eng = LLMEngine.from_pretrained(llama_dir, block_size=8, num_blocks=128)
    conv = eng.start_conversation()
    prompt = random_prompts(9, [45])[0]
    first = _drain_one(eng, eng.submit_turn(conv, prompt, SamplingParams(max_tokens=10, ignore_eos=True)))
    used_before = eng.cache_snapshot().used_blocks
    fork = eng.fork_conversation(conv)
    snap = eng.cache_snapshot()
    parent_blocks = eng.conversations[conv].seqs[0].block_table
    child_blocks = eng.conversations[fork].seqs[0].block_table
    assert child_blocks == parent_blocks and snap.used_blocks == used_before  # zero-copy
    assert all(snap.refcount[b] == 2 and set(snap.owners[b]) == {conv, fork} for b in parent_blocks)
    history = prompt + first.outputs[0].token_ids
    _drain_one(eng, eng.submit_turn(fork, history + [30, 31], SamplingParams(max_tokens=3, ignore_eos=True)))
    child_blocks = eng.conversations[fork].seqs[0].block_table
    shared = set(parent_blocks) & set(child_blocks)
    assert len(shared) == (len(prompt) + 10 - 1) // 8  # the full blocks stay shared; the partial one was copied
    assert eng.cache_snapshot().cow_copies == 1


def test_requests_arriving_together_compute_a_shared_prefix_once(llama_dir: str) -> None:
    eng = LLMEngine.from_pretrained(llama_dir, block_size=8, num_blocks=256)
    system, *users = random_prompts(11, [64, 5, 6, 7, 8])
    outs = eng.generate([system + u for u in users], SamplingParams(max_tokens=4, ignore_eos=True))
    # The first computes the 64 shared tokens; the others wait one step and hit the cache.
    assert eng.prefill_tokens == 64 + sum(map(len, users))
    solo = LLMEngine.from_pretrained(llama_dir, block_size=8, num_blocks=256, enable_prefix_caching=False)
    alone = solo.generate([system + u for u in users], SamplingParams(max_tokens=4, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone]
    assert solo.prefill_tokens == 4 * 64 + sum(map(len, users))


def test_decodes_sharing_a_prefix_attend_it_once(llama_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four requests on one 100-token system prompt: their decodes pass the 12 shared blocks to the
    attention as one group (cascade), and every output equals the run that shares nothing."""
    from engine import model_runner

    groups: list[list[tuple[list[int], int]]] = []
    plan = model_runner.plan_decode

    def spy(*args):
        groups.append([(p.seqs.tolist(), p.blocks.numel()) for p in args[5]])
        return plan(*args)

    monkeypatch.setattr(model_runner, "plan_decode", spy)
    monkeypatch.setattr(model_runner, "MIN_SHARED_KEYS", 64)  # this short prompt qualifies
    monkeypatch.setattr(model_runner, "MIN_SAVED_KEYS", 64)
    system, *users = random_prompts(12, [100, 3, 9, 17, 30])
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    eng = LLMEngine.from_pretrained(llama_dir, block_size=8, num_blocks=256, speculative_config=None)  # one row each
    outs = eng.generate([system + u for u in users], params)
    assert ([0, 1, 2, 3], 12) in [g for step in groups for g in step]
    groups.clear()
    solo = LLMEngine.from_pretrained(llama_dir, block_size=8, num_blocks=256, enable_prefix_caching=False,
                                     speculative_config=None)
    alone = solo.generate([system + u for u in users], params)
    assert not any(groups)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone]


def test_find_shared_prefixes(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine import model_runner
    from engine.model_runner import find_shared_prefixes

    bs = 16
    monkeypatch.setattr(model_runner, "MIN_SHARED_KEYS", bs)
    monkeypatch.setattr(model_runner, "MIN_SAVED_KEYS", 2 * bs)
    tables = [[5, 6, 7, 1], [5, 6, 7, 2], [5, 6, 3], [9, 4], [9, 8], [5, 6, 7, 0]]
    ctx = [4 * bs, 3 * bs + 1, 2 * bs + 1, 2 * bs, 2 * bs, 2 * bs]
    # the last sequence's current token is in block 1: the group {0, 1, 2, 5} stops there;
    # {3, 4} share one block, but one block's keys read once more save too little
    assert find_shared_prefixes(tables, ctx, bs) == [([0, 1, 2, 5], 1)]
    ctx[5] = 4 * bs
    assert find_shared_prefixes(tables, ctx, bs) == [([0, 1, 2, 5], 2)]
    assert find_shared_prefixes(tables[:1], ctx[:1], bs) == []
    monkeypatch.setattr(model_runner, "MIN_SHARED_KEYS", 3 * bs)  # a prefix too short to pay
    assert find_shared_prefixes(tables, ctx, bs) == []


def test_chunked_prefill_does_not_stall_decodes(llama_dir: str) -> None:
    eng = LLMEngine.from_pretrained(llama_dir, block_size=8, num_blocks=256, max_num_batched_tokens=32)
    short, long = random_prompts(4, [5, 300])
    a = eng.add_request(short, SamplingParams(max_tokens=30, ignore_eos=True))
    eng.step()  # a is decoding from now on
    b = eng.add_request(long, SamplingParams(max_tokens=5, ignore_eos=True))
    steps_while_b_prefills = 0
    while eng.groups[b].seqs[0].num_output_tokens == 0:
        before = len(eng.groups[a].seqs[0])
        eng.step()
        assert len(eng.groups[a].seqs[0]) > before, "a running decode was stalled by a prefill"  # (guesses: more)
        steps_while_b_prefills += 1
    assert steps_while_b_prefills >= 300 // 32
    done = drain_checked(eng)
    solo = LLMEngine.from_pretrained(llama_dir, block_size=8, num_blocks=256)
    want = solo.generate([long], SamplingParams(max_tokens=5, ignore_eos=True))[0].outputs[0].token_ids
    assert done[b].outputs[0].token_ids == want


def _drain_one(eng: LLMEngine, rid: str):
    return drain_checked(eng)[rid]


def test_bad_input_gets_specific_errors_and_the_engine_keeps_serving(llama_dir: str, tmp_path) -> None:
    eng = LLMEngine.from_pretrained(llama_dir, block_size=8, num_blocks=40)  # 320 slots
    ok = eng.add_request([5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True))
    with pytest.raises(RequestError, match="prompt is 400 tokens"):
        eng.add_request(list(range(4, 404)), SamplingParams(max_tokens=4))
    with pytest.raises(RequestError, match="lower max_tokens"):
        eng.add_request([5, 6, 7], SamplingParams(max_tokens=1000))
    with pytest.raises(RequestError, match="need up to .* KV blocks"):
        eng.add_request([5] * 100, SamplingParams(max_tokens=100, n=8))
    with pytest.raises(RequestError, match="empty"):
        eng.add_request([], SamplingParams(max_tokens=4))
    with pytest.raises(RequestError, match="empty"):
        eng.add_request("", SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    ok2 = eng.add_request([8, 9], SamplingParams(max_tokens=4, ignore_eos=True))
    done = drain_checked(eng)
    assert len(done[ok].outputs[0].token_ids) == 6 and len(done[ok2].outputs[0].token_ids) == 4
    assert eng.block_manager.num_free_blocks == 40

    with pytest.raises(ModelNotFoundError, match="no/such/model"):
        LLMEngine.from_pretrained(str(tmp_path / "no/such/model"))
    weird = make_tiny_model(tmp_path / "weird", "llama")
    cfg = (weird / "config.json").read_text().replace("LlamaForCausalLM", "FancyNewForCausalLM")
    (weird / "config.json").write_text(cfg)
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        LLMEngine.from_pretrained(str(weird))


def test_a_failing_request_does_not_take_down_the_others(llama_dir: str) -> None:
    eng = LLMEngine.from_pretrained(llama_dir, block_size=8, num_blocks=64)
    good = eng.add_request([5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))
    bad = eng.add_request([9, 10, 11], SamplingParams(max_tokens=8, ignore_eos=True))
    eng.step()

    def explode(token_id: int) -> str:
        raise RuntimeError("injected failure")

    eng.outputs.detokenizer(eng.groups[bad].seqs[0]).append = explode
    done = drain_checked(eng)
    assert done[bad].error and "injected failure" in done[bad].error
    assert len(done[good].outputs[0].token_ids) == 8 and done[good].error is None
    assert eng.block_manager.num_free_blocks == 64


def test_sampling_seed_is_reproducible_whatever_the_batch(llama_dir: str) -> None:
    eng = LLMEngine.from_pretrained(llama_dir, block_size=8, num_blocks=128)
    p = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = eng.generate([[5, 6, 7]], p)[0].outputs[0].token_ids
    crowd = eng.generate([[9, 9], [5, 6, 7], [1, 2, 3, 4]], [SamplingParams(max_tokens=5, temperature=1.0), p,
                                                           SamplingParams(max_tokens=20, temperature=0.7)])
    assert crowd[1].outputs[0].token_ids == alone
    group = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=12, temperature=1.0, n=3, seed=1234,
                                                     ignore_eos=True))[0]
    assert len({tuple(o.token_ids) for o in group.outputs}) > 1, "n samples should differ"


def test_two_engines_on_one_loaded_model_keep_their_own_caches(llama_dir: str) -> None:
    from engine import EngineConfig
    from engine.weights.loader import load_model

    loaded = load_model(llama_dir)
    prompt = random_prompts(12, [40])[0]
    p = SamplingParams(max_tokens=8, ignore_eos=True)
    a = LLMEngine(loaded, EngineConfig(block_size=8, num_blocks=64))
    first = a.generate([prompt], p)[0].outputs[0].token_ids
    b = LLMEngine(loaded, EngineConfig(block_size=8, num_blocks=64))
    b.generate([[5, 6, 7]], p)
    # a's prefix-cache hits must read a's pool, not b's
    assert a.generate([prompt], p)[0].outputs[0].token_ids == first
    assert a.block_manager.prefix_hits > 0


def test_unseeded_sampling_differs_between_engines_and_an_engine_seed_repeats(llama_dir: str) -> None:
    """sampling.seed = -1 must not repeat across launches (torch's start-up RNG seed is a constant)."""
    prompt = [[5, 6, 7, 8, 9, 10]]
    params = SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True)

    def sample(**engine_options) -> list[int]:
        eng = LLMEngine.from_pretrained(llama_dir, block_size=8, num_blocks=32, **engine_options)
        return eng.generate(prompt, params)[0].outputs[0].token_ids

    assert sample() != sample()
    assert sample(seed=5) == sample(seed=5)


def test_cow_copies_with_a_block_both_source_and_destination_are_exact(llama_dir: str) -> None:
    """copy_blocks' contract (kernels/__init__.py): "A dst block must not also be a src". The Triton
    kernel copies all pairs in parallel, so a block that is both is read and written concurrently.

    Two forked conversations each copy-on-write their shared partial block in one step. The first
    CoW leaves the source block held only by a parked conversation; the second sequence's plan does
    not fit, so the scheduler reclaims that parked conversation, which frees the source block, and
    the second CoW takes it as its destination: pending_copies == [(1, 4), (3, 1)]."""
    eng = LLMEngine.from_pretrained(llama_dir, block_size=4, num_blocks=5)
    p = SamplingParams(max_tokens=4, ignore_eos=True)
    eng.submit_turn(eng.start_conversation("B"), [5, 6, 7], p)  # 7 tokens, 6 computed: blocks [full, partial]
    drain_checked(eng)
    eng.submit_turn(eng.start_conversation("D"), [8, 9, 10], p)
    drain_checked(eng)
    assert eng.block_manager.num_free_blocks == 1
    eng.fork_conversation("B", "A")  # A shares B's partial block, C shares D's
    eng.fork_conversation("D", "C")

    batches: list[list[tuple[int, int]]] = []
    real_copy = eng.runner.copy_blocks

    def record(pairs):
        batches.append(list(pairs))
        before = {s: eng.runner.k_cache[:, s].clone() for s, _ in pairs}
        real_copy(pairs)
        for s, d in pairs:  # every destination got its source's contents from before the copies
            assert torch.equal(eng.runner.k_cache[:, d], before[s])

    eng.runner.copy_blocks = record
    q = SamplingParams(max_tokens=1, ignore_eos=True)
    eng.submit_turn("A", eng.conversations["A"].seqs[0].token_ids + [11], q)
    eng.submit_turn("C", eng.conversations["C"].seqs[0].token_ids + [12], q)
    drain_checked(eng)
    assert batches, "expected copy-on-write"
    # The case this test builds: a block freed this step is one copy's source and another's target.
    assert any({s for s, _ in pairs} & {d for _, d in pairs} for pairs in batches)


def test_overlapping_copies_take_the_gather_first_path(llama_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.model_runner as mr

    eng = LLMEngine.from_pretrained(llama_dir, block_size=4, num_blocks=16)
    calls = []
    monkeypatch.setattr(mr, "copy_blocks", lambda *a, **kw: calls.append(kw.get("backend")))
    eng.runner.copy_blocks([(1, 2), (3, 4)])
    eng.runner.copy_blocks([(1, 4), (3, 1)])  # block 1 is read and written: never copied in parallel
    assert calls == [None, "torch"]


def test_abort_whose_flush_fails_does_not_leave_a_zombie_sequence(llama_dir: str) -> None:
    """_finish sets finish_reason before the steps that can raise (detokenizer.flush, then
    scheduler.remove). abort() is not wrapped like _append_tokens is, so when the flush raises the
    sequence stays in scheduler.running with finish_reason "abort": the group is reported finished
    and deleted, but the sequence keeps being scheduled, and the next step's _collect_finished hits
    `del self.groups[...]` -> KeyError (in EngineThread: fail_all for every other request, each step)."""
    import contextlib

    eng = LLMEngine.from_pretrained(llama_dir, block_size=4, num_blocks=64)
    a = eng.add_request([5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True))
    b = eng.add_request([8, 9, 10], SamplingParams(max_tokens=12, ignore_eos=True))
    eng.step()
    seq = eng.groups[a].seqs[0]

    def broken_flush() -> str:
        raise RuntimeError("injected detokenizer failure")

    eng.outputs.detokenizer(seq).flush = broken_flush
    with contextlib.suppress(RuntimeError):
        eng.abort(a)
    done = drain_checked(eng)  # KeyError: 'req-0' on the code as reviewed
    assert seq not in eng.scheduler.running
    assert done[b].error is None and len(done[b].outputs[0].token_ids) == 12
    assert eng.block_manager.num_free_blocks == 64


def test_num_threads_sets_torch_threads_and_zero_leaves_them(llama_dir: str) -> None:
    before = torch.get_num_threads()
    try:
        LLMEngine.from_pretrained(llama_dir, num_threads=1, num_blocks=16)
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        LLMEngine.from_pretrained(llama_dir, num_blocks=16)
        assert torch.get_num_threads() == 2
        with pytest.raises(ValueError, match="num_threads"):
            LLMEngine.from_pretrained(llama_dir, num_threads=-1)
    finally:
        torch.set_num_threads(before)
