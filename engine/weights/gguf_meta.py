"""What transformers makes of a GGUF file's metadata, computed from the quick header read (gguf_header.py)
instead of transformers' GGUF reading, which walks the whole file with gguf.GGUFReader and parses every
item of the vocabulary and merges one Python call at a time (load_gguf_checkpoint: ~6 s for a 49k-token
vocabulary on a 2-core machine, and AutoConfig and AutoTokenizer each run it once: most of a cold load).

- config: transformers' config for the file, as AutoConfig.from_pretrained(folder, gguf_file=...) makes it
  (load_gguf_checkpoint's config section, with transformers' own key tables, then the config class).
- tokenizer: as AutoTokenizer.from_pretrained(folder, gguf_file=...) makes it, without the config pass
  it makes only to choose the tokenizer class; the class then converts the file's vocabulary itself.
- tokenizer_inputs: what transformers' get_gguf_tokenizer reads, the vocabulary and merges read in one
  pass over their bytes (gguf_header.read_array).

Only the architectures rosechat loads, a file whose folder holds no tokenizer_config.json, and a class
choice this mirrors; anything else raises Unsupported and gguf_config.py goes transformers' own way.
tests/engine/test_gguf_meta.py holds each of these to the original on every architecture's file.
"""

from __future__ import annotations

import fnmatch
from typing import Any

# the GGUF architectures (general.architecture) this mirrors transformers for
ARCHS = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "gpt2", "gemma2", "gemma3"})
_TIED_ANYWAY = ("falcon", "bloom")  # load_gguf_checkpoint's exceptions: tied whatever the file holds


class Unsupported(Exception):
    """A file or an installation this module does not mirror transformers for (go transformers' way)."""


def _parsed(model: Any, key: str) -> Any:
    """A field as load_gguf_checkpoint parses it: an array's items in a list, a one-item array as its item."""
    value = model.field(key)
    if key in model.header.arrays and len(value) == 1:
        return value[0]
    return value


def config_dict(model: Any) -> dict[str, Any]:
    """load_gguf_checkpoint(path, return_tensors=False)["config"] for `model` (a gguf.GGUFModel)."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    arch = model.field("general.architecture")
    if arch not in ARCHS or arch not in GGUF_CONFIG_MAPPING:
        raise Unsupported(f"architecture {arch!r}")
    name = model.field("general.name")
    # transformers tests `"mistral" in read_field(reader, "general.name")`: a list, so the whole name
    updated = "mistral" if "llama" in arch and name == "mistral" else arch
    config: dict[str, Any] = {
        "tie_word_embeddings": all(t.name != "output.weight" for t in model.header.tensors) or arch in _TIED_ANYWAY}
    defaults = GGUF_CONFIG_DEFAULTS_MAPPING.get(updated, GGUF_CONFIG_DEFAULTS_MAPPING.get(arch) or {})
    for key, value in defaults.items():
        config.setdefault(key, value)
    for key in model.header.keys:
        prefix, _, config_key = key.replace(arch, updated).partition(".")
        renamed = GGUF_CONFIG_MAPPING.get(prefix, {}).get(config_key, -1)
        if renamed == -1 or renamed is None:
            continue
        value = _parsed(model, key)
        if isinstance(value, str) and arch in value:
            value = value.replace(arch, updated)
        config[renamed] = value
    if config["model_type"] == "gemma3":  # the file holds only the text model
        config["model_type"] = "gemma3_text"
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in model.header.arrays:
        config["vocab_size"] = len(_parsed(model, "tokenizer.ggml.tokens"))
    return config


def config(model: Any) -> Any:
    """AutoConfig.from_pretrained(model.path.parent, gguf_file=model.path.name), from config_dict."""
    from transformers import CONFIG_MAPPING

    found = config_dict(model)
    if found["model_type"] == "mistral" and "layer_types" in found:  # AutoConfig's ministral rule
        found["model_type"] = "ministral"
    # the keyword arguments AutoConfig.from_pretrained hands from_dict (the rest it uses itself)
    return CONFIG_MAPPING[found["model_type"]].from_dict(found, gguf_file=model.path.name,
                                                         name_or_path=model.path.parent)


def tokenizer_class(model: Any, config: Any) -> type:
    """The class AutoTokenizer.from_pretrained picks for a GGUF file whose config is `config` (config(model)'s):
    its rules for a folder without tokenizer_config.json and a config naming no tokenizer class (the config it
    makes has no name_or_path: "" is what it matches against its list of named models)."""
    from transformers.models.auto import tokenization_auto as auto

    if (model.path.parent / "tokenizer_config.json").exists():
        raise Unsupported("the folder has a tokenizer_config.json")
    if getattr(config, "tokenizer_class", None) is not None:
        raise Unsupported("the config names a tokenizer class")
    if any(fnmatch.fnmatch("", p) for p in getattr(auto, "MODEL_IDS_TO_TOKENIZERS_BACKEND", ())):
        raise Unsupported("transformers' rules for named models")
    if (auto.config_class_to_model_type(type(config).__name__) or getattr(config, "model_type", None)) is None:
        raise Unsupported("a config of no model type")
    cls = auto.TOKENIZER_MAPPING.get(type(config), auto.TokenizersBackend)
    if cls is None or cls.__name__ == "MistralCommonBackend":
        raise Unsupported(f"tokenizer class {getattr(cls, '__name__', cls)}")
    return cls


def tokenizer(model: Any, config: Any) -> Any:
    """AutoTokenizer.from_pretrained(model.path.parent, gguf_file=model.path.name) for a file whose config is
    `config` (config(model)'s): the class it picks, given what AutoTokenizer gives it."""
    folder = model.path.parent
    cls = tokenizer_class(model, config)
    # AutoTokenizer's own call; its revision (transformers.utils.hub.resolve_revision, not in every
    # transformers this runs with) is the one asked for, None, for a local folder
    return cls.from_pretrained(folder, gguf_file=model.path.name, _from_auto=True)


__all__ = ["ARCHS", "Unsupported", "config", "config_dict", "tokenizer", "tokenizer_class"]
