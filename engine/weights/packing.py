"""Packing a model: the modules that hold packed weights (`PackedLinear`, `PackedEmbedding`), which
of a model's modules a load packs and in which format (`quantization`: "int4", "int8", "auto"), and
swapping them in while the model is still on the meta device, before any weight is allocated.

Each packed module stages its checkpoint shards as they arrive and packs them once, through
routes.pack, into the operand its device's route multiplies (q4.py, q5.py, q6.py, q8.py, packed.py);
which form each GGUF type keeps, and what it costs, is formats.py's table.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import Tensor, nn

from engine.defaults import QUANTIZATIONS
from engine.weights.blocks import GROUP, GGUFBlocks
from engine.weights.formats import auto_mode, no_kernel_warning
from engine.weights.gguf import GGUFModel
from engine.weights.packed import ROW_GROUP, BlockWeight, PackedWeight
from engine.weights.routes import CPU, concat_rows, kernels_available, pack, route
from engine.weights.rowpack import DENSE, fill_rows, source_type, streamed_class

MODES = QUANTIZATIONS  # what load_model accepts (engine/defaults.py resolves "auto")
log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------- modules
class PackedLinear(nn.Module):
    """A Linear (or MergedLinear) whose weight is packed. Shards arrive one by one at load
    (`load_shard`): where its format streams (rowpack.py) each is packed into its rows of the final
    tensors at once; otherwise they are staged and `finish()` packs them together. Only the packed
    form is kept."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: Tensor | None, mode: str,
                 device: torch.device = CPU) -> None:  # fmt: skip
        super().__init__()
        self.device = device  # where finish() puts the packed weight
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.out_features = sum(output_sizes)
        self.mode = mode
        self.bias = bias  # a Parameter moved over from the dense module (or None)
        self.weight: PackedWeight | None = None
        # the shards' source types (rowpack.source_type), set by plan_packing for a GGUF file; dense otherwise
        self.source_types = [DENSE] * len(self.output_sizes)
        self._shards: dict[int, Tensor | GGUFBlocks] = {}
        self._filling: BlockWeight | None = None  # being packed shard by shard
        self._filled: set[int] = set()

    def shard_rows(self, shard: int) -> tuple[int, int]:
        return sum(self.output_sizes[:shard]), self.output_sizes[shard]

    def load_shard(self, shard: int | None, source: Tensor | GGUFBlocks) -> None:
        index = 0 if shard is None else shard
        rows = self.output_sizes[index] if shard is not None else self.out_features
        if tuple(source.shape) != (rows, self.in_features):
            raise ValueError(f"has shape {tuple(source.shape)}, expected {(rows, self.in_features)}")
        cls = self._streamed_class()
        if cls is not None and source_type(source) == self.source_types[index]:
            if self._filling is None:
                self._filling = cls.allocate(self.out_features, self.in_features)
            fill_rows(self._filling, self.shard_rows(index)[0] if shard is not None else 0, source)
            self._filled.add(index)
            return
        if self._filling is not None:  # a shard unlike the plan after others were packed: cannot happen
            raise ValueError(f"is {source_type(source)}, expected {self.source_types[index]}")
        self._shards[index] = source.detach().clone() if isinstance(source, Tensor) else source

    def _streamed_class(self) -> type[BlockWeight] | None:
        """The class to pack into shard by shard: a streamed format on our CPU route, every shard starting a
        row group."""
        if route(self.device) != "rosechat" or any(sum(self.output_sizes[:i]) % ROW_GROUP
                                                   for i in range(len(self.output_sizes))):
            return None
        return streamed_class(self.mode, self.source_types)

    def missing_shards(self) -> list[int]:
        if self.weight is not None:
            return []
        count = len(self.output_sizes) if len(self.output_sizes) > 1 else 1
        return [i for i in range(count) if i not in self._shards and i not in self._filled]

    def finish(self, keep_rows: bool = False) -> None:
        if self.weight is None and self._filling is not None:
            self.weight, self._filling, self._filled = self._filling, None, set()
        elif self.weight is None:
            parts = [self._shards[i] for i in sorted(self._shards)]
            self.weight = pack(parts[0] if len(parts) == 1 else concat_rows(parts), self.mode, keep_rows, self.device)
            self._shards = {}

    def forward(self, x: Tensor) -> Tensor:
        return self.weight.linear(x, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}"


