"""GGUF files (llama.cpp, Ollama, LM Studio): one file with weights, config, tokenizer and template.

Read with maintained code: the `gguf` package (llama.cpp's dequantizers, type sizes, name maps),
`transformers` for the config, the tokenizer and the chat template (what its GGUF integration makes of
the file, computed by gguf_meta.py without its slow passes over the file); the header (metadata, tensor
names, types and offsets) by gguf_header.py, which reads it in a fraction of gguf.GGUFReader's time, and
the tensors from one np.memmap of the file. Quantized tensors are dequantized at load, or handed over as
their raw blocks (blocks.GGUFBlocks) for a packed load (packing.py).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from engine.weights import gguf_config
from engine.weights.blocks import FilePages, GGUFBlocks
from engine.weights.gguf_header import HeaderError, TensorInfo, read_array, read_header

GGUF_MAGIC = b"GGUF"

# GGUF general.architecture -> our model class (config.architectures[0])
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# llama.cpp's converter interleaves the rotary halves of q/k rows for these (Llama-style RoPE);
# `transformers` un-permutes them the same way.
_PERMUTED_QK = {"llama", "mistral"}
# llama.cpp's converter stores Gemma's RMSNorm weights as 1 + w (what the norm multiplies by);
# ours hold w, as Hugging Face checkpoints do (transformers' GGUF loader subtracts the 1 too).
_NORM_PLUS_ONE = {"gemma2", "gemma3"}
# llama.cpp's Gemma 27B models scale queries by hidden/heads, not head_dim (by their layer count)
_SPLIT_NAME = re.compile(r"-\d{5}-of-\d{5}\.gguf$")

# general.sampling.* key -> SamplingParams field
SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
    "general.sampling.penalty_last_n": "repetition_window",
}


class GGUFError(ValueError):
    """A GGUF file rosechat cannot load (split, unsupported architecture, unknown tensor)."""


def is_gguf(path: Path) -> bool:
    """By the magic bytes, not the name: Ollama stores models as extension-less sha256-… blobs."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def find_in_folder(folder: Path) -> Path | None:
    """The one GGUF file in `folder`, None if it has none; several are an error (which one?)."""
    files = sorted(p for p in folder.glob("*.gguf") if p.is_file())
    if len(files) > 1:
        names = ", ".join(p.name for p in files[:6])
        raise GGUFError(f"{folder} holds {len(files)} GGUF files ({names}): name the one to load")
    return files[0] if files else None


class _FastArrays:
    """gguf.GGUFReader reading a plain ndarray view of its np.memmap: the reader slices the map once per
    string of the vocabulary and merges (~100k for SmolLM2), and each memmap slice costs Python-level
    __array_finalize__ / __getitem__ calls (half of its 9 s on a busy 2-core machine). The memmap stays
    the view's base (drop_mapped_pages finds it there)."""

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._data = value.view(np.ndarray) if isinstance(value, np.memmap) else value


@functools.cache
def _reader_class() -> type:
    import gguf  # imported when a file is opened, not with this module

    return type("GGUFReader", (_FastArrays, gguf.GGUFReader), {})


