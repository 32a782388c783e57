"""GGUF models: small files written with the `gguf` writer, loaded by the engine and compared with
`transformers` loading the same file (logits and greedy output), plus the file-finding rules."""

from __future__ import annotations

import itertools
import json
import shutil
import threading
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, GGUFError, LLMEngine, SamplingParams
from engine.events import LoadProgress
from engine.weights.loader import load_model
from engine.weights.source import ModelNotFoundError, resolve_model
from kernels.cpu import ops as cpu_ops
from tests.gguf_helpers import transformers_from_gguf, write_gguf
from tests.helpers import PagedHarness, reference_logits

PROMPT = "the cat sat on the mat with his friend"
K_SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)

# (arch, matrix type, embedding type, tied, config overrides)
CASES = [
    ("llama", "F32", None, True, {}),
    ("llama", "Q4_1", "Q8_0", True, {}),  # the real SmolLM2 file's mix: Q8_0 embedding, Q4_1 matrices
    ("llama", "Q4_0", None, False, {}),  # an output.weight of its own
    ("llama", "Q5_0", "Q5_1", True, {}),
    ("llama", "Q4_K", None, True, K_SHAPE),
    ("llama", "Q5_K", None, False, K_SHAPE),
    ("llama", "Q6_K", "Q6_K", True, K_SHAPE),
    ("qwen2", "Q8_0", None, True, {}),
    ("qwen2", "F16", None, False, {}),
    # transformers' GGUF config ignores key_length (Qwen3Config's default head_dim is 128): match it
    ("qwen3", "BF16", None, True, {"head_dim": 128}),
    # fused attn_qkv and ffn_up (gate rows, then up), an output.weight of its own
    ("phi3", "F32", None, False, {}),
    ("phi3", "F16", None, False, {}),
    ("phi3", "Q8_0", "Q4_0", False, {}),
    ("gpt2", "F32", None, True, {"n_positions": 1024}),  # transformers reads n_ctx, not n_positions
    ("gpt2", "Q8_0", None, False, {"n_positions": 1024}),
]