class PackedEmbedding(nn.Module):
    """An embedding table kept packed: lookups dequantize only the rows asked for; a tied head
    multiplies by the same packed weight (`linear(hidden, embed.weight)`)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, mode: str, dtype: torch.dtype,
                 device: torch.device = CPU) -> None:  # fmt: skip
        super().__init__()
        self.device = device
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.mode = mode
        self.out_dtype = dtype
        self.weight: PackedWeight | None = None
        self._source: Tensor | GGUFBlocks | None = None

    def load_shard(self, shard: int | None, source: Tensor | GGUFBlocks) -> None:
        if tuple(source.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"has shape {tuple(source.shape)}, expected {(self.num_embeddings, self.embedding_dim)}")
        if route(self.device) == "rosechat":  # one shard: packed at once, by row chunks (routes.pack)
            self.weight = pack(source, self.mode, keep_rows=True, device=self.device)
            return
        self._source = source.detach().clone() if isinstance(source, Tensor) else source

    def missing_shards(self) -> list[int]:
        return [0] if self.weight is None and self._source is None else []

    def finish(self, keep_rows: bool = True) -> None:
        if self.weight is None:
            self.weight = pack(self._source, self.mode, keep_rows=True, device=self.device)
            self._source = None

    def forward(self, ids: Tensor) -> Tensor:
        return self.weight.rows(ids, self.out_dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, mode={self.mode}"


def packed_modules(model: nn.Module) -> dict[str, PackedLinear | PackedEmbedding]:
    return {name: m for name, m in model.named_modules() if isinstance(m, (PackedLinear, PackedEmbedding))}


# ---------------------------------------------------------------------------------- which modules
def swap_in_packed(model: nn.Module, modes: dict[str, str], dtype: torch.dtype, device: torch.device = CPU) -> None:
    """Replace the Linear / MergedLinear / Embedding modules named in `modes` (module name ->
    "int4" | "int8") by packed ones for `device`, before any weight is allocated (the model is on meta)."""
    from engine.models.layers import MergedLinear

    for name, mode in modes.items():
        if mode not in ("int4", "int8"):
            continue
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, leaf)
        if isinstance(old, nn.Embedding):
            new: nn.Module = PackedEmbedding(old.num_embeddings, old.embedding_dim, mode, dtype, device)
        elif isinstance(old, nn.Linear):
            if old.in_features % GROUP:
                continue  # groups of 32 do not fit: stays dense
            sizes = old.output_sizes if isinstance(old, MergedLinear) else [old.out_features]
            new = PackedLinear(old.in_features, sizes, old.bias, mode, device)
        else:
            raise TypeError(f"{name} is a {type(old).__name__}: only linear layers and embeddings can be packed")
        setattr(parent, leaf, new)


def packable_modules(model: nn.Module, untied_embedding: bool = False) -> list[str]:
    """The module names a packed load replaces: every linear layer, and the token embedding(s) when
    the model is tied (no lm_head: the head multiplies by the embedding). An untied model's embedding
    only looks rows up: it stays dense unless `untied_embedding` (a GGUF file's quantized embedding, kept
    as the file has it: Llama 3 8B's would take 2 GB as float32), as do position embeddings."""
    tied = getattr(model, "lm_head", None) is None
    names = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module.in_features % GROUP == 0:
            names.append(name)
        elif (tied or untied_embedding) and isinstance(module, nn.Embedding) and name.endswith(("embed_tokens", "wte")):
            if module.embedding_dim % GROUP == 0:
                names.append(name)
    return names


def check_packing(net: nn.Module, quantization: str, device: torch.device) -> None:
    """Refuse a packed load (int4 / int8) that cannot run: no kernels on `device`, or a GPT-2 model."""
    if not kernels_available(device):
        raise ValueError(f"quantization {quantization!r} needs packed-weight kernels, and there are none for "
                         f"{device} here ({route(device)}): use quantization 'none' or 'auto'")
    if not hasattr(net, "packed_modules") or type(net).__name__.startswith("GPT2"):
        raise ValueError("packed weights are not supported for GPT-2 models yet: use quantization 'none' or 'auto'")


def plan_packing(
    net: nn.Module, config: Any, gguf: GGUFModel, quantization: str, device: torch.device, dtype: torch.dtype
) -> set[str]:
    """Swap the modules `quantization` packs into packed ones (the model is still on meta) and
    return the checkpoint names to read as raw GGUF blocks."""
    if quantization == "none":
        return set()
    if gguf.arch == "gpt2" and quantization == "auto":
        return set()
    check_packing(net, quantization, device)
    # an untied embedding keeps its own exact form on our kernels' route (rows dequantized per lookup)
    own_form = route(device) == "rosechat" and getattr(net, "lm_head", None) is not None
    packable = set(packable_modules(net, untied_embedding=own_form))
    modes: dict[str, str] = {}
    types: dict[str, dict[int, str]] = {}  # module -> shard -> source type
    raw: set[str] = set()
    hf_names = gguf._hf_names(net, config)
    sizes = {hf_names[t.name]: math.prod(t.shape) for t in gguf.header.tensors if t.name in hf_names}
    weights: dict[str, int] = {}  # GGUF type -> weights packed, for the warning about types without a kernel
    for hf, type_name in gguf.tensor_types(net, config).items():
        target = net.weight_target(hf)
        if target is None or not target[0].endswith(".weight"):
            continue
        module = target[0].rpartition(".")[0]
        if module not in packable:
            continue
        embedding = isinstance(net.get_submodule(module), nn.Embedding)
        mode = auto_mode(type_name) if quantization == "auto" or (own_form and embedding) else quantization
        if mode == "none":
            continue
        if modes.get(module) not in (None, mode):  # shards of mixed classes (Q4_K_M's v): the wider
            mode = "int8"
        modes[module] = mode
        types.setdefault(module, {})[target[1] or 0] = source_type(type_name)
        raw.add(hf)
        weights[type_name] = weights.get(type_name, 0) + sizes.get(hf, 0)
    if (message := no_kernel_warning(weights, quantization)) is not None:
        log.warning(message)
    swap_in_packed(net, modes, dtype, device)
    for module, shard_types in types.items():
        packed = net.get_submodule(module)
        if isinstance(packed, PackedLinear):
            packed.source_types = [shard_types.get(i, DENSE) for i in range(len(packed.output_sizes))]
    return raw


# ---------------------------------------------------------------------------------- after loading
def packed_bytes(model: nn.Module) -> int:
    return sum(m.weight.nbytes() for m in packed_modules(model).values() if m.weight is not None)


def matmul_weight_cost(model: nn.Module, vocab_size: int, itemsize: int) -> tuple[int, int]:
    """(params, bytes) of the weights one decode token multiplies: every linear and, when the head is
    tied, the embedding matrix; packed weights stream their packed bytes, dense ones `itemsize` each."""
    weights = [m.weight for m in model.modules() if isinstance(m, nn.Linear | PackedLinear)]
    if getattr(model, "lm_head", None) is None:
        weights.append(next(m.weight for m in model.modules()
                            if isinstance(m, nn.Embedding | PackedEmbedding) and m.weight.shape[0] == vocab_size))
    packed = [w for w in weights if isinstance(w, PackedWeight)]
    dense = [w for w in weights if not isinstance(w, PackedWeight)]
    params = sum(w.numel() for w in weights)
    return params, sum(w.nbytes() for w in packed) + sum(w.numel() for w in dense) * itemsize


__all__ = [
    "MODES",
    "PackedEmbedding",
    "PackedLinear",
    "auto_mode",
    "check_packing",
    "matmul_weight_cost",
    "packable_modules",
    "packed_bytes",
    "packed_modules",
    "plan_packing",
    "swap_in_packed",
]
