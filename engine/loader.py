"""Load a model: a GGUF file, a Hugging Face folder or hub id, a model a registry package ships,
or the built-in demo.

`resolve_model` finds the model and checks what can be checked without loading weights, so a
front end can refuse a bad name before it starts. `load_model` then builds the model with
uninitialised parameters on the target device and copies the checkpoint in tensor by tensor, so
no second full copy exists. Safetensors are read with `safetensors`; GGUF files with the `gguf`
package (see gguf_file.py). `transformers` gives the config, tokenizer and chat template.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import init
from torch.overrides import TorchFunctionMode

from engine import defaults, demo, quant
from engine.events import LoadProgress
from engine.gguf_file import GGUFModel
from engine.model_source import (  # noqa: F401  (re-exported: engine.loader is where they were)
    PACKAGED_MODELS,
    ModelNotFoundError,
    ModelSource,
    checkpoint_files,
    generation_defaults,
    packaged_model_path,
    resolve_model,
    resolve_model_path,
)
from engine.models import get_model_class
from engine.models.layers import MergedLinear
from kernels.cpu import ops as cpu_ops

Progress = Callable[[LoadProgress], None]  # how far loading is


class Stages:
    """Says each stage of a load to a Progress callback, with the seconds since loading began."""

    def __init__(self, progress: Progress | None = None) -> None:
        self.progress, self.start = progress, time.monotonic()

    def __call__(self, stage: str, done: int = 0, total: int = 0) -> None:
        if self.progress is not None:
            self.progress(LoadProgress(stage, done, total, time.monotonic() - self.start))


class WeightLoadError(ValueError):
    """The checkpoint does not fit the model: a missing tensor, an unexpected one, or a wrong shape."""


@dataclass
class LoadedModel:
    model: nn.Module
    config: Any  # transformers PretrainedConfig
    tokenizer: Any  # transformers PreTrainedTokenizerBase
    name: str
    is_demo: bool
    max_model_len: int
    eos_token_ids: list[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    # the model's own sampling settings (SamplingParams fields) and where they came from
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    generation_source: str = ""

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype: its floating-point parameters' (packed weights keep their norms in it)."""
        return next(p.dtype for p in self.model.parameters() if p.is_floating_point())


