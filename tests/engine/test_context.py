"""Conversations never get stuck on the context: replies are clamped to what fits, the oldest turns
(never the system prompt) are left out once the history outgrows the context, and the kept part's
KV is reused; a single message longer than the context is refused without harming the conversation."""

from __future__ import annotations

import pytest

from engine import ContextLengthError, LLMEngine, SamplingParams
from engine.conversations import common_prefix_len
from tests.helpers import drain_checked, make_tiny_model

SYSTEM = {"role": "system", "content": "You are terse."}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    # a 256-token context: a few turns outgrow it
    return str(make_tiny_model(tmp_path_factory.mktemp("ctx") / "m", "llama", max_position_embeddings=256))


def _turn(eng: LLMEngine, cid: str, messages: list[dict[str, str]], max_tokens: int = 16):
    rid = eng.submit_turn(cid, messages, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    group = eng.groups[rid]
    dropped, clamped, max_tokens = group.dropped_messages, group.max_tokens_clamped, group.params.max_tokens
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished and out.request_id == rid:
                result = out
        eng.block_manager.check_invariants()
    return result, dropped, clamped, max_tokens


def test_oldest_turns_are_left_out_and_the_window_moves_forward_only(model_dir: str) -> None:
    eng = LLMEngine.from_pretrained(model_dir, block_size=8, num_blocks=128)
    assert eng.max_model_len == 256
    cid = eng.start_conversation()
    history: list[dict[str, str]] = []
    seen_drops = []
    prefilled_after_drop = []
    for i in range(14):
        history.append({"role": "user", "content": f"question number {i} about the cat and the dog " * 2})
        out, dropped, clamped, _ = _turn(eng, cid, [SYSTEM, *history])
        assert len(out.prompt_token_ids) + out.usage.completion_tokens <= eng.max_model_len
        assert not clamped  # room for the whole reply is kept when turns are dropped
        # the system prompt is always what the model sees first
        text = eng.tokenizer.decode(out.prompt_token_ids)
        assert text.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n"), text
        if dropped:
            assert history[dropped]["role"] == "user"  # the kept part starts with a user turn
            kept = eng.tokenizer.apply_chat_template([SYSTEM, *history[dropped:]], tokenize=False,
                                                     add_generation_prompt=True)
            assert text == kept
        if seen_drops and dropped == seen_drops[-1] and dropped:
            prefilled_after_drop.append((out.usage.prefilled_tokens, out.usage.prompt_tokens))
        assert not seen_drops or dropped >= seen_drops[-1]  # forward only
        seen_drops.append(dropped)
        history.append({"role": "assistant", "content": out.outputs[0].text})
    assert seen_drops[-1] > 0, seen_drops
    # After a drop, half the context is free: the next turns append to the kept part and reuse its KV.
    assert prefilled_after_drop, seen_drops
    for prefilled, prompt in prefilled_after_drop:
        assert prefilled < prompt // 2, (prefilled, prompt)


def test_reply_is_clamped_to_what_the_context_leaves(model_dir: str) -> None:
    eng = LLMEngine.from_pretrained(model_dir, block_size=8, num_blocks=128)
    cid = eng.start_conversation()
    out, dropped, clamped, max_tokens = _turn(eng, cid, [SYSTEM, {"role": "user", "content": "hi"}], 1000)
    assert clamped and dropped == 0
    assert max_tokens == eng.max_model_len - len(out.prompt_token_ids)
    assert out.outputs[0].finish_reason == "length" and out.usage.completion_tokens == max_tokens


def test_small_pool_clamps_instead_of_failing(model_dir: str) -> None:
    """A pool smaller than the model's context is the context: a turn still gets a reply."""
    eng = LLMEngine.from_pretrained(model_dir, block_size=8, num_blocks=12)  # 96 tokens
    assert eng.max_model_len == 96
    cid = eng.start_conversation()
    out, _, clamped, _ = _turn(eng, cid, [SYSTEM, {"role": "user", "content": "tell me a long story " * 3}], 512)
    assert clamped and out.usage.completion_tokens > 0


def test_a_message_longer_than_the_context_is_refused_and_the_chat_goes_on(model_dir: str) -> None:
    eng = LLMEngine.from_pretrained(model_dir, block_size=8, num_blocks=128)
    cid = eng.start_conversation()
    first, *_ = _turn(eng, cid, [SYSTEM, {"role": "user", "content": "hello"}])
    history = [SYSTEM, {"role": "user", "content": "hello"}, {"role": "assistant", "content": first.outputs[0].text}]
    huge = {"role": "user", "content": "word " * 400}
    with pytest.raises(ContextLengthError, match=r"the message is \d+ tokens .* the context holds 256") as info:
        eng.submit_turn(cid, [*history, huge], SamplingParams(max_tokens=8))
    assert info.value.code == "context_length_exceeded"
    # The conversation is intact: the next turn (without the refused message) reuses its KV.
    out, dropped, *_ = _turn(eng, cid, [*history, {"role": "user", "content": "and now?"}])
    assert dropped == 0 and out.usage.prefilled_tokens < out.usage.prompt_tokens // 2


def test_new_conversations_share_a_short_system_prompt_partial_block_included(model_dir: str) -> None:
    """A system prompt shorter than a block still saves its prefill in every new conversation:
    the partly filled block is shared (refcount 2) until the new turn writes into it (one CoW copy),
    and the replies are those of conversations computed alone."""
    eng = LLMEngine.from_pretrained(model_dir, block_size=16, num_blocks=64)
    system = {"role": "system", "content": "Be kind."}
    first_cid = eng.start_conversation()
    first, *_ = _turn(eng, first_cid, [system, {"role": "user", "content": "hello there"}])
    cow_before = eng.block_manager.cow_copies
    second_cid = eng.start_conversation()
    second, *_ = _turn(eng, second_cid, [system, {"role": "user", "content": "something else"}])
    common = common_prefix_len(first.prompt_token_ids, second.prompt_token_ids)
    assert common % 16, common  # the shared prefix ends inside a block the prefix cache cannot give
    assert second.usage.prompt_tokens - second.usage.prefilled_tokens == common
    assert eng.block_manager.cow_copies == cow_before + 1
    alone = LLMEngine.from_pretrained(model_dir, block_size=16, num_blocks=64)
    ref, *_ = _turn(alone, alone.start_conversation(), [system, {"role": "user", "content": "something else"}])
    assert second.outputs[0].token_ids == ref.outputs[0].token_ids
    assert eng.block_manager.prefix_hits >= second.usage.prompt_tokens - second.usage.prefilled_tokens


def test_stop_token_id_is_not_spliced_into_the_next_turn(model_dir: str) -> None:
    """A reply ended by a stop_token_id keeps that token in token_ids, but chat_text (the text the
    sequence is said to spell) leaves it out. _chat_tokens strips only an EOS, so the next turn's
    prompt carries a token that is neither in the rendered history nor in what the user saw."""
    eng = LLMEngine.from_pretrained(model_dir, block_size=4, num_blocks=64)
    msgs = [{"role": "user", "content": "hello there"}]
    first = eng.generate([eng.render_chat(msgs)], SamplingParams(max_tokens=1, ignore_eos=True))[0]
    stop_token = first.outputs[0].token_ids[0]  # greedy: the reply's first token

    conv = eng.start_conversation()
    rid = eng.submit_turn(conv, msgs, SamplingParams(max_tokens=8, stop_token_ids=[stop_token]))
    out = drain_checked(eng)[rid]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text == ""

    msgs2 = msgs + [{"role": "assistant", "content": out.outputs[0].text}, {"role": "user", "content": "and?"}]
    eng.submit_turn(conv, msgs2, SamplingParams(max_tokens=2))
    prompt2 = eng.conversations[conv].seqs[0].token_ids
    assert prompt2 == eng.render_chat(msgs2), f"stop token {stop_token} spliced into the next turn's prompt"


def test_a_conversation_takes_a_new_turn_right_after_an_abort(model_dir: str) -> None:
    """Abort and submit in one go (one command batch of the engine thread): the new turn starts,
    and the aborted one still gets its final output, marked aborted."""
    eng = LLMEngine.from_pretrained(model_dir, block_size=4, num_blocks=256)
    conv = eng.start_conversation()
    first = eng.submit_turn(conv, [5, 6, 7, 8, 9], SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        eng.step()
    eng.abort(first)
    history = eng.conversations[conv].seqs[0].token_ids
    second = eng.submit_turn(conv, history + [10, 11], SamplingParams(max_tokens=4, ignore_eos=True))
    done = drain_checked(eng)
    assert done[first].outputs[0].finish_reason == "abort"
    assert done[second].outputs[0].finish_reason == "length" and len(done[second].outputs[0].token_ids) == 4
    assert eng.conversations[conv].request_id is None
    eng.submit_turn(conv, [5], SamplingParams(max_tokens=50))
    with pytest.raises(Exception, match="still generating"):  # a turn that is running still refuses
        eng.submit_turn(conv, [5, 6], SamplingParams(max_tokens=50))


def test_score_refuses_what_does_not_fit_and_keeps_the_pool_whole(model_dir: str) -> None:
    """score() on a pool too small, past the context or outside the vocabulary: a clear error, and
    every block is still free (it used to take blocks, raise a bare KeyError and keep them)."""
    from engine import RequestError

    eng = LLMEngine.from_pretrained(model_dir, num_blocks=8, block_size=4, device="cpu")
    eng.start_conversation("c")
    _turn(eng, "c", [{"role": "user", "content": "hi"}], max_tokens=8)  # the parked chat keeps its blocks
    free = eng.block_manager.num_free_blocks
    assert free < 6
    with pytest.raises(RequestError, match="free KV blocks"):
        eng.score(list(range(1, 25)))  # 24 tokens: 6 blocks of 4
    with pytest.raises(ContextLengthError):
        eng.score(list(range(1, 300)))
    with pytest.raises(RequestError, match="token ids"):
        eng.score([1, 2, 10**6])
    assert eng.block_manager.num_free_blocks == free
    eng.block_manager.check_invariants()
    assert eng.score([1, 2, 3]).shape[0] == 3  # what fits still scores
    assert eng.block_manager.num_free_blocks == free


def test_a_model_without_a_chat_template_chats_through_a_plain_one(tmp_path) -> None:
    """A base model's tokenizer has no chat template: turns go through a plain one, and the engine says so once."""
    import json

    path = make_tiny_model(tmp_path / "base", "llama")
    config = path / "tokenizer_config.json"
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "chat_template"}))
    for extra in path.glob("chat_template.*"):
        extra.unlink()
    eng = LLMEngine.from_pretrained(str(path), num_blocks=64, block_size=4)
    assert "has no chat template" in eng.info.notice
    text = eng.tokenizer.decode(eng.render_chat([SYSTEM, {"role": "user", "content": "hello there"}]))
    assert text.endswith("System: You are terse.\n\nUser: hello there\n\nAssistant:"), text
    cid = eng.start_conversation()
    out = _turn(eng, cid, [SYSTEM, {"role": "user", "content": "hello there"}], max_tokens=4)[0]
    assert out.error is None and out.usage.completion_tokens == 4
    assert LLMEngine.from_pretrained(str(make_tiny_model(tmp_path / "chat", "llama")), num_blocks=8).info.notice == ""