def _id(case) -> str:
    arch, qtype, embed, tied, _ = case
    return f"{arch}-{qtype}" + (f"-embd{embed}" if embed else "") + ("-tied" if tied else "-head")


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf")


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_logits_and_greedy_match_transformers_on_the_same_file(gguf_dir: Path, case) -> None:
    arch, qtype, embed, tied, overrides = case
    path = gguf_dir / f"{_id(case)}.gguf"
    _, tok = write_gguf(path, arch, qtype=qtype, embed_qtype=embed, tie=tied, **overrides)
    ref = transformers_from_gguf(path)
    loaded = load_model(str(path), quantization="none")  # dequantized, as transformers does
    ids = tok.encode(PROMPT).ids
    got = PagedHarness(loaded).step(prefills=[(0, ids)])
    want = reference_logits(ref, ids)
    # Both dequantize with gguf's numpy code: only float32 summation order differs.
    assert (got - want).abs().max().item() < 1e-4 * max(1.0, want.abs().max().item())
    assert (loaded.model.lm_head is None) == tied

    engine = LLMEngine(loaded, EngineConfig(block_size=8, num_blocks=64))
    out = engine.generate([ids], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    with torch.no_grad():
        hf = ref.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
    assert out.outputs[0].token_ids == hf[0, len(ids):].tolist()


LLAMA3_ROPE = {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}


@pytest.mark.parametrize("arch, overrides", [("qwen3", {"head_dim": 32}), ("gpt2", {"n_positions": 256}),
                                             ("llama", LLAMA3_ROPE), ("phi3", {"sliding_window": 8})],
                         ids=["qwen3", "gpt2", "llama3-rope", "phi3-window"])
def test_config_keys_transformers_misses_are_read_from_the_file(gguf_dir: Path, arch, overrides) -> None:
    """Qwen3's head_dim (attention.key_length), GPT-2's context, Llama 3's RoPE scaling (the
    rope_freqs tensor) and Phi-3's sliding window: compared with the model the file was written from,
    since transformers' own GGUF load gets these wrong."""
    path = gguf_dir / f"{arch}-shape.gguf"
    original, tok = write_gguf(path, arch, **overrides)
    loaded = load_model(str(path), quantization="none")
    ids = tok.encode(PROMPT).ids
    ids = (ids * 8)[:200]  # long enough for the scaled low frequencies to matter
    got = PagedHarness(loaded, num_blocks=64).step(prefills=[(0, ids)])
    torch.testing.assert_close(got, reference_logits(original, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_phi3_fused_tensors_packed_through_our_kernels(gguf_dir: Path, qtype: str) -> None:
    """Phi-3's fused attn_qkv and ffn_up go whole into one packed weight each: the logits and greedy
    tokens of the dequantized load."""
    path = gguf_dir / f"phi3-packed-{qtype}.gguf"
    _, tok = write_gguf(path, "phi3", qtype=qtype, tie=False)
    dense = load_model(str(path), quantization="none")
    packed = load_model(str(path), quantization="auto", weight_cache=False)
    layer = packed.model.model.layers[0]
    assert not isinstance(layer.self_attn.qkv_proj.weight, torch.Tensor)  # packed, not dense
    assert not isinstance(layer.mlp.gate_up_proj.weight, torch.Tensor)
    ids = tok.encode(PROMPT).ids
    want = PagedHarness(dense).step(prefills=[(0, ids)])
    diff = (PagedHarness(packed).step(prefills=[(0, ids)]) - want).abs().max().item() / want.abs().max().item()
    assert diff < 5e-3, diff  # the file's own blocks: int8 activations only
    outs = [LLMEngine(loaded, EngineConfig(block_size=8, num_blocks=64)).generate(
        [ids], SamplingParams(max_tokens=16, ignore_eos=True))[0].outputs[0].token_ids for loaded in (dense, packed)]
    assert outs[0] == outs[1]


def test_phi3_longrope_file_is_refused_by_name(tmp_path: Path) -> None:
    """llama.cpp stores Phi-3 128k's LongRoPE as rope_factors_long / _short tensors: refused at once."""
    import gguf
    import numpy as np

    path = tmp_path / "phi3-128k.gguf"
    writer = gguf.GGUFWriter(path, "phi3")
    for kind in ("long", "short"):
        writer.add_tensor(f"rope_factors_{kind}.weight", np.ones(16, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match="rope_type 'longrope'"):
        resolve_model(str(path))


def test_tokenizer_and_chat_template_come_from_the_file(gguf_dir: Path) -> None:
    path = gguf_dir / "tok.gguf"
    _, tok = write_gguf(path, "llama")
    loaded = load_model(str(path))
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "what is the capital of france?"}]
    text = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n"
                    "what is the capital of france?<|im_end|>\n<|im_start|>assistant\n")
    ids = loaded.tokenizer.encode(text, add_special_tokens=False)
    # Fixed ids (the BPE trained on tests/gguf_helpers.CORPUS), and the tokenizer the file was written from.
    assert ids == [1, 85, 331, 310, 201, 68, 71, 358, 2, 201, 1, 328, 201, 89, 314, 288, 263, 303, 295, 302,
                   33, 2, 201, 1, 67, 281, 300, 201]
    assert ids == tok.encode(text).ids
    assert loaded.eos_token_ids == [2]  # tokenizer.ggml.eos_token_id: <|im_end|>


def test_sampling_metadata_becomes_the_models_generation_defaults(gguf_dir: Path) -> None:
    path = gguf_dir / "sampling.gguf"
    write_gguf(path, "llama", sampling={"temp": 0.4, "top_p": 0.8, "top_k": 20, "penalty_repeat": 1.2})
    loaded = load_model(str(path))
    assert loaded.generation_source == "GGUF metadata"
    assert loaded.generation_defaults == pytest.approx({"temperature": 0.4, "top_p": 0.8, "top_k": 20,
                                                        "repetition_penalty": 1.2})


def test_each_stage_of_a_load_is_reported_in_order(gguf_dir: Path) -> None:
    path = gguf_dir / "progress.gguf"
    write_gguf(path, "llama")
    reports: list[LoadProgress] = []
    LLMEngine.from_pretrained(str(path), progress=reports.append, num_blocks=16)
    stages = list(dict.fromkeys(p.stage for p in reports))  # each stage once, in the order they began
    weights = next(s for s in stages if s.endswith("weights"))
    # built on first use where no install built them (a fresh machine without `make setup`), else loaded
    kernels = [s for s in stages if s in ("loading the CPU kernels", "building the CPU kernels (once)")]
    assert len(kernels) == cpu_ops.supported_cpu()  # none on a CPU without our kernels: torch's ops
    assert stages == ["reading the file", *kernels, "converting the tokenizer",
                      weights, "allocating the KV pool (16 blocks of 16 tokens)"]
    counted = [(p.done, p.total) for p in reports if p.stage == weights]
    total = counted[0][1]
    assert total > 3 and counted == [(done, total) for done in range(total + 1)]  # every tensor, none twice
    elapsed = [p.elapsed_s for p in reports]
    assert elapsed == sorted(elapsed) and elapsed[0] >= 0
    # the second load of the same file reads the tokenizer its first one converted
    again: list[LoadProgress] = []
    LLMEngine.from_pretrained(str(path), progress=again.append, num_blocks=16)
    assert "reading the tokenizer" in {p.stage for p in again}
    assert not any("converting" in p.stage for p in again)


# --- where a GGUF file can be ----------------------------------------------------------------


def test_found_by_magic_bytes_in_a_blob_and_in_a_folder(gguf_dir: Path, tmp_path: Path) -> None:
    src = gguf_dir / "where.gguf"
    _, tok = write_gguf(src, "llama")
    blob = tmp_path / "blobs" / ("sha256-" + "ab" * 32)  # Ollama's model store: no extension
    blob.parent.mkdir()
    shutil.copy(src, blob)
    folder = tmp_path / "folder"
    folder.mkdir()
    shutil.copy(src, folder / "model-q4.gguf")
    ids = tok.encode(PROMPT).ids
    want = PagedHarness(load_model(str(src))).step(prefills=[(0, ids)])
    for where in (blob, folder):
        assert resolve_model(str(where)).kind == "gguf"
        torch.testing.assert_close(PagedHarness(load_model(str(where))).step(prefills=[(0, ids)]), want)
    assert resolve_model(str(folder)).display_name == "model-q4"

    shutil.copy(src, folder / "other.gguf")
    with pytest.raises(GGUFError, match="holds 2 GGUF files"):
        resolve_model(str(folder))
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(ModelNotFoundError, match="not a GGUF model"):
        resolve_model(str(fake))


def test_split_files_and_other_architectures_are_refused(gguf_dir: Path, tmp_path: Path) -> None:
    import gguf

    src = gguf_dir / "split-src.gguf"
    write_gguf(src, "llama")
    part = tmp_path / "model-00001-of-00003.gguf"
    shutil.copy(src, part)
    with pytest.raises(GGUFError, match="split"):
        resolve_model(str(part))

    split = tmp_path / "split-meta.gguf"
    writer = gguf.GGUFWriter(split, "llama")
    writer.add_uint16("split.count", 3)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match="split"):
        resolve_model(str(split))

    bert = tmp_path / "bert.gguf"
    writer = gguf.GGUFWriter(bert, "bert")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match="architecture 'bert' is not supported") as info:
        resolve_model(str(bert))
    assert "llama" in str(info.value) and "qwen3" in str(info.value)


