"""Configuration: typed dataclasses loaded from layered TOML files and command-line overrides.

The defaults live in ``default_config.toml`` (package data, the same text as the repository's
``config.toml``), so the file that documents every option is also the only place defaults are set.
Layers, lowest first: defaults, the user file, ``--config FILE``, command-line flags. Every layer is
validated key by key, so a typo or a wrong type is reported with its file and line and the app
never starts half-configured.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import sys
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

import platformdirs
from textual.theme import BUILTIN_THEMES

APP_NAME = "rosechat"
DEFAULT_CONFIG_NAME = "default_config.toml"

DTYPES = ("auto", "float32", "float16", "bfloat16")
BACKENDS = ("auto", "triton", "torch")
QUANTIZATIONS = ("none", "auto", "int8", "int4")


class ConfigError(Exception):
    """A bad configuration value. ``key`` is dotted (``cache.block_size``); ``line`` is 1-based."""

    def __init__(self, message: str, *, key: str, source: str, line: int | None = None) -> None:
        self.key = key
        self.source = source
        self.line = line
        self.message = message
        where = f"{source}:{line}" if line else source
        super().__init__(f"{where}: {key}: {message}")


def _min(lo: float) -> dict[str, Any]:
    return {"min": lo}


def _speculative(value: str) -> None:
    from engine import SpeculativeConfig

    SpeculativeConfig.parse(value)  # ValueError naming what is wrong


@dataclass(frozen=True)
class ModelConfig:
    name: str
    dtype: str = dataclasses.field(metadata={"choices": DTYPES})
    quantization: str = dataclasses.field(metadata={"choices": QUANTIZATIONS})
    weight_cache: bool
    device: str
    attention_backend: str = dataclasses.field(metadata={"choices": BACKENDS})
    cuda_graphs: bool
    threads: int = dataclasses.field(metadata=_min(0))
    speculative_config: str = dataclasses.field(metadata={"check": _speculative})


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = dataclasses.field(metadata={"min": 1, "power_of_two": True})
    kv_cache_mib: int = dataclasses.field(metadata=_min(0))
    num_blocks: int = dataclasses.field(metadata=_min(0))
    max_num_seqs: int = dataclasses.field(metadata=_min(1))
    max_num_batched_tokens: int = dataclasses.field(metadata=_min(1))
    enable_prefix_caching: bool


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = dataclasses.field(metadata=_min(0))
    top_p: float = dataclasses.field(metadata={"min": 0, "min_exclusive": True, "max": 1})
    top_k: int = dataclasses.field(metadata=_min(0))
    min_p: float = dataclasses.field(metadata={"min": 0, "max": 0.99})
    max_tokens: int = dataclasses.field(metadata=_min(1))
    repetition_penalty: float = dataclasses.field(metadata={"min": 0, "min_exclusive": True})
    repetition_window: int = dataclasses.field(metadata=_min(0))
    seed: int = dataclasses.field(metadata=_min(-1))


@dataclass(frozen=True)
class ChatConfig:
    system_prompt: str
    alternatives: int = dataclasses.field(metadata={"min": 1, "max": 9})
    alternatives_temperature: float = dataclasses.field(metadata=_min(0))


@dataclass(frozen=True)
class HistoryConfig:
    path: str
    export_dir: str


@dataclass(frozen=True)
class UIConfig:
    theme: str = dataclasses.field(metadata={"choices": tuple(BUILTIN_THEMES)})
    show_kv_panel: bool


@dataclass(frozen=True)
class RemoteConfig:
    url: str
    api_key: str
    model: str
    connect_timeout: float = dataclasses.field(metadata={"min": 0, "min_exclusive": True})
    timeout: float = dataclasses.field(metadata={"min": 0, "min_exclusive": True})


@dataclass(frozen=True)
class Config:
    model: ModelConfig
    cache: CacheConfig
    sampling: SamplingConfig
    chat: ChatConfig
    history: HistoryConfig
    ui: UIConfig
    remote: RemoteConfig
    sources: tuple[str, ...] = ()  # files that were read, lowest precedence first
    origins: Mapping[str, str] = dataclasses.field(default_factory=dict)  # dotted key -> source that set it

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``LLMEngine.from_pretrained`` (besides the model name)."""
        c = self.cache
        return {
            "dtype": self.model.dtype,
            "quantization": self.model.quantization,
            "weight_cache": self.model.weight_cache,
            "device": self.model.device,
            "attention_backend": self.model.attention_backend,
            "cuda_graphs": self.model.cuda_graphs,
            "num_threads": self.model.threads,
            "speculative_config": self.model.speculative_config or None,
            "block_size": c.block_size,
            "kv_cache_bytes": c.kv_cache_mib * 2**20 if c.kv_cache_mib else None,
            "num_blocks": c.num_blocks or None,
            "max_num_seqs": c.max_num_seqs,
            "max_num_batched_tokens": c.max_num_batched_tokens,
            "enable_prefix_caching": c.enable_prefix_caching,
        }

    def is_default(self, dotted: str) -> bool:
        """Whether ``dotted`` still has the shipped default (no user file, --config or flag set it)."""
        return not self.sources or self.origins.get(dotted) in (None, self.sources[0])

    def sampling_settings(self, model_defaults: Mapping[str, Any] | None = None,
                          model_source: str = "the model") -> dict[str, tuple[Any, str]]:
        """Effective sampling values and where each comes from. The model's own settings
        (generation_config.json, GGUF metadata) replace the shipped defaults, as vLLM does; a user
        file, ``--config`` or a flag replaces the model's."""
        model_defaults = model_defaults or {}
        out: dict[str, tuple[Any, str]] = {}
        for f in dataclasses.fields(SamplingConfig):
            dotted = f"sampling.{f.name}"
            if f.name in model_defaults and self.is_default(dotted):
                out[f.name] = (model_defaults[f.name], model_source)
            else:
                source = self.origins.get(dotted, "defaults")
                out[f.name] = (getattr(self.sampling, f.name), "defaults" if self.is_default(dotted) else source)
        return out

    def sampling_kwargs(self, n: int = 1, model_defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Keyword arguments for the engine's ``SamplingParams`` (see sampling_settings)."""
        values = {k: v for k, (v, _) in self.sampling_settings(model_defaults).items()}
        values["seed"] = None if values["seed"] < 0 else values["seed"]
        values["repetition_window"] = values["repetition_window"] or None
        if n > 1:  # alternatives are samples: greedy ones would all be the same reply
            values["temperature"] = max(values["temperature"], self.chat.alternatives_temperature)
        return {**values, "n": n}

    def remote_api_key(self) -> str | None:
        """remote.api_key, else $ROSECHAT_API_KEY (the variable `rosechat serve` reads too)."""
        return self.remote.api_key or os.environ.get("ROSECHAT_API_KEY") or None

    def sampling_sent_to_remote(self) -> set[str]:
        """The sampling fields a remote server gets: those set in a user file, --config or a flag.
        The rest stay the server's own (its model's generation config), as a user of it expects."""
        return {f.name for f in dataclasses.fields(SamplingConfig) if not self.is_default(f"sampling.{f.name}")}

    def export_path(self) -> Path:
        """Where conversations are exported to Markdown: never the current directory (under
        `make run` that is the git checkout)."""
        if self.history.export_dir:
            return Path(self.history.export_dir).expanduser()
        return Path(platformdirs.user_documents_dir()) / APP_NAME

    def history_path(self) -> Path:
        if self.history.path:
            return Path(self.history.path).expanduser()
        return Path(platformdirs.user_data_dir(APP_NAME)) / "history.sqlite3"


SECTIONS: dict[str, type] = {
    f.name: typing.get_type_hints(Config)[f.name]
    for f in dataclasses.fields(Config)
    if f.name not in ("sources", "origins")
}


def user_config_path() -> Path:
    return Path(platformdirs.user_config_dir(APP_NAME)) / "config.toml"


def default_config_text() -> str:
    return resources.files("rosechat").joinpath(DEFAULT_CONFIG_NAME).read_text(encoding="utf-8")


_TABLE_RE = re.compile(r"^\s*\[\s*([A-Za-z0-9_.\-\"' ]+?)\s*\]\s*(#.*)?$")


def find_line(text: str, table: str, key: str) -> int | None:
    """1-based line of ``key = ...`` inside ``[table]`` ("" = the root table), or of ``[key]`` itself."""
    current = ""
    key_re = re.compile(rf"^\s*(?:{re.escape(key)}|\"{re.escape(key)}\"|'{re.escape(key)}')\s*=")
    for number, line in enumerate(text.splitlines(), start=1):
        m = _TABLE_RE.match(line)
        if m:
            current = m.group(1).replace('"', "").replace("'", "").replace(" ", "")
            if current == (f"{table}.{key}" if table else key):
                return number
            continue
        if current == table and key_re.match(line):
            return number
    return None


class _Layer:
    """One source of settings: a parsed TOML file (with its text, for line numbers) or the command line."""

    def __init__(self, source: str, data: Mapping[str, Any], text: str | None = None) -> None:
        self.source = source
        self.data = data
        self.text = text

    def error(self, table: str, key: str, message: str) -> ConfigError:
        line = find_line(self.text, table, key) if self.text is not None else None
        dotted = f"{table}.{key}" if table else key
        return ConfigError(message, key=dotted, source=self.source, line=line)


def _parse_file(path: Path) -> _Layer:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read config file: {e.strerror or e}", key="(file)", source=str(path)) from e
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        line = getattr(e, "lineno", None)
        if line is None:  # Python < 3.14 puts "(at line N, column M)" in the message only
            m = re.search(r"line (\d+)", str(e))
            line = int(m.group(1)) if m else None
        raise ConfigError(f"invalid TOML: {e}", key="(syntax)", source=str(path), line=line) from e
    return _Layer(str(path), data, text)


def _typename(t: type) -> str:
    return {str: "a string", int: "an integer", float: "a number", bool: "true or false"}.get(t, t.__name__)


def _check_value(layer: _Layer, table: str, field: dataclasses.Field, expected: type, value: Any) -> Any:
    # bool is a subclass of int in Python but not in TOML: `block_size = true` is a mistake.
    if expected is bool:
        ok = isinstance(value, bool)
    elif expected is float:  # an integer is a fine number: `temperature = 1`
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, expected) and not isinstance(value, bool)
    if not ok:
        got = "true/false" if isinstance(value, bool) else type(value).__name__
        raise layer.error(table, field.name, f"expected {_typename(expected)}, got {got} ({value!r})")
    if expected is float:
        value = float(value)
    meta = field.metadata
    if "choices" in meta and value not in meta["choices"]:
        choices = ", ".join(repr(c) for c in meta["choices"])
        raise layer.error(table, field.name, f"must be one of {choices}, got {value!r}")
    if "min" in meta:
        lo = meta["min"]
        if value < lo or (meta.get("min_exclusive") and value == lo):
            rel = ">" if meta.get("min_exclusive") else ">="
            raise layer.error(table, field.name, f"must be {rel} {lo}, got {value!r}")
    if meta.get("power_of_two") and value & (value - 1):
        raise layer.error(table, field.name, f"must be a power of two, got {value!r}")
    if "max" in meta and value > meta["max"]:
        raise layer.error(table, field.name, f"must be <= {meta['max']}, got {value!r}")
    if "check" in meta:
        try:
            meta["check"](value)
        except ValueError as e:
            raise layer.error(table, field.name, str(e)) from None
    return value


