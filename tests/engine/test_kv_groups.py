"""Sliding-window layers in the paged KV cache (engine/kv_groups.py): a tiny random Gemma 2 (4 layers
alternating a window of 8 tokens and full attention, block size 4) keeps a full and a windowed KV cache
group; the windowed group's blocks out of the window go back to the pool. Outputs must not change: every
test compares with the same request run alone on a large pool, or with transformers."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.block_manager import cdiv
from engine.kv_groups import KVLayout, first_needed_block
from engine.weights.loader import load_model
from tests.helpers import TINY_VOCAB, TRITON_ON, drain_checked, reference_model

BS, WINDOW = 4, 8


@pytest.fixture(autouse=True)
def _one_cpu_thread():
    """Tiny tensors: a second OpenMP thread only adds synchronisation (see test_gemma.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def gemma2(tiny_model_factory):
    path = tiny_model_factory("gemma2")
    return SimpleNamespace(path=path, loaded=load_model(str(path)), ref=reference_model(path))


def _engine(gemma2, num_blocks: int, **config) -> LLMEngine:
    return LLMEngine(gemma2.loaded, EngineConfig(block_size=BS, num_blocks=num_blocks, **config))


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, TINY_VOCAB) for _ in range(n)] for n in lengths]


def _alone(gemma2, prompt: list[int], params: SamplingParams) -> list[int]:
    return _engine(gemma2, 256).generate([prompt], params)[0].outputs[0].token_ids


def test_layout_groups_layers_by_window() -> None:
    gemma2 = KVLayout.of([8, None, 8, None])
    assert gemma2.windows == (None, 8) and gemma2.layer_group == (1, 0, 1, 0) and gemma2.layer_slot == (0, 0, 1, 1)
    assert gemma2.slots == 2 and gemma2.names() == ("full", "window 8")
    gemma3 = KVLayout.of([8, 8, None, 8])  # one global layer: its pages use one of three slots
    assert gemma3.windows == (None, 8) and gemma3.slots == 3 and gemma3.layer_slot == (0, 1, 0, 2)
    llama = KVLayout.of([None] * 3)
    assert llama.windows == (None,) and llama.layer_slot == (0, 1, 2)
    assert [first_needed_block(p, WINDOW, BS) for p in (0, 7, 8, 11, 12)] == [0, 0, 0, 1, 1]


def test_a_long_generation_holds_the_window_only(gemma2) -> None:
    """150 greedy tokens past a window of 8: the windowed group never holds more than the window's blocks
    plus the one being written, the full group holds every block, and the tokens are transformers'."""
    eng = _engine(gemma2, 256)
    assert eng.runner.k_cache.shape[0] == 2  # a page holds 2 layers: one full and one windowed
    prompt = _prompts(1, [20])[0]
    eng.add_request(prompt, SamplingParams(max_tokens=150, ignore_eos=True))
    bm, peak_window, peak_used, out = eng.block_manager, 0, 0, None
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o
        for seq in bm.holders.values():
            full, window = seq.block_tables
            assert len(full) == len(window) and bm.null_block not in full
            held = [b for b in window if b != bm.null_block]
            peak_window = max(peak_window, len(held))
            if seq.num_output_tokens > 1:  # decoding: the window of 8 covers at most 3 blocks of 4, + 1 written
                assert len(held) <= cdiv(WINDOW, BS) + 1
                if seq.num_output_tokens == 100:  # the visualiser's view: the window's blocks came back, cached
                    snap = eng.cache_snapshot()
                    assert snap.group_blocks() == [len(full), len(held)] and snap.cached_blocks >= 20
        peak_used = max(peak_used, bm.num_usable_blocks - bm.num_free_blocks)
        bm.check_invariants()
    tokens = cdiv(len(prompt) + 150, BS)
    print(f"peak blocks: full group {tokens}, windowed group {peak_window} (all {peak_used} of 2-layer pages; "
          f"without groups {tokens} 4-layer blocks = {2 * tokens} 2-layer pages)")
    assert peak_window == cdiv(len(prompt), BS)  # the prompt's prefill, before its window slides
    assert peak_used <= tokens + peak_window
    with torch.no_grad():
        want = gemma2.ref.generate(torch.tensor([prompt]), max_new_tokens=150, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)[0, len(prompt):].tolist()
    assert out.outputs[0].token_ids == want
    snap = eng.cache_snapshot()
    assert snap.group_names == ("full", "window 8") and len(snap.group) == bm.num_blocks