def load_model(
    model: str | ModelSource,
    dtype: torch.dtype | str = "auto",
    device: torch.device | str = "auto",
    progress: Progress | Stages | None = None,
    quantization: str | None = None,
) -> LoadedModel:
    """Load `model` (a name for resolve_model, or what it returned). Raises ModelNotFoundError
    when it is nowhere, ValueError (WeightLoadError, GGUFError) when it cannot be loaded.

    `quantization` (engine/quant.py): "none" dequantizes a GGUF file's weights to `dtype`; "int4" /
    "int8" keep every linear layer (and a tied head's embedding) packed; "auto" keeps each GGUF
    tensor's precision class (Q4 -> int4, Q8_0 -> int8, float -> dense). None: the source's own
    setting (ModelSource.quantization, "auto" unless set). "auto" dtype, device and quantization are
    resolved by engine/defaults.py, as for every entry point."""
    say = progress if isinstance(progress, Stages) else Stages(progress)
    if not isinstance(model, ModelSource):
        say("reading the file")
    source = model if isinstance(model, ModelSource) else resolve_model(str(model))
    d = defaults.resolve(str(device), dtype, quantization or source.quantization)
    device, dtype, quantization = torch.device(d.device), d.torch_dtype, d.quantization
    if device.type == "cpu" and cpu_ops.supported_cpu():
        say("building the CPU kernels (once)" if cpu_ops.needs_build() else "loading the CPU kernels")
        cpu_ops.available()
    if quantization == "auto" and not quant.kernels_available(device):
        quantization = "none"  # "auto" packs only where there are kernels for it: dequantize elsewhere
    if source.kind == "demo":
        return _load_demo(source.name, dtype, device)
    if source.kind == "gguf":
        return _load_gguf(source, dtype, device, say, quantization)

    from transformers import AutoConfig, AutoTokenizer

    path = source.path
    say("reading the config")
    config = AutoConfig.from_pretrained(path)
    if quantization in ("int8", "int4"):  # weight-only quantization at load ("auto": as stored)
        net = build_model(config, dtype, torch.device("meta"))
        _check_packing(net, quantization, device)
        quant.swap_in_packed(net, {name: quantization for name in _packable(net)}, dtype, device)
        net = net.to_empty(device=device).requires_grad_(False)
    else:
        net = build_model(config, dtype, device)
    say("loading weights")
    load_weights(net, path)
    if quantization in ("int8", "int4"):
        quant.release_freed_memory()
    net.eval()
    say("reading the tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(path)
    loaded = _loaded(net, config, tokenizer, source.display_name, False, _eos_ids(path, config, tokenizer))
    loaded.generation_defaults = generation_defaults(source)
    loaded.generation_source = "generation_config.json" if loaded.generation_defaults else ""
    return loaded


def _load_gguf(
    source: ModelSource, dtype: torch.dtype, device: torch.device, say: Stages, quantization: str = "none"
) -> LoadedModel:
    if source.gguf is None:
        say("reading the file")
    gguf = source.gguf or GGUFModel(source.path)
    config, tokenizer = gguf.config_and_tokenizer(say)
    net = build_model(config, dtype, torch.device("meta"))
    raw = _plan_packing(net, config, gguf, quantization, device, dtype)
    net = net.to_empty(device=device).requires_grad_(False)
    stage = "repacking weights" if raw else "loading weights"
    say(stage, 0, len(gguf.reader.tensors))
    load_weights(net, gguf.iter_tensors(net, config, lambda done, total: say(stage, done, total), raw=raw),
                 where=source.path.name)
    if (factors := gguf.rope_factors()) is not None:  # only Llama-family files carry them
        try:
            net.model.rotary.divide_frequencies(factors)
        except ValueError as e:
            raise WeightLoadError(f"{source.path.name}: rope_freqs.weight does not fit: {e}") from e
    net.eval()
    eos = [i for i in [*gguf.eos_token_ids(), tokenizer.eos_token_id] if i is not None]
    loaded = _loaded(net, config, tokenizer, source.display_name, False, list(dict.fromkeys(eos)))
    loaded.generation_defaults = gguf.sampling_defaults()
    loaded.generation_source = "GGUF metadata" if loaded.generation_defaults else ""
    # Every weight is a copy (packed or dense) and the metadata is read: the file's pages that came
    # back (staged shards, rope_freqs, the header) go too, so the model is resident once.
    quant.drop_mapped_pages(gguf.reader.data)
    quant.release_freed_memory()  # packing's and dequantizing's temporaries
    return loaded


def resolve_dtype(dtype: torch.dtype | str, device: torch.device | str = "cpu") -> torch.dtype:
    """torch dtype from a dtype or a name ("float32", "bf16", "auto": engine/defaults.py's choice)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    return defaults.resolve(str(torch.device(device)), dtype, "none").torch_dtype


def _plan_packing(
    net: nn.Module, config: Any, gguf: GGUFModel, quantization: str, device: torch.device, dtype: torch.dtype
) -> set[str]:
    """Swap the modules `quantization` packs into packed ones (the model is still on meta) and
    return the checkpoint names to read as raw GGUF blocks."""
    if quantization == "none":
        return set()
    if gguf.arch == "gpt2" and quantization == "auto":
        return set()
    _check_packing(net, quantization, device)
    packable = _packable(net)
    modes: dict[str, str] = {}
    raw: set[str] = set()
    for hf, type_name in gguf.tensor_types(net, config).items():
        target = net.weight_target(hf)
        if target is None or not target[0].endswith(".weight"):
            continue
        module = target[0].rpartition(".")[0]
        if module not in packable:
            continue
        mode = quant.auto_mode(type_name) if quantization == "auto" else quantization
        if mode == "none":
            continue
        if modes.get(module) not in (None, mode):  # shards of mixed classes (Q4_K_M's v): the wider
            mode = "int8"
        modes[module] = mode
        raw.add(hf)
    quant.swap_in_packed(net, modes, dtype, device)
    return raw


def _check_packing(net: nn.Module, quantization: str, device: torch.device) -> None:
    if not quant.kernels_available(device):
        raise ValueError(f"quantization {quantization!r} needs packed-weight kernels, and there are none for "
                         f"{device} here ({quant.route(device)}): use quantization 'none' or 'auto'")
    if not hasattr(net, "packed_modules") or type(net).__name__.startswith("GPT2"):
        raise ValueError("packed weights are not supported for GPT-2 models yet: use quantization 'none' or 'auto'")


def _packable(net: nn.Module) -> set[str]:
    """The modules a packed load replaces: every linear layer, and the token embedding when it is
    also the head (tied); an untied model's embedding only looks rows up and stays dense."""
    packable = set(quant.packable_modules(net))
    if getattr(net, "lm_head", None) is None:
        packable.discard("lm_head")
    else:
        packable = {n for n in packable if not n.endswith(("embed_tokens", "wte"))}
    return packable


def build_model(config: Any, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The model for `config.architectures[0]` with uninitialised parameters on `device`.

    Built on the meta device first, so no memory is spent on (or time on initialising) weights
    that the checkpoint overwrites. Inference only: parameters do not require grad."""
    cls = get_model_class(config)
    with torch.device("meta"), _SkipMetaInit():
        model = cls(config)
    return model.to(dtype).to_empty(device=device).requires_grad_(False)


class _SkipMetaInit(TorchFunctionMode):
    """Initialisers as no-ops on meta tensors while a model is built: to_empty drops the values
    anyway, and normal_ (nn.Embedding's) on meta runs torch's Python reference, whose first call
    imports torch._dynamo and Triton: ~100 MiB resident (93 MiB of libtriton.so) nothing needs.
    A mode, not patched nn.init functions: modes are per thread, so loads in threads cannot clash."""

    # nn.init's functions that dispatch to modes (Linear's, Embedding's), and the tensor methods the others call
    _SKIP = frozenset((init.uniform_, init.normal_, init.constant_, init.kaiming_uniform_, Tensor.uniform_,
                       Tensor.normal_))

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in self._SKIP:
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


def iter_checkpoint(path: Path) -> Iterator[tuple[str, Tensor, str]]:
    """(name, tensor, file name) for every tensor of a (possibly sharded) safetensors checkpoint."""
    from safetensors import safe_open

    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name), file.name


def load_weights(
    model: nn.Module, checkpoint: Path | Iterable[tuple[str, Tensor, str]], where: str | None = None
) -> None:
    """Copy every checkpoint tensor into its parameter (rows of a merged projection, transposed
    for GPT-2's Conv1D) and check that every parameter was filled. `checkpoint` is a safetensors
    folder, or (Hugging Face name, tensor, file name) triples from another format."""
    params = dict(model.named_parameters())
    packed = quant.packed_modules(model)  # modules whose weight stays packed (engine/quant.py)
    loaded: dict[str, set[int | None]] = {}
    arch = type(model).__name__
    if isinstance(checkpoint, (str, Path)):
        checkpoint, where = iter_checkpoint(Path(checkpoint)), where or str(checkpoint)
    for name, tensor, file in checkpoint:
        target = model.weight_target(name)
        if target is None:
            continue
        param_name, shard, transpose = target
        module_name, _, leaf = param_name.rpartition(".")
        if leaf == "weight" and module_name in packed:
            module = packed[module_name]
            try:
                module.load_shard(shard, tensor.t() if transpose and isinstance(tensor, Tensor) else tensor)
            except ValueError as e:
                raise WeightLoadError(f"tensor {name!r} in {file} does not fit {param_name}: {e}") from e
            if not module.missing_shards():
                module.finish()  # packed as soon as complete: the staged shards go at once
            continue
        param = params.get(param_name)
        if param is None:
            raise WeightLoadError(f"unexpected tensor {name!r} in {file}: {arch} has no parameter {param_name!r}")
        dst = param  # not .data: writing the parameter bumps its version, which cached packed copies check
        where = param_name
        if shard is not None:
            start, rows = _merged_module(model, param_name).shard_rows(shard)
            dst = dst.narrow(0, start, rows)
            where = f"{param_name} rows {start}:{start + rows}"
        src = tensor.t() if transpose else tensor
        if src.shape != dst.shape:
            raise WeightLoadError(
                f"tensor {name!r} in {file} has shape {tuple(tensor.shape)}"
                f"{' (transposed: ' + str(tuple(src.shape)) + ')' if transpose else ''}, "
                f"but {arch} expects {tuple(dst.shape)} for {where}"
            )
        with torch.no_grad():
            dst.copy_(src)
        loaded.setdefault(param_name, set()).add(shard)

    missing = []
    for param_name in params:
        module = _merged_module(model, param_name)
        if module is None:
            if param_name not in loaded:
                missing.append(param_name)
            continue
        # name the checkpoint tensors (q_proj, up_proj, ...) a merged parameter still lacks
        parts = param_name.split(".")
        for part, (merged, shard) in getattr(model, "packed_modules", {}).items():
            if merged == parts[-2] and shard not in loaded.get(param_name, set()):
                missing.append(".".join([*parts[:-2], part, parts[-1]]))
    for module_name, module in packed.items():
        sizes = getattr(module, "output_sizes", [0])
        for shard in module.missing_shards():
            missing.append(f"{module_name}.weight" + (f" (shard {shard})" if len(sizes) > 1 else ""))
    if missing:
        raise WeightLoadError(
            f"checkpoint {where} lacks {len(missing)} tensor(s) that {arch} needs: {', '.join(missing[:8])}"
            + (" ..." if len(missing) > 8 else "")
        )
    for module in packed.values():
        module.finish()  # pack once; the staged shards are dropped


def _merged_module(model: nn.Module, param_name: str) -> MergedLinear | quant.PackedLinear | None:
    module = model.get_submodule(param_name.rpartition(".")[0])
    if isinstance(module, quant.PackedLinear) and len(module.output_sizes) > 1:  # its bias is merged too
        return module
    return module if isinstance(module, MergedLinear) else None


def max_model_len(config: Any) -> int:
    """Context length: max_position_embeddings, capped at a sliding window if the model has one
    (the paged kernels attend to the full context, so longer contexts would be inexact)."""
    length = int(config.max_position_embeddings)
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True):
        length = min(length, int(window))
    return length


def _eos_ids(path: Path, config: Any, tokenizer: Any) -> list[int]:
    """EOS ids from generation_config.json, the config and the tokenizer, in that order, deduplicated."""
    sources: list[Any] = []
    generation_config = path / "generation_config.json"
    if generation_config.is_file():
        sources.append(json.loads(generation_config.read_text()).get("eos_token_id"))
    sources.append(getattr(config, "eos_token_id", None))
    sources.append(getattr(tokenizer, "eos_token_id", None))
    ids: list[int] = []
    for source in sources:
        for token_id in source if isinstance(source, list) else [source]:
            if token_id is not None and int(token_id) not in ids:
                ids.append(int(token_id))
    return ids


def _loaded(
    model: nn.Module, config: Any, tokenizer: Any, name: str, is_demo: bool, eos: list[int]
) -> LoadedModel:
    attn = model.attention_layers()[0]
    return LoadedModel(
        model=model,
        config=config,
        tokenizer=tokenizer,
        name=name,
        is_demo=is_demo,
        max_model_len=max_model_len(config),
        eos_token_ids=eos,
        num_layers=len(model.attention_layers()),
        num_kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim,
    )


def _load_demo(name: str, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    config = demo.demo_config(name)
    tokenizer = demo.demo_tokenizer(config.vocab_size)
    model = build_model(config, dtype, device)
    demo.init_random_weights(model)
    model.eval()
    eos = [tokenizer.convert_tokens_to_ids(t) for t in demo.EOS_TOKENS]
    return _loaded(model, config, tokenizer, f"{name} (random weights)", True, eos)


__all__ = [
    "LoadedModel",
    "ModelNotFoundError",
    "WeightLoadError",
    "build_model",
    "load_model",
    "load_weights",
    "ModelSource",
    "PACKAGED_MODELS",
    "generation_defaults",
    "packaged_model_path",
    "resolve_dtype",
    "resolve_model",
    "resolve_model_path",
]
