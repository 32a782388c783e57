"""engine.weights' loading (local folders, the HF cache, broken checkpoints) and the built-in demo model."""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import demo
from engine.weights.checkpoint import WeightLoadError
from engine.weights.loader import build_model, load_model, resolve_dtype
from engine.weights.source import ModelNotFoundError
from tests.helpers import PagedHarness, reference_logits, reference_model


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_weights(folder: Path, edit) -> None:
    (file,) = folder.glob("*.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


# --- finding the model ------------------------------------------------------------------------


def test_unknown_local_path(tmp_path):
    missing = tmp_path / "no" / "such" / "model"
    with pytest.raises(ModelNotFoundError, match="no such local file or folder") as info:
        load_model(str(missing))
    assert isinstance(info.value, FileNotFoundError)
    assert str(missing) in str(info.value)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache in tmp_path, and offline mode: no test touches the network."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_hub_id_not_cached_offline(hub_cache):
    with pytest.raises(ModelNotFoundError) as info:
        load_model("some-org/not-a-cached-model")
    message = str(info.value)
    assert "'some-org/not-a-cached-model' is neither a local folder nor in the Hugging Face cache" in message
    assert str(hub_cache) in message and "offline" in message


def test_hub_id_resolved_from_cache(hub_cache, tiny_llama):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = hub_cache / "models--tiny-org--tiny-llama"
    shutil.copytree(tiny_llama, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    lm = load_model("tiny-org/tiny-llama")
    assert lm.name == "tiny-org/tiny-llama" and not lm.is_demo
    local = load_model(str(tiny_llama))
    for (name, a), (_, b) in zip(lm.model.state_dict().items(), local.model.state_dict().items()):
        assert torch.equal(a, b), name


def test_hub_id_downloaded_when_not_cached(monkeypatch, tiny_llama):
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    calls = []

    def fake_snapshot_download(repo_id, *, local_files_only=False, **kwargs):
        calls.append(local_files_only)
        if local_files_only:
            raise LocalEntryNotFoundError("not cached")
        return str(tiny_llama)

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert load_model("tiny-org/remote").name == "tiny-org/remote"
    assert calls == [True, False]  # the cache first, then the download

    def unreachable(repo_id, **kwargs):
        raise ConnectionError("hub unreachable")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(ModelNotFoundError, match="downloading it failed: ConnectionError: hub unreachable"):
        load_model("tiny-org/remote")


def test_folder_without_config_or_weights(tmp_path, tiny_llama):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        load_model(str(tmp_path))
    folder = _copy(tiny_llama, tmp_path / "m")
    for f in folder.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelNotFoundError, match="safetensors"):
        load_model(str(folder))


# --- checkpoints that do not fit -------------------------------------------------------------


def test_unsupported_architecture(tmp_path, tiny_llama):
    folder = _copy(tiny_llama, tmp_path / "m")
    _edit_config(folder, architectures=["LlamaForSequenceClassification"])
    with pytest.raises(ValueError, match="LlamaForSequenceClassification") as info:
        load_model(str(folder))
    for supported in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
                      "GPT2LMHeadModel"):
        assert supported in str(info.value)


@pytest.mark.parametrize(
    "dropped",
    ["model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.k_proj.weight", "model.norm.weight"],
)
def test_missing_tensor_is_named(tmp_path, tiny_llama, dropped):
    folder = _copy(tiny_llama, tmp_path / "m")
    _edit_weights(folder, lambda t: t.pop(dropped))
    with pytest.raises(WeightLoadError, match="lacks 1 tensor") as info:
        load_model(str(folder))
    assert dropped in str(info.value)


def test_unexpected_tensor_is_named(tmp_path, tiny_llama):
    folder = _copy(tiny_llama, tmp_path / "m")  # attention_bias=False: a bias does not belong
    _edit_weights(folder, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(128)}))
    with pytest.raises(WeightLoadError, match="unexpected tensor 'model.layers.0.self_attn.q_proj.bias'"):
        load_model(str(folder))