def _suggest(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _apply(merged: dict[str, dict[str, Any]], layer: _Layer, origins: dict[str, str]) -> None:
    """Validate one layer and merge its values over ``merged``."""
    for table, values in layer.data.items():
        if table not in SECTIONS:
            raise layer.error("", table, f"unknown section{_suggest(table, list(SECTIONS))}")
        if not isinstance(values, Mapping):
            raise layer.error("", table, f"expected a table [{table}], got {type(values).__name__}")
        cls = SECTIONS[table]
        fields = {f.name: f for f in dataclasses.fields(cls)}
        hints = typing.get_type_hints(cls)
        for key, value in values.items():
            if key not in fields:
                raise layer.error(table, key, f"unknown key{_suggest(key, list(fields))}")
            merged.setdefault(table, {})[key] = _check_value(layer, table, fields[key], hints[key], value)
            origins[f"{table}.{key}"] = layer.source


def _build(merged: dict[str, dict[str, Any]], sources: tuple[str, ...], origins: dict[str, str]) -> Config:
    sections = {}
    for table, cls in SECTIONS.items():
        values = merged.get(table, {})
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in values]
        if missing:  # only possible if the shipped defaults file is incomplete
            raise ConfigError("missing from the defaults file", key=f"{table}.{missing[0]}", source=sources[0])
        sections[table] = cls(**values)
    return Config(**sections, sources=sources, origins=origins)