def test_batch_invariance_under_sharing_and_preemption(gemma2) -> None:
    """Requests sharing a prefix longer than the window, n > 1 groups and forked conversations on a pool
    small enough to preempt: every greedy output equals the same request run alone on a large pool."""
    rng = random.Random(3)
    system = _prompts(2, [21])[0]
    prompts = [system + _prompts(10 + i, [rng.randrange(1, 14)])[0] for i in range(10)]
    params = [SamplingParams(max_tokens=rng.randrange(10, 30), n=1 + (i % 4 == 0) * 2, ignore_eos=True)
              for i in range(10)]
    alone = [_alone(gemma2, p, sp) for p, sp in zip(prompts, params)]
    eng = _engine(gemma2, 72, max_num_batched_tokens=48)
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    conv = eng.start_conversation()
    eng.submit_turn(conv, prompts[1], SamplingParams(max_tokens=12, ignore_eos=True))
    done = drain_checked(eng)
    fork = eng.fork_conversation(conv)
    history = prompts[1] + [o for o in done.values() if o.conversation_id == conv][0].outputs[0].token_ids
    turn = SamplingParams(max_tokens=14, ignore_eos=True)
    a = eng.submit_turn(conv, history + [11, 12, 13], turn)
    b = eng.submit_turn(fork, history + [21, 22], turn)
    more = [eng.add_request(p, sp) for p, sp in zip(prompts[:4], params[:4])]
    done.update(drain_checked(eng))
    for rid, want, sp in zip(ids + more, alone + alone[:4], params + params[:4]):
        assert [c.token_ids for c in done[rid].outputs] == [want] * sp.n, f"{rid} differs from its isolated run"
    assert done[a].outputs[0].token_ids == _alone(gemma2, history + [11, 12, 13], turn)
    assert done[b].outputs[0].token_ids == _alone(gemma2, history + [21, 22], turn)
    snap = eng.cache_snapshot()
    print(f"preemptions={snap.preemptions} cow_copies={snap.cow_copies} hit_rate={snap.hit_rate:.2f}")
    assert snap.preemptions >= 2 and snap.cow_copies >= 1 and snap.prefix_cache_hits > 0


def test_a_prefix_hit_past_the_window_needs_only_the_windows_blocks(gemma2) -> None:
    """A second request with the first's 40 tokens (10 blocks) hits them all: the full group's ten and the
    windowed group's blocks in the window of the hit's end, released by the first but still cached."""
    eng = _engine(gemma2, 128)
    first, second = (_prompts(4, [40])[0] + tail for tail in ([5, 6], [7, 8, 9]))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    eng.generate([first], params)
    out = eng.generate([second], params)[0]
    assert out.usage.prefilled_tokens == 3  # the 40 shared tokens came from the cache
    assert out.outputs[0].token_ids == _alone(gemma2, second, params)


def test_speculation_and_conversation_turns_on_a_windowed_model(gemma2) -> None:
    """Prompt-lookup guesses appended and rolled back across window slides, then a second turn of the same
    conversation cut back into its history: the same tokens as plain decoding, run alone."""
    phrase = _prompts(5, [6])[0]
    prompt = phrase * 5  # repeats: the proposer guesses its next tokens
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    spec = _engine(gemma2, 128, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    conv = spec.start_conversation()
    spec.submit_turn(conv, prompt, params)
    first = drain_checked(spec)
    reply = list(first.values())[0].outputs[0].token_ids
    assert reply == _alone(gemma2, prompt, params)
    assert spec.scheduler.spec_draft_tokens > spec.scheduler.spec_accepted_tokens  # guesses were rolled back
    # the next turn drops the reply's last 10 tokens (an edit): the windowed group gave back the blocks that
    # position sees, so the sequence is recomputed, its blocks found again in the prefix cache
    history = prompt + reply[:-10] + [17, 18]
    spec.submit_turn(conv, history, params)
    second = list(drain_checked(spec).values())[0]
    assert second.outputs[0].token_ids == _alone(gemma2, history, params)
    assert second.usage.prefilled_tokens <= 2 + BS


def test_triton_kernels_never_read_the_null_block(gemma2) -> None:
    """The Triton decode and prefill kernels attend only in-window keys: with the null block poisoned (NaN),
    two sequences decoding past the window (interpreted on the CPU, compiled on a GPU) still give the PyTorch
    path's tokens on the same device."""
    pytest.importorskip("triton")
    prompts = _prompts(6, [13, 22])
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    opts = dict(block_size=BS, num_blocks=64, **TRITON_ON)
    want = LLMEngine.from_pretrained(str(gemma2.path), attention_backend="torch", **opts).generate(prompts, params)
    eng = LLMEngine.from_pretrained(str(gemma2.path), attention_backend="triton", **opts)
    assert eng.block_manager.null_block == 0
    eng.runner.k_cache[:, 0] = float("nan")
    eng.runner.v_cache[:, 0] = float("nan")
    got = eng.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
