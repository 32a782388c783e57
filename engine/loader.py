"""Load a model: a local folder, a Hugging Face hub id (through the local cache) or the built-in demo.

Weights come from `*.safetensors` (sharded or not) and are copied tensor by tensor into a model
whose parameters were allocated uninitialised on the target device, so no second full copy exists.
`transformers` is used for AutoConfig / AutoTokenizer only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from engine import demo
from engine.models import get_model_class
from engine.models.layers import MergedLinear

# what a model folder needs from the hub (no .bin / .pth / onnx duplicates)
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]
_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


class ModelNotFoundError(FileNotFoundError):
    """The model is neither a local model folder, nor in the Hugging Face cache, nor downloadable."""


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


def load_model(
    model: str, dtype: torch.dtype | str = torch.float32, device: torch.device | str = "cpu"
) -> LoadedModel:
    """Load `model`: "demo" / "demo-135m", a local folder, or a hub id already in (or reachable
    for) the Hugging Face cache. Raises ModelNotFoundError when none of these applies."""
    model = str(model)  # a pathlib.Path works too
    device = torch.device(device)
    dtype = resolve_dtype(dtype, device)
    if model in demo.DEMO_MODELS:
        return _load_demo(model, dtype, device)

    from transformers import AutoConfig, AutoTokenizer

    path = resolve_model_path(model)
    config = AutoConfig.from_pretrained(path)
    net = build_model(config, dtype, device)
    load_weights(net, path)
    net.eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return _loaded(net, config, tokenizer, _display_name(model, path), False, _eos_ids(path, config, tokenizer))


def resolve_dtype(dtype: torch.dtype | str, device: torch.device) -> torch.dtype:
    """torch dtype from a dtype or a name ("float32", "bf16", "auto": bfloat16 on CUDA, float32 on CPU)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype.lower().removeprefix("torch.")
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    aliases = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16", "float": "float32"}
    result = getattr(torch, aliases.get(name, name), None)
    if not isinstance(result, torch.dtype) or not result.is_floating_point:
        raise ValueError(f"unsupported dtype {dtype!r} (use float32, bfloat16, float16 or auto)")
    return result


def resolve_model_path(model: str) -> Path:
    """A local model folder, else a hub id: the cached snapshot first, then a download."""
    path = Path(model).expanduser()
    if path.is_dir():
        return _check_model_dir(path)
    if not _HUB_ID.match(model) or model.startswith((".", "~")):
        raise ModelNotFoundError(f"model {model!r} not found: no such local folder ({path.resolve()})")

    from huggingface_hub import constants, snapshot_download

    try:
        return _check_model_dir(Path(snapshot_download(model, local_files_only=True, allow_patterns=_HUB_PATTERNS)))
    except Exception:  # not cached (or only partly): try the hub below
        pass
    missing = f"model {model!r} is neither a local folder nor in the Hugging Face cache ({constants.HF_HUB_CACHE})"
    if constants.HF_HUB_OFFLINE:
        raise ModelNotFoundError(f"{missing}, and offline mode (HF_HUB_OFFLINE=1) forbids downloading it")
    try:
        snapshot = snapshot_download(model, allow_patterns=_HUB_PATTERNS)
    except Exception as exc:
        raise ModelNotFoundError(f"{missing}, and downloading it failed: {type(exc).__name__}: {exc}") from exc
    return _check_model_dir(Path(snapshot))


def _check_model_dir(path: Path) -> Path:
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{path} is not a model folder: it has no config.json")
    return path


def build_model(config: Any, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The model for `config.architectures[0]` with uninitialised parameters on `device`.

    Built on the meta device first, so no memory is spent on (or time on initialising) weights
    that the checkpoint overwrites. Inference only: parameters do not require grad."""
    cls = get_model_class(config)
    with torch.device("meta"):
        model = cls(config)
    return model.to(dtype).to_empty(device=device).requires_grad_(False)


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{path} has no *.safetensors weights (.bin checkpoints are not supported)")
    return files


def iter_checkpoint(path: Path) -> Iterator[tuple[str, Tensor, str]]:
    """(name, tensor, file name) for every tensor of a (possibly sharded) safetensors checkpoint."""
    from safetensors import safe_open

    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name), file.name


def load_weights(model: nn.Module, path: Path) -> None:
    """Copy every checkpoint tensor into its parameter (rows of a merged projection, transposed
    for GPT-2's Conv1D) and check that every parameter was filled."""
    params = dict(model.named_parameters())
    loaded: dict[str, set[int | None]] = {}
    arch = type(model).__name__
    for name, tensor, file in iter_checkpoint(path):
        target = model.weight_target(name)
        if target is None:
            continue
        param_name, shard, transpose = target
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
    if missing:
        raise WeightLoadError(
            f"checkpoint {path} lacks {len(missing)} tensor(s) that {arch} needs: {', '.join(missing[:8])}"
            + (" ..." if len(missing) > 8 else "")
        )


def _merged_module(model: nn.Module, param_name: str) -> MergedLinear | None:
    module = model.get_submodule(param_name.rpartition(".")[0])
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


def _display_name(model: str, path: Path) -> str:
    return path.name if Path(model).expanduser().is_dir() else model


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
    "resolve_dtype",
    "resolve_model_path",
]