_USER_DEFAULT = object()


def load_config(
    config_file: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    user_file: str | Path | None | object = _USER_DEFAULT,
) -> Config:
    """Load the layered configuration.

    ``overrides`` maps dotted keys (``"model.name"``) to values (command-line flags); ``None`` values
    are skipped so an argparse namespace can be passed through unchanged. ``user_file=None`` skips the
    user's file (tests); by default it is ``user_config_path()`` when that exists.
    """
    text = default_config_text()
    defaults = _Layer(str(resources.files("rosechat").joinpath(DEFAULT_CONFIG_NAME)), tomllib.loads(text), text)
    layers = [defaults]
    if user_file is _USER_DEFAULT:
        user_file = user_config_path()
    if user_file is not None and Path(user_file).is_file():  # type: ignore[arg-type]
        layers.append(_parse_file(Path(user_file)))  # type: ignore[arg-type]
    if config_file is not None:
        layers.append(_parse_file(Path(config_file)))
    if overrides:
        nested: dict[str, dict[str, Any]] = {}
        for dotted, value in overrides.items():
            if value is None:
                continue
            table, _, key = dotted.partition(".")
            nested.setdefault(table, {})[key] = value
        layers.append(_Layer("command line", nested))

    merged: dict[str, dict[str, Any]] = {}
    origins: dict[str, str] = {}
    for layer in layers:
        _apply(merged, layer, origins)
    return _build(merged, tuple(layer.source for layer in layers), origins)


def default_config() -> Config:
    return load_config(user_file=None)