def test_a_truncated_file_says_so(gguf_dir: Path, tmp_path: Path) -> None:
    src = gguf_dir / "whole.gguf"
    write_gguf(src, "llama")
    cut = tmp_path / "cut.gguf"
    for fraction in (0.5, 0.67, 0.9):  # a download stopped part of the way (in a tensor, at any byte)
        cut.write_bytes(src.read_bytes()[: int(src.stat().st_size * fraction) + 1])
        with pytest.raises(GGUFError, match="is truncated or damaged: its tensors' data does not fit the file"):
            resolve_model(str(cut))
    cut.write_bytes(b"GGUF" + bytes(64))  # a header gguf cannot read is not called truncated
    with pytest.raises(GGUFError, match="not a readable GGUF file"):
        resolve_model(str(cut))


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_config_and_tokenizer_are_converted_once_then_cached(arch: str, gguf_dir: Path, tmp_path: Path,
                                                            monkeypatch) -> None:
    """The warm load reads the whole config back as a plain PretrainedConfig (no model config class to
    import) and computes what the converted one did, Gemma 3's layer pattern and two RoPE bases included."""
    from engine.weights import gguf_config

    monkeypatch.setenv("ROSECHAT_CACHE_DIR", str(tmp_path / "cache"))
    path = gguf_dir / f"cached-{arch}.gguf"
    extra = {"query_pre_attn_scalar": 32} if arch == "gemma3" else {}
    _, tok = write_gguf(path, arch, head_dim=32, **extra)  # a key transformers' conversion misses
    first = load_model(str(path))
    (folder,) = (tmp_path / "cache" / "gguf").iterdir()
    assert (folder / "config.json").is_file() and folder.name.startswith("cached-")

    def no_conversion(*args):
        raise AssertionError("converted again despite the cache")

    monkeypatch.setattr(gguf_config, "load_config", no_conversion)
    monkeypatch.setattr(gguf_config, "load_tokenizer", no_conversion)
    again = load_model(str(path))
    from transformers.configuration_utils import PretrainedConfig

    assert type(again.config) is PretrainedConfig and type(first.config) is not PretrainedConfig
    assert again.config.head_dim == 32 and again.config.architectures == first.config.architectures
    assert again.config.model_type == first.config.model_type and arch in again.config.model_type
    skip = ("use_cache", "model_type")  # a generation setting the engine never reads; the class's name, above
    assert {k: v for k, v in again.config.to_dict().items() if k not in skip} == {
        k: v for k, v in first.config.to_dict().items() if k not in skip}
    messages = [{"role": "user", "content": "hello there"}]
    render = lambda t: t.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)  # noqa: E731
    assert render(again.tokenizer) == render(first.tokenizer)
    # added tokens listed in tokenizer_config.json (read back without parsing tokenizer.json in Python): the same
    assert "added_tokens_decoder" in json.loads((folder / "tokenizer_config.json").read_text())
    assert again.tokenizer.added_tokens_decoder == first.tokenizer.added_tokens_decoder
    assert again.tokenizer.special_tokens_map == first.tokenizer.special_tokens_map
    text = render(first.tokenizer)
    assert again.tokenizer.encode(text, add_special_tokens=False) == tok.encode(text).ids
    assert again.eos_token_ids == first.eos_token_ids
    ids = tok.encode(PROMPT).ids
    torch.testing.assert_close(PagedHarness(again).step(prefills=[(0, ids)]),
                               PagedHarness(first).step(prefills=[(0, ids)]))

    # A damaged cache is converted again, not trusted.
    monkeypatch.undo()
    monkeypatch.setenv("ROSECHAT_CACHE_DIR", str(tmp_path / "cache"))
    (folder / "tokenizer_config.json").write_text("{not json")
    assert load_model(str(path)).tokenizer.encode(text, add_special_tokens=False) == tok.encode(text).ids