class GGUFModel:
    """One GGUF file: its metadata at once, its tensors when asked."""

    def __init__(self, path: Path) -> None:
        """Reads the header only (gguf_header.py): array fields are read when asked for (field())."""
        self.path = path
        if _SPLIT_NAME.search(path.name):
            raise GGUFError(f"{path.name} is one part of a split GGUF; split files are not supported: "
                            "merge them first (llama.cpp's `llama-gguf-split --merge`)")
        try:
            self.header = read_header(path)
        except HeaderError as e:
            if e.type_id is not None:  # a type id newer than the installed gguf package
                raise GGUFError(f"{path.name}: a tensor has GGML type id {e.type_id}, which this gguf package "
                                f"({_gguf_version()}) does not know; rosechat cannot load it") from e
            if e.truncated:
                raise GGUFError(f"{path} is truncated or damaged: its tensors' data does not fit the file "
                                f"({path.stat().st_size:,} bytes; {e}); download or copy it again") from e
            raise GGUFError(f"{path} is not a readable GGUF file: {e}") from e
        except Exception as e:
            raise GGUFError(f"{path} is not a readable GGUF file: {e}") from e
        if int(self.field("split.count", 1)) > 1:
            raise GGUFError(f"{path.name} is one part of a split GGUF ({self.field('split.count')} parts); "
                            "split files are not supported: merge them first (`llama-gguf-split --merge`)")
        self.arch = str(self.field("general.architecture", ""))
        if self.arch not in ARCHITECTURES:
            raise GGUFError(f"{path.name}: GGUF architecture {self.arch!r} is not supported; "
                            f"supported: {', '.join(sorted(ARCHITECTURES))}")
        if any(t.name.startswith("rope_factors_") for t in self.header.tensors):  # llama.cpp's LongRoPE factors
            raise GGUFError(f"{path.name}: LongRoPE scaling (rope_type 'longrope', Phi-3's 128k-context models) "
                            "is not supported; the 4k-context variants are")
        self._check_tensor_types()

    def _check_tensor_types(self) -> None:
        """Refuse, naming the tensor, a type the load cannot read (gguf's dequantizers lack it: Q8_1,
        integer or F64 tensors), now rather than partway through the weights: one zero block of each type
        goes through the dequantizer (the header says the types; no tensor data is read)."""
        import numpy as np
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize

        seen: set[str] = set()
        for t in self.header.tensors:
            if t.type_name in seen:
                continue
            seen.add(t.type_name)
            qtype = GGMLQuantizationType[t.type_name]
            try:
                dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8), qtype)
            except NotImplementedError:
                raise GGUFError(f"{self.path.name}: tensor {t.name!r} has type {t.type_name}, which rosechat "
                                "cannot load (it reads F32, F16, BF16, Q4_0 to Q8_0, the K-quants and the IQ "
                                "types)") from None

    @functools.cached_property
    def reader(self) -> Any:
        """gguf's own reader (gguf.GGUFReader), opened at first use (an array of arrays; tests)."""
        return _reader_class()(self.path)

    def field(self, key: str, default: Any = None) -> Any:
        """A metadata value: a scalar or string, or an array as a list (what gguf's contents() gives)."""
        if key in self.header.fields:
            return self.header.fields[key]
        if (info := self.header.arrays.get(key)) is None:
            return default
        try:
            return read_array(self.path, info)
        except ValueError:  # an array of arrays: gguf's reader has them
            return self.reader.fields[key].contents()

    # ------------------------------------------------------------------ config, tokenizer, settings
    def config_and_tokenizer(self, say: Callable[[str], None] = lambda _: None) -> tuple[Any, Any]:
        """(config, tokenizer) as transformers converts them, once per file (gguf_config.py)."""
        return gguf_config.config_and_tokenizer(self, ARCHITECTURES[self.arch], say)

    def config_then_tokenizer(self, say: Callable[[str], None] = lambda _: None) -> tuple[Any, Callable[[], Any]]:
        """(config, a function returning the tokenizer): a first load converts it in a thread meanwhile."""
        return gguf_config.config_then_tokenizer(self, ARCHITECTURES[self.arch], say)

    def eos_token_ids(self) -> list[int]:
        keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        return [int(v) for k in keys if (v := self.field(k)) is not None]

    def sampling_defaults(self) -> dict[str, float | int]:
        """The generation settings the file carries (general.sampling.*), as SamplingParams fields."""
        return {name: self.field(key) for key, name in SAMPLING_KEYS.items() if self.field(key) is not None}

    def rope_factors(self) -> Tensor | None:
        """Llama 3.x RoPE scaling as llama.cpp stores it: a divisor per rotary frequency
        (rope_freqs.weight), which transformers' GGUF config does not carry over."""
        from gguf import dequantize

        if not any(t.name == "rope_freqs.weight" for t in self.header.tensors):
            return None
        from gguf import GGMLQuantizationType

        for t in self.header.tensors:
            if t.name == "rope_freqs.weight":
                data = self.tensor_bytes(t)
                return torch.from_numpy(np.array(dequantize(data, GGMLQuantizationType[t.type_name]),
                                                 dtype=np.float32)).flatten()
        return None

    @functools.cached_property
    def mapped(self) -> np.ndarray:
        """The whole file, memory-mapped read-only (a plain array over an np.memmap: drop_mapped_pages
        finds the map through its base)."""
        return np.memmap(self.path, mode="r").view(np.ndarray)

    def tensor_bytes(self, t: TensorInfo) -> np.ndarray:
        """A tensor's bytes in the mapped file, uint8 [rows, row bytes] (rows: all but its innermost dim)."""
        rows = 1
        for d in t.shape[1:]:
            rows *= d
        return self.mapped[t.offset : t.offset + t.n_bytes].reshape(rows, -1)

    # ------------------------------------------------------------------ tensors
    def tensor_types(self, model: nn.Module, config: Any) -> dict[str, str]:
        """Hugging Face checkpoint name -> GGML type name (F32, Q4_1, Q8_0, ...) of every tensor."""
        names = self._hf_names(model, config)
        return {names[t.name]: t.type_name for t in self.header.tensors if t.name in names}

    def iter_tensors(
        self, model: nn.Module, config: Any, progress: Callable[[int, int], None] | None = None,
        raw: set[str] | frozenset[str] = frozenset(),
    ) -> Iterator[tuple[str, Any, str]]:
        """(checkpoint name, dense float32 tensor, file name) in Hugging Face naming, for load_weights.
        Quantized tensors named in `raw` come as their GGUF blocks (GGUFBlocks) instead,
        for a packed load.

        The memory-mapped file's pages are dropped as the consumer takes each tensor (copies or
        packs it), so the file is not resident alongside its copy while loading."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize

        names = self._hf_names(model, config)
        tensors = self.header.tensors
        data = self.mapped
        # dropped from here to the tensor just taken, not only its own pages: the shards a merged
        # module stages (q and k until v comes) fault back in when it packs them
        start = min((t.offset for t in tensors), default=0)
        for i, t in enumerate(tensors):
            hf = names.get(t.name)
            qtype = GGMLQuantizationType[t.type_name]
            if hf is None:
                if t.name == "rope_freqs.weight":  # applied by rope_factors(), not a parameter
                    if progress is not None:
                        progress(i + 1, len(tensors))
                    continue
                raise GGUFError(f"{self.path.name}: tensor {t.name!r} has no place in {ARCHITECTURES[self.arch]}")
            if hf in raw and GGML_QUANT_SIZES[qtype][0] > 1 and len(t.shape) == 2:
                blocks = self.tensor_bytes(t)  # uint8 [rows, row bytes], memory-mapped
                pages = _file_pages(data, t.offset, blocks.shape[1])
                permuted = self.arch in _PERMUTED_QK and t.name.split(".")[-2] in ("attn_q", "attn_k")
                if permuted or t.n_bytes <= _POPULATE_WHOLE:  # else a streamed repack maps it by chunks (rowpack)
                    populate_mapped_pages(data, t.offset, t.n_bytes)
                if permuted:
                    heads = config.num_attention_heads if ".attn_q." in t.name else config.num_key_value_heads
                    blocks, pages = _unpermute_qk(blocks, heads), None  # whole rows move: blocks stay intact
                shape = (int(t.shape[1]), int(t.shape[0]))
                yield hf, GGUFBlocks(blocks, t.type_name, shape, pages), self.path.name
                drop_mapped_pages(data, start, t.offset + t.n_bytes - start)
                if progress is not None:
                    progress(i + 1, len(tensors))
                continue
            # numpy shape is the GGUF shape reversed: [out, in], as torch's Linear holds it
            array = np.asarray(dequantize(self.tensor_bytes(t), qtype), dtype=np.float32)
            array = array.reshape(tuple(int(d) for d in reversed(t.shape)))
            if self.arch in _PERMUTED_QK and t.name.split(".")[-2] in ("attn_q", "attn_k"):
                heads = config.num_attention_heads if ".attn_q." in t.name else config.num_key_value_heads
                array = _unpermute_qk(array, heads)
            tensor = torch.from_numpy(array if array.flags.writeable else array.copy())
            if self.arch == "gpt2" and hf.endswith(_GPT2_CONV1D):
                tensor = tensor.t()  # back to the Conv1D layout of a Hugging Face GPT-2 checkpoint
            if self.arch in _NORM_PLUS_ONE and t.name.endswith("norm.weight"):
                tensor = tensor - 1.0
            yield hf, tensor, self.path.name
            drop_mapped_pages(data, start, t.offset + t.n_bytes - start)
            if progress is not None:
                progress(i + 1, len(tensors))

    def _hf_names(self, model: nn.Module, config: Any) -> dict[str, str]:
        """GGUF tensor name -> Hugging Face checkpoint name, through gguf's own TensorNameMap."""
        import gguf

        arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[self.arch]
        name_map = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
        mapping = {}
        for hf in _checkpoint_names(model):
            gguf_name = name_map.get_name(hf, try_suffixes=(".weight", ".bias"))
            if gguf_name is not None:
                mapping[gguf_name] = hf
        return mapping