def test_wrong_shape_is_named(tmp_path, tiny_llama):
    folder = _copy(tiny_llama, tmp_path / "m")
    _edit_config(folder, intermediate_size=192)  # checkpoint has 160
    pattern = r"tensor 'model\.layers\.0\.mlp\.\w+_proj\.weight' in .* has shape"
    with pytest.raises(WeightLoadError, match=pattern) as info:
        load_model(str(folder))
    assert "160" in str(info.value) and "192" in str(info.value)


def test_gpt2_checkpoint_without_prefix(tmp_path, tiny_model_factory):
    """The hub's gpt2 checkpoints name tensors without `transformer.` and keep the old attn.bias buffers."""
    folder = _copy(tiny_model_factory("gpt2", tie_word_embeddings=True), tmp_path / "m")

    def strip(tensors):
        for name in list(tensors):
            tensors[name.removeprefix("transformer.")] = tensors.pop(name)
        tensors["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 8, 8))

    _edit_weights(folder, strip)
    ref = reference_model(tiny_model_factory("gpt2", tie_word_embeddings=True))
    logits = PagedHarness(load_model(str(folder))).step(prefills=[(0, [5, 6, 7, 8, 9])])
    torch.testing.assert_close(logits, reference_logits(ref, [5, 6, 7, 8, 9]), atol=1e-4, rtol=0)


# --- what LoadedModel reports ----------------------------------------------------------------


def test_eos_ids_from_generation_config_and_config(tmp_path, tiny_llama):
    folder = _copy(tiny_llama, tmp_path / "m")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 3]}))
    _edit_config(folder, eos_token_id=[3, 9])
    assert load_model(str(folder)).eos_token_ids == [7, 3, 9]


def test_max_model_len(tiny_llama, tiny_model_factory):
    assert load_model(str(tiny_llama)).max_model_len == 256
    # the kernels attend a sliding window exactly: a sliding-window model keeps its whole context,
    # and every Mistral layer slides (Qwen2 only with use_sliding_window)
    mistral = load_model(str(tiny_model_factory("mistral", max_position_embeddings=256, sliding_window=96)))
    assert mistral.max_model_len == 256
    assert [a.window for a in mistral.model.attention_layers()] == [96, 96]
    qwen2 = load_model(str(tiny_model_factory("qwen2", sliding_window=96)))
    assert [a.window for a in qwen2.model.attention_layers()] == [None, None]


def test_tokenizer_and_chat_template_load(tiny_llama):
    tok = load_model(str(tiny_llama)).tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_bfloat16_load_runs_close_to_float32(tiny_llama):
    prompt = [(0, [11, 12, 13, 14, 15, 16, 17])]
    want = PagedHarness(load_model(str(tiny_llama))).step(prefills=prompt)
    lm = load_model(str(tiny_llama), dtype="bf16")
    assert all(p.dtype == torch.bfloat16 for p in lm.model.parameters())
    assert not any(p.requires_grad for p in lm.model.parameters())
    got = PagedHarness(lm).step(prefills=prompt)
    assert got.dtype == torch.float32
    assert (got - want).abs().max() < 0.05 * want.abs().max()


def test_resolve_dtype():
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("bf16", cpu) == torch.bfloat16
    assert resolve_dtype("torch.float16", cpu) == torch.float16
    assert resolve_dtype(torch.float32, cpu) == torch.float32
    with pytest.raises(ValueError, match="int8"):
        resolve_dtype("int8", cpu)


# --- the demo model --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_tok():
    return demo.demo_tokenizer(demo.demo_config("demo").vocab_size)


def _random_text(rng: random.Random) -> str:
    ranges = [(0x20, 0x7E), (0x09, 0x0A), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x4E00, 0x4FFF),
              (0x1F300, 0x1F64F), (0xAC00, 0xAD00)]
    out = []
    for _ in range(rng.randrange(1, 60)):
        lo, hi = rng.choice(ranges)
        out.append(chr(rng.randint(lo, hi)))
    return "".join(out)


def test_demo_tokenizer_round_trips_any_text(demo_tok):
    rng = random.Random(0)
    texts = [_random_text(rng) for _ in range(200)] + [
        "  leading spaces, trailing  ",
        "naïve café, 日本語, emoji 🙂👍🏽, tabs\tand\n\nnewlines",
        "literal <0x41> and \\x41 text",
        "",
    ]
    for text in texts:
        ids = demo_tok.encode(text, add_special_tokens=False)
        assert demo_tok.unk_token_id not in ids, text
        assert demo_tok.decode(ids) == text


