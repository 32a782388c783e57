"""Files the loader refuses before anything large is allocated: a tensor type it cannot read (named, with
its tensor), and a model that with the smallest KV cache does not fit the available memory (with the figures)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from engine import GGUFError, load_model, resolve_model
from engine.weights import memory
from engine.weights.memory import ModelTooLargeError, check_fits
from tests.gguf_helpers import write_gguf, write_typed


def test_a_tensor_type_gguf_cannot_dequantize_is_named_with_its_tensor(tmp_path: Path) -> None:
    path = tmp_path / "q8_1.gguf"
    write_typed(path, "Q8_1")
    with pytest.raises(GGUFError, match=r"q8_1.gguf: tensor 'token_embd.weight' has type Q8_1, which rosechat "
                                        r"cannot load"):
        resolve_model(str(path))


def test_a_type_id_the_gguf_package_does_not_know_is_said_so(tmp_path: Path) -> None:
    path = tmp_path / "future.gguf"
    write_typed(path, "Q8_0")
    data = bytearray(path.read_bytes())
    name = data.index(b"token_embd.weight") + len(b"token_embd.weight")
    type_at = name + 4 + 2 * 8  # n_dims (uint32), two dims (uint64), then the type (uint32)
    assert int.from_bytes(data[type_at : type_at + 4], "little") == 8  # Q8_0
    data[type_at : type_at + 4] = (99).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=r"future.gguf: a tensor has GGML type id 99, which this gguf package "
                                        r"\(gguf [\d.]+\) does not know; rosechat cannot load it"):
        resolve_model(str(path))


def test_the_figures_of_a_model_too_large() -> None:
    with pytest.raises(ModelTooLargeError) as info:
        check_fits("Llama-3.1-8B-Q8_0.gguf", int(8.9e9), int(0.3e9), available=int(6.1e9))
    assert str(info.value).startswith("Llama-3.1-8B-Q8_0.gguf needs about 8.9 GB for its weights plus 0.3 GB for "
                                      "the smallest KV cache; 6.1 GB is available")
    check_fits("fits.gguf", 100, 100, available=200)  # no error


def test_the_estimate_follows_the_quantization_and_the_kv_cache(tmp_path: Path) -> None:
    path = tmp_path / "q8.gguf"
    write_gguf(path, "llama", qtype="Q8_0")
    gguf = resolve_model(str(path)).gguf
    dense = memory.weight_bytes(gguf, "none", 4)
    assert sum(int(t.n_elements) for t in gguf.reader.tensors) * 4 == dense
    assert memory.weight_bytes(gguf, "auto", 4) < dense / 3  # int8: 1.125 bytes a weight
    # a tiny model's whole context is smaller than the default pool: K and V of every layer and token
    assert 0 < memory.smallest_kv_bytes(gguf, 4) < memory.DEFAULT_KV_BYTES


def test_a_model_too_large_is_refused_before_its_weights_are_allocated(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "tiny.gguf"
    write_gguf(path, "llama", qtype="Q4_0")
    source = resolve_model(str(path))
    allocated: list[torch.device] = []
    to_empty = torch.nn.Module.to_empty

    def spy(self, *, device, recurse=True):
        allocated.append(torch.device(device))
        return to_empty(self, device=device, recurse=recurse)

    monkeypatch.setattr(torch.nn.Module, "to_empty", spy)
    monkeypatch.setenv(memory.MEMORY_LIMIT_ENV, "100000")
    with pytest.raises(ModelTooLargeError, match=r"tiny.gguf needs about 0.0 GB .*; 0.0 GB is available"):
        load_model(source, device="cpu")
    assert not [d for d in allocated if d.type != "meta"]  # nothing but meta tensors was ever built
    monkeypatch.setenv(memory.MEMORY_LIMIT_ENV, str(1 << 40))
    assert load_model(source, device="cpu").num_layers > 0


def test_a_load_error_is_a_value_error_naming_the_file(tmp_path: Path) -> None:
    """Front ends catch ValueError from resolve_model and load_model (the memory error is one)."""
    assert issubclass(ModelTooLargeError, ValueError) and issubclass(GGUFError, ValueError)
    src = tmp_path / "src.gguf"
    write_gguf(src, "llama")
    shutil.copy(src, tmp_path / "model-00001-of-00002.gguf")
    with pytest.raises(GGUFError, match="model-00001-of-00002.gguf is one part of a split GGUF"):
        resolve_model(str(tmp_path / "model-00001-of-00002.gguf"))