_GPT2_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"gguf {version('gguf')}"
    except PackageNotFoundError:
        return "gguf"


def _checkpoint_names(model: nn.Module) -> Iterator[str]:
    """The Hugging Face tensor names a checkpoint of `model` has (merged projections split back)."""
    parts_of: dict[str, list[str]] = {}
    for part, (merged, _) in getattr(model, "packed_modules", {}).items():
        parts_of.setdefault(merged, []).append(part)
    names = [name for name, _ in model.named_parameters()]
    names += [f"{name}.weight" for name, m in model.named_modules() if hasattr(m, "load_shard")]  # packed
    for name in names:
        *head, module, leaf = name.split(".")
        prefix = ".".join(head) + "." if head else ""
        for part in parts_of.get(module, [module]):
            yield f"{prefix}{part}.{leaf}"
    yield "lm_head.weight"  # a tied model's GGUF may still carry output.weight


def _unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (rotary halves interleaved per head)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation (the inverse of _unpermute_qk); tests write files with it."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_MADV_POPULATE_READ = 22  # Linux 5.14+ (Python's mmap module does not name it yet)
_POPULATE_WHOLE = 64 << 20  # a tensor up to this size is mapped in whole ahead of its repack


def _file_pages(data: np.ndarray, offset: int, row_bytes: int) -> FilePages:
    """The pages under rows of a tensor at `offset` in the mapped file `data` (GGUFBlocks.pages)."""
    return FilePages(lambda r0, r1: populate_mapped_pages(data, offset + r0 * row_bytes, (r1 - r0) * row_bytes),
                     lambda r0, r1: drop_mapped_pages(data, offset + r0 * row_bytes, (r1 - r0) * row_bytes))