def test_demo_tokenizer_speaks_words(demo_tok):
    ids = demo_tok.encode("the cat ran to the river with his dog", add_special_tokens=False)
    assert len(ids) == 9  # one token per common word
    # ordinary (non-special, non-byte) tokens decode to English words separated by spaces
    first_ordinary = len(demo.SPECIAL_TOKENS) + 256
    rng = random.Random(1)
    sample = [rng.randrange(first_ordinary, len(demo_tok)) for _ in range(300)]
    words = demo_tok.decode(sample).split()
    known = set(demo.WORDS) | {w.capitalize() for w in demo.WORDS}
    assert sum(w in known for w in words) > 0.7 * len(words)


def test_demo_tokenizer_chat_template_and_special_tokens(demo_tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    text = demo_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello there<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert not demo_tok.apply_chat_template(messages, tokenize=False).endswith("assistant\n")
    specials = {demo_tok.bos_token_id, demo_tok.eos_token_id, demo_tok.pad_token_id,
                *demo_tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])}
    assert len(specials) == 5 and all(0 <= i < len(demo_tok) for i in specials)
    ids = demo_tok.encode(text, add_special_tokens=False)
    assert ids.count(demo_tok.convert_tokens_to_ids("<|im_start|>")) == 3
    assert ids.count(demo_tok.convert_tokens_to_ids("<|im_end|>")) == 2


def test_demo_tokenizer_is_fast_and_deterministic():
    def build(size: int):  # the best of three: a busy machine only ever adds time
        times = []
        for _ in range(3):
            start = time.perf_counter()
            tok = demo.demo_tokenizer(size)
            times.append(time.perf_counter() - start)
        return tok, min(times)

    _, small = build(4096)
    a, large = build(49152)
    assert len(a) == 49152
    assert a.get_vocab() == demo.demo_tokenizer(49152).get_vocab()
    # Linear in the vocabulary (12x the tokens): a quadratic build would be ~144x. A ratio from
    # one run, not a wall-clock bound that a loaded CI machine breaks.
    assert large < 50 * small, (small, large)


def test_demo_model_loads_and_runs():
    lm = load_model("demo")
    assert lm.is_demo and lm.name == "demo (random weights)"
    assert lm.config.vocab_size == len(lm.tokenizer)
    assert {lm.tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")} <= set(lm.eos_token_ids)
    again = load_model("demo")
    for (name, a), (_, b) in zip(lm.model.state_dict().items(), again.model.state_dict().items()):
        assert torch.equal(a, b), f"demo weights differ between loads: {name}"
    weights = lm.model.model.layers[0].self_attn.qkv_proj.weight
    assert 0.015 < weights.std().item() < 0.025  # normal(0, 0.02), like transformers' init

    harness = PagedHarness(lm)
    prompt = lm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi!"}], add_generation_prompt=True)
    prompt = prompt["input_ids"] if not isinstance(prompt, list) else prompt
    logits = harness.step(prefills=[(0, prompt)])
    assert logits.shape == (len(prompt), lm.config.vocab_size) and torch.isfinite(logits).all()
    token = int(logits[-1].argmax())
    logits = harness.step(decodes={0: token})
    assert logits.shape == (1, lm.config.vocab_size) and torch.isfinite(logits).all()
    assert isinstance(lm.tokenizer.decode([token]), str)


def test_demo_135m_has_smollm2_shape():
    from transformers import LlamaForCausalLM

    config = demo.demo_config("demo-135m")
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152 and config.tie_word_embeddings and config.max_position_embeddings == 8192
    ours = build_model(config, torch.float32, torch.device("meta"))
    with torch.device("meta"):
        theirs = LlamaForCausalLM(config)
    n_ours = sum(p.numel() for p in ours.parameters())
    assert n_ours == sum(p.numel() for p in theirs.parameters())  # tied head counted once in both
    assert 130e6 < n_ours < 140e6


def test_unknown_demo_name():
    with pytest.raises(ValueError, match="demo-135m"):
        demo.demo_config("demo-7b")
