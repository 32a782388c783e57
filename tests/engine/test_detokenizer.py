"""IncrementalDetokenizer against real tokenizers trained in-test (byte-level BPE and a
SentencePiece-like Metaspace BPE with byte fallback), so multi-byte characters split across tokens."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.detokenizer import IncrementalDetokenizer

ENGLISH = [
    "Hello world, this is a small test. The cat sat on the mat and looked at the hat.",
    "Thought: I should call a tool.\nObservation: it worked.\nFinal answer: 42",
    "Stop here? No, STOP! means stop. Done.",
]
OTHER = ["日本語のテキストです。中文文本也在这里。", "emoji 😀🎉👍🏽 rockets 🚀 and more"]
CORPUS = ENGLISH * 10 + OTHER  # multi-byte characters stay rare, so most are split into bytes

TEXTS = [
    "Hello world 😀, 中文 and 日本語!",
    "Thought: call it.\nObservation: 🎉🚀 ok",
    "  leading spaces and   runs   of them ",
    "👍🏽 thumbs, ümlaut, naïve café, Ελληνικά, עברית",
    "the mat the hat the cat 这里 🚀",
]


def byte_level_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def metaspace_bpe() -> Tokenizer:
    """Llama-2 style: "▁" marks spaces, unknown characters fall back to <0xNN> byte tokens."""
    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Sequence(
        [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="always")]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=45, show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    # The trainer cannot add plain tokens, so add the 256 byte tokens to the vocab directly.
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    return Tokenizer.from_str(json.dumps(spec))


@pytest.fixture(scope="module", params=["byte_level", "metaspace"])
def tok(request) -> Tokenizer:
    return byte_level_bpe() if request.param == "byte_level" else metaspace_bpe()


def stream(tok, ids, prompt=(), stop=(), skip_special_tokens=True):
    detok = IncrementalDetokenizer(tok, list(prompt), stop=list(stop), skip_special_tokens=skip_special_tokens)
    deltas = [detok.append(i) for i in ids]
    final = detok.flush()
    return detok, deltas, final


def test_valid_text_streams_exactly_and_never_shows_broken_characters(tok):
    split_chars = 0
    for text in TEXTS:
        ids = tok.encode(text).ids
        detok, deltas, final = stream(tok, ids)
        full = tok.decode(ids)
        assert "\ufffd" not in full
        assert "".join(deltas) + final == full
        assert detok.text == full
        assert not any("\ufffd" in d for d in deltas + [final])
        split_chars += sum(tok.decode(ids[:n]).endswith("\ufffd") for n in range(1, len(ids)))
    assert split_chars > 0, "no multi-byte character was split across tokens: the test proves nothing"


def random_ids(tok, rng: random.Random, length: int) -> list[int]:
    """Random token ids. For byte-fallback tokenizers, byte tokens come only as whole UTF-8 characters:
    ByteFallback decodes an invalid run of byte tokens as one "\ufffd" per byte, valid ones included,
    so a later byte can change earlier text and no streaming decoder could match decode(all)."""
    vocab = tok.get_vocab_size()
    if tok.token_to_id("<0x41>") is None:
        return [rng.randrange(vocab) for _ in range(length)]
    byte_ids = {tok.token_to_id(f"<0x{b:02X}>") for b in range(256)}
    plain = [i for i in range(vocab) if i not in byte_ids]
    ids: list[int] = []
    while len(ids) < length:
        if rng.random() < 0.7:
            ids.append(rng.choice(plain))
        else:
            char = chr(
                rng.choice([rng.randrange(0x80, 0x800), rng.randrange(0x4E00, 0x9FFF), rng.randrange(0x1F300, 0x1F64F)])
            )
            ids += [tok.token_to_id(f"<0x{b:02X}>") for b in char.encode()]
    return ids


def test_random_token_sequences_stream_exactly(tok):
    rng = random.Random(0)
    for _ in range(30):
        ids = random_ids(tok, rng, rng.randrange(1, 40))
        _, deltas, final = stream(tok, ids)
        assert "".join(deltas) + final == tok.decode(ids)


def test_output_after_a_prompt_keeps_its_leading_space(tok):
    prompt = tok.encode("Hello world, this is").ids
    rng = random.Random(1)
    for text in TEXTS:
        out = tok.encode(" " + text).ids
        _, deltas, final = stream(tok, out, prompt=prompt)
        whole, before = tok.decode(prompt + out), tok.decode(prompt)
        assert whole.startswith(before)
        assert "".join(deltas) + final == whole[len(before) :]
        assert "".join(deltas + [final]).startswith(" ")
        # Random output after the same prompt (its bytes cannot merge into the prompt's last character).
        out = random_ids(tok, rng, 20)
        _, deltas, final = stream(tok, out, prompt=prompt)
        assert "".join(deltas) + final == tok.decode(prompt + out)[len(before) :]


def test_each_delta_appears_as_soon_as_its_characters_are_complete(tok):
    ids = tok.encode("ab 😀 cd").ids
    detok = IncrementalDetokenizer(tok, [])
    for n, i in enumerate(ids, 1):
        detok.append(i)
        so_far = tok.decode(ids[:n])
        if not so_far.endswith("\ufffd"):
            assert detok.text == so_far  # nothing held back without a reason


def test_special_tokens_skipped_or_shown():
    tok = byte_level_bpe()
    eos = tok.token_to_id("<eos>")
    ids = tok.encode("Hello").ids + [eos] + tok.encode(" world").ids
    _, deltas, final = stream(tok, ids)
    assert "".join(deltas) + final == "Hello world"
    _, deltas, final = stream(tok, ids, skip_special_tokens=False)
    assert "".join(deltas) + final == "Hello<eos> world"


def test_long_run_of_invalid_bytes_is_shown_before_flush():
    tok = byte_level_bpe()
    lead = tok.encode("中").ids[0]  # first token: an incomplete UTF-8 lead sequence
    assert tok.decode([lead]).endswith("\ufffd")
    ids = [lead] * 60
    _, deltas, final = stream(tok, ids)
    assert "".join(deltas), "invalid bytes were held back forever"
    assert "".join(deltas) + final == tok.decode(ids)


# --- stop strings ---------------------------------------------------------------------------


def run_stop(tok, text, stop):
    ids = tok.encode(text).ids
    detok = IncrementalDetokenizer(tok, [], stop=stop)
    deltas, stopped_at = [], None
    for n, i in enumerate(ids):
        deltas.append(detok.append(i))
        if detok.stopped and stopped_at is None:
            stopped_at = n
    return ids, detok, deltas, stopped_at


def test_stop_string_spanning_several_tokens(tok):
    text = "Thought: call it.\nObservation: it worked."
    ids, detok, deltas, stopped_at = run_stop(tok, text, ["Observation:"])
    assert detok.stopped
    assert detok.text == "Thought: call it.\n"
    assert "".join(deltas) == detok.text
    assert not any("Obs" in d for d in deltas)
    # It stopped on the token that completed the stop string, which took several tokens to spell.
    done = next(n for n in range(len(ids)) if "Observation:" in tok.decode(ids[: n + 1]))
    assert stopped_at == done
    first = next(n for n in range(len(ids)) if "O" in tok.decode(ids[: n + 1]))
    assert done > first
    assert detok.append(ids[0]) == "" and detok.flush() == ""  # nothing after a stop


def test_false_alarm_prefix_is_released(tok):
    text = "Stop here? No, STOP! means stop."
    ids, detok, deltas, _ = run_stop(tok, text, ["STOP!!"])
    assert not detok.stopped
    assert "".join(deltas) + detok.flush() == text
    # "STOP!" looked like the stop string's beginning and was held until " means" proved otherwise.
    held = 0
    for n in range(len(ids)):
        if tok.decode(ids[: n + 1]).endswith("STOP!"):
            assert "".join(deltas[: n + 1]).endswith("No, ")
            held += 1
    assert held > 0


def test_flush_releases_a_held_stop_prefix(tok):
    text = "Hello world, STO"
    ids, detok, deltas, _ = run_stop(tok, text, ["STOP"])
    assert "".join(deltas) == "Hello world, "
    assert detok.flush() == "STO"
    assert detok.text == text and not detok.stopped


def test_earliest_of_several_stops_wins(tok):
    text = "Hello world, this is a small test."
    _, detok, deltas, _ = run_stop(tok, text, ["small", "is a", "ell"])
    assert detok.stopped and detok.text == "H"
    _, detok, deltas, _ = run_stop(tok, text, ["small", "is a"])
    assert detok.stopped and detok.text == "Hello world, this "
    assert "".join(deltas) == detok.text


def test_stop_string_made_of_split_multibyte_characters(tok):
    text = "a 中文 b 😀 c"
    ids, detok, deltas, _ = run_stop(tok, text, ["😀"])
    assert detok.stopped and detok.text == "a 中文 b "
    assert not any("\ufffd" in d or "😀" in d for d in deltas)


def test_random_stops_never_leak(tok):
    rng = random.Random(2)
    for text in TEXTS * 3:
        a = rng.randrange(len(text))
        stop = text[a : a + rng.randrange(1, 6)]
        ids = tok.encode(text).ids
        detok = IncrementalDetokenizer(tok, [], stop=[stop])
        deltas = [detok.append(i) for i in ids]
        deltas.append(detok.flush())
        full = tok.decode(ids)
        assert detok.stopped == (stop in full)
        expected = full[: full.find(stop)] if stop in full else full
        assert "".join(deltas) == detok.text == expected
        assert not any(stop in d for d in deltas)


def test_transformers_tokenizer_wrapper():
    from transformers import PreTrainedTokenizerFast  # what the engine loads models' tokenizers as

    tok = PreTrainedTokenizerFast(tokenizer_object=byte_level_bpe(), eos_token="<eos>")
    for text in TEXTS:
        ids = tok.encode(text) + [tok.eos_token_id]
        detok = IncrementalDetokenizer(tok, tok.encode("Hello"), stop=["🚀"])
        deltas = [detok.append(i) for i in ids] + [detok.flush()]
        expected = text[: text.find("🚀")] if "🚀" in text else text
        assert "".join(deltas) == detok.text == expected
        assert not any("\ufffd" in d for d in deltas)


class CountingTokenizer:
    """Records how many ids each decode call gets: the per-token cost."""

    def __init__(self, tok):
        self.tok, self.sizes = tok, []

    def decode(self, ids, skip_special_tokens=True):
        self.sizes.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_per_token_work_stays_bounded(tok):
    counting = CountingTokenizer(tok)
    ids = tok.encode(" ".join(TEXTS * 20)).ids
    assert len(ids) > 500
    prompt = tok.encode("a long prompt " * 50).ids
    detok = IncrementalDetokenizer(counting, prompt, stop=["never there"])
    deltas = [detok.append(i) for i in ids] + [detok.flush()]
    assert "".join(deltas) == tok.decode(prompt + ids)[len(tok.decode(prompt)) :]
    assert max(counting.sizes) <= 12  # a few tokens of context + the new ones, however long the output
    assert len(detok._ids) <= 128  # old ids are dropped too
