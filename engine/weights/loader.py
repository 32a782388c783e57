"""Load a model: a GGUF file, a Hugging Face folder or hub id, a model a registry package ships,
or the built-in demo.

`resolve_model` (source.py) finds the model and checks what can be checked without loading weights,
so a front end can refuse a bad name before it starts. `load_model` then builds the model with
uninitialised parameters on the target device and copies the checkpoint in tensor by tensor
(checkpoint.py), so no second full copy exists. Safetensors are read with `safetensors`; GGUF files
with the `gguf` package (gguf.py). `transformers` gives the config, tokenizer and chat template.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import init
from torch.overrides import TorchFunctionMode

from engine import defaults, demo
from engine.events import LoadProgress
from engine.models import get_model_class
from engine.weights.cache import WeightCache
from engine.weights.checkpoint import WeightLoadError, load_weights
from engine.weights.gguf import GGUFModel, drop_mapped_pages
from engine.weights.heap import release_freed_memory
from engine.weights.memory import check_gguf_fits
from engine.weights.packing import check_packing, packable_modules, plan_packing, swap_in_packed
from engine.weights.routes import kernels_available, route
from engine.weights.source import ModelSource, generation_defaults, resolve_model
from kernels.cpu import ops as cpu_ops

log = logging.getLogger(__name__)
Progress = Callable[[LoadProgress], None]  # how far loading is
# For a model whose tokenizer has no chat template (a base model): turns as plain labelled lines
PLAIN_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


class Stages:
    """Says each stage of a load to a Progress callback, with the seconds since loading began."""

    def __init__(self, progress: Progress | None = None) -> None:
        self.progress, self.start = progress, time.monotonic()

    def __call__(self, stage: str, done: int = 0, total: int = 0) -> None:
        if self.progress is not None:
            self.progress(LoadProgress(stage, done, total, time.monotonic() - self.start))


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
    notice: str = ""  # something about the model a user should be told once (a plain chat template)
    dtype_reason: str = ""  # why its activations have their dtype (engine/defaults.py)

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
    weight_cache: bool = True,
) -> LoadedModel:
    """Load `model` (a name for resolve_model, or what it returned). Raises ModelNotFoundError
    when it is nowhere, ValueError (WeightLoadError, GGUFError) when it cannot be loaded.

    `quantization` (packing.py): "none" dequantizes a GGUF file's weights to `dtype`; "int4" /
    "int8" keep every linear layer (and a tied head's embedding) packed; "auto" keeps each GGUF
    tensor's precision class (Q4 -> int4, Q8_0 -> int8, float -> dense). None: the source's own
    setting (ModelSource.quantization, "auto" unless set). "auto" dtype, device and quantization are
    resolved by engine/defaults.py, as for every entry point.

    `weight_cache`: a packed GGUF load keeps its packed tensors in an on-disk cache (cache.py) and a
    later load of the same file maps them instead of repacking; False neither reads nor writes it."""
    say = progress if isinstance(progress, Stages) else Stages(progress)
    if not isinstance(model, ModelSource):
        say("reading the file")
    source = model if isinstance(model, ModelSource) else resolve_model(str(model))
    d = defaults.resolve(str(device), dtype, quantization or source.quantization)
    device, dtype, quantization = torch.device(d.device), d.torch_dtype, d.quantization
    if device.type == "cpu" and cpu_ops.supported_cpu():
        say("building the CPU kernels (once)" if cpu_ops.needs_build() else "loading the CPU kernels")
        cpu_ops.available()
    if quantization == "auto" and not kernels_available(device):
        quantization = "none"  # "auto" packs only where there are kernels for it: dequantize elsewhere
    if source.kind == "demo":
        return _load_demo(source.name, dtype, device)
    if source.kind == "gguf":
        return _load_gguf(source, d, device, say, quantization, weight_cache)

    from transformers import AutoConfig, AutoTokenizer

    path = source.path
    say("reading the config")
    config = AutoConfig.from_pretrained(path)
    if quantization not in ("int8", "int4"):  # dense weights: bfloat16 may be worth it on this CPU
        d = _probe_dtype(d, config, say)
        dtype = d.torch_dtype
    if quantization in ("int8", "int4"):  # weight-only quantization at load ("auto": as stored)
        net = build_model(config, dtype, torch.device("meta"))
        check_packing(net, quantization, device)
        swap_in_packed(net, {name: quantization for name in packable_modules(net)}, dtype, device)
        net = to_empty(net, device).requires_grad_(False)
    else:
        net = build_model(config, dtype, device)
    say("loading weights")
    load_weights(net, path)
    if quantization in ("int8", "int4"):
        release_freed_memory()
    net.eval()
    say("reading the tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(path)
    loaded = _loaded(net, config, tokenizer, source.display_name, False, _eos_ids(path, config, tokenizer))
    loaded.generation_defaults = generation_defaults(source)
    loaded.generation_source = "generation_config.json" if loaded.generation_defaults else ""
    loaded.dtype_reason = d.dtype_reason
    return loaded


def _probe_dtype(d: defaults.Defaults, config: Any, say: Stages) -> defaults.Defaults:
    """defaults.probe_cpu_dtype over one decoder layer's matrices (where the CPU has native bfloat16)."""
    if not d.probe:
        return d
    say("measuring bfloat16 against float32")
    hidden, inter = config.hidden_size, getattr(config, "intermediate_size", 4 * config.hidden_size)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    d = defaults.probe_cpu_dtype(d, [(heads * head_dim + 2 * kv, hidden), (hidden, heads * head_dim),
                                     (2 * inter, hidden), (hidden, inter)])
    log.info("activations: %s", d.dtype_reason)
    return d


def _load_gguf(
    source: ModelSource, d: defaults.Defaults, device: torch.device, say: Stages, quantization: str = "none",
    weight_cache: bool = True,
) -> LoadedModel:
    if source.gguf is None:
        say("reading the file")
    gguf = source.gguf or GGUFModel(source.path)
    check_gguf_fits(gguf, quantization, d.torch_dtype.itemsize, str(device))  # before anything large is allocated
    config, tokenizer_of = gguf.config_then_tokenizer(say)  # a first load converts the tokenizer meanwhile
    if quantization == "none":  # dequantized to dense weights: bfloat16 may be worth it on this CPU
        d = _probe_dtype(d, config, say)
    dtype = d.torch_dtype
    net = build_model(config, dtype, torch.device("meta"))
    raw = plan_packing(net, config, gguf, quantization, device, dtype)
    net = to_empty(net, device).requires_grad_(False)
    # packed for our CPU kernels: the repacked tensors are worth keeping (cache.py)
    cacheable = weight_cache and bool(raw) and device.type == "cpu" and route(device) == "rosechat"
    cache = WeightCache.for_file(source.path, quantization, dtype) if cacheable else None
    if cache is not None and cache.file.is_file():
        say("loading cached weights")
    if cache is None or not cache.load_into(net):
        stage = "repacking weights" if raw else "loading weights"
        say(stage, 0, len(gguf.header.tensors))
        load_weights(net, gguf.iter_tensors(net, config, lambda done, total: say(stage, done, total), raw=raw),
                     where=source.path.name)
        if cache is not None:
            cache.save(net)  # in the background
    if (factors := gguf.rope_factors()) is not None:  # only Llama-family files carry them
        try:
            net.model.rotary.divide_frequencies(factors)
        except ValueError as e:
            raise WeightLoadError(f"{source.path.name}: rope_freqs.weight does not fit: {e}") from e
    net.eval()
    tokenizer = tokenizer_of()
    eos = [i for i in [*gguf.eos_token_ids(), tokenizer.eos_token_id] if i is not None]
    loaded = _loaded(net, config, tokenizer, source.display_name, False, list(dict.fromkeys(eos)))
    loaded.generation_defaults = gguf.sampling_defaults()
    loaded.generation_source = "GGUF metadata" if loaded.generation_defaults else ""
    loaded.dtype_reason = d.dtype_reason
    # Every weight is a copy (packed or dense) and the metadata is read: the file's pages that came
    # back (staged shards, rope_freqs, the header) go too, so the model is resident once.
    if "mapped" in gguf.__dict__:  # mapped (a cold load): a warm one never reads the file's tensors
        drop_mapped_pages(gguf.mapped)
    release_freed_memory()  # packing's and dequantizing's temporaries
    return loaded


def resolve_dtype(dtype: torch.dtype | str, device: torch.device | str = "cpu") -> torch.dtype:
    """torch dtype from a dtype or a name ("float32", "bf16", "auto": engine/defaults.py's choice)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    return defaults.resolve(str(torch.device(device)), dtype, "none").torch_dtype


def build_model(config: Any, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The model for `config.architectures[0]` with uninitialised parameters on `device`.

    Built on the meta device first, so no memory is spent on (or time on initialising) weights
    that the checkpoint overwrites. Inference only: parameters do not require grad."""
    cls = get_model_class(config)
    with torch.device("meta"), _SkipMetaInit():
        model = cls(config)
    return to_empty(model.to(dtype), device).requires_grad_(False)


def to_empty(model: nn.Module, device: torch.device) -> nn.Module:
    """Module.to_empty without its empty_like of meta tensors, which runs torch's Python reference and so
    imports sympy (about 1 s and 35 MB of a warm load)."""
    return model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


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


def max_model_len(config: Any) -> int:
    """Context length: max_position_embeddings. Sliding-window layers (Gemma, Mistral, Qwen with
    use_sliding_window) attend their window exactly in the paged kernels, so a window does not cap it."""
    return int(config.max_position_embeddings)


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
    notice = ""
    if getattr(tokenizer, "chat_template", None) is None:  # a base model: chat through a plain template
        tokenizer.chat_template = PLAIN_CHAT_TEMPLATE
        notice = f"{name} has no chat template: it chats through a plain one (System: / User: / Assistant: lines)"
    return LoadedModel(
        notice=notice,
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
    "Progress",
    "Stages",
    "build_model",
    "load_model",
    "max_model_len",
    "resolve_dtype",
]