def populate_mapped_pages(array: Any, start: int, length: int) -> None:
    """Map the file's pages [start, start + length) in one call, ahead of reading them: one page fault
    per 4 KiB otherwise, most of the time a cold repack spends in its first read of a tensor."""
    import mmap

    mapping = getattr(array, "_mmap", None) or getattr(getattr(array, "base", None), "_mmap", None)
    first = start - start % mmap.PAGESIZE
    if mapping is None or length <= 0:
        return
    try:
        mapping.madvise(_MADV_POPULATE_READ, first, min(len(mapping), start + length) - first)
    except (OSError, ValueError):  # an older kernel: the pages fault in one by one
        pass


def drop_mapped_pages(array: Any, start: int = 0, length: int | None = None) -> None:
    """Let the OS drop the pages of a memory-mapped file read during loading (gguf's reader maps
    the whole file), all of them or the bytes [start, start + length) of the mapping: they are clean
    and count as resident until dropped; a later read faults them back in from the file (the map
    is read-only: nothing written is lost)."""
    import mmap

    mapping = getattr(array, "_mmap", None) or getattr(getattr(array, "base", None), "_mmap", None)
    if mapping is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    first = start - start % mmap.PAGESIZE  # madvise takes whole pages: the neighbours' may go too
    end = len(mapping) if length is None else min(len(mapping), start + length)
    if end <= first:
        return
    try:
        mapping.madvise(mmap.MADV_DONTNEED, first, end - first)
    except (OSError, ValueError):
        pass


__all__ = ["ARCHITECTURES", "GGUFError", "GGUFModel", "drop_mapped_pages", "find_in_folder", "is_gguf", "permute_qk"]