def test_two_conversions_of_one_file_in_one_thread_keep_their_own_folders(gguf_dir: Path, tmp_path: Path,
                                                                          monkeypatch) -> None:
    """A load that fails after starting the tokenizer's conversion (a refused quantization) leaves it to
    finish while the next load of the file, from the same thread, starts another: the second must not
    write into a folder the first has already renamed into place (CI failed on exactly that)."""
    from engine.weights import gguf_config
    from engine.weights.gguf import GGUFModel

    monkeypatch.setenv("ROSECHAT_CACHE_DIR", str(tmp_path / "cache"))
    path = gguf_dir / "twice.gguf"
    _, tok = write_gguf(path, "llama")
    gates, started = [threading.Event(), threading.Event()], itertools.count()
    convert = gguf_config.load_tokenizer

    def gated(model, config):  # the first conversion ends before the second one saves
        assert gates[next(started)].wait(30)
        return convert(model, config)

    monkeypatch.setattr(gguf_config, "load_tokenizer", gated)
    first, second = (GGUFModel(path).config_then_tokenizer()[1] for _ in range(2))
    cache = tmp_path / "cache" / "gguf"
    assert len([p for p in cache.iterdir() if p.name.endswith(".tmp")]) == 2  # one each
    gates[0].set()
    first()
    gates[1].set()
    assert second().encode(PROMPT, add_special_tokens=False) == tok.encode(PROMPT).ids
    assert [p.name for p in cache.iterdir() if p.name.endswith(".tmp")] == []
    (folder,) = cache.iterdir()
    assert (folder / "tokenizer.json").is_file()
