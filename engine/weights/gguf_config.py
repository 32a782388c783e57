"""What a GGUF file says besides its tensors, as transformers reads it: the config (with the keys its GGUF
mapping leaves out or misplaces, read from the file) and the tokenizer, converted once per file (gguf_meta.py
computes what transformers' GGUF reading would, without its slow passes over the file) and kept in a
cache folder. `model` is a gguf.GGUFModel (its path, arch and field())."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.weights.heap import release_freed_memory

_CACHE_VERSION = 4  # bump when what the cache holds changes (3: rosechat_config.json; 4: added_tokens_decoder)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # Gemma's architectures, and their 27B models' depth


def cache_root() -> Path | None:
    """Where converted configs and tokenizers are kept: $ROSECHAT_CACHE_DIR, else the user cache
    directory; None when caching is off (ROSECHAT_CACHE_DIR set to an empty string)."""
    root = os.environ.get("ROSECHAT_CACHE_DIR")
    if root is None:
        import platformdirs

        root = platformdirs.user_cache_dir("rosechat")
    return Path(root) / "gguf" if root else None


def load_config(model: Any, architecture: str) -> Any:
    """transformers' config for the file, plus the keys its GGUF mapping leaves out or misplaces."""
    from engine.weights import gguf_meta

    try:  # what AutoConfig makes of the file, from the quick header read
        config = gguf_meta.config(model)
    except gguf_meta.Unsupported:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model.path.parent, gguf_file=model.path.name)
    config.architectures = [architecture]
    # Keys transformers' mapping leaves out or misplaces: Qwen3's head_dim is not hidden/heads
    # (0.6B: 128 vs 64); GPT-2's context and MLP width.
    if (key_length := model.field(f"{model.arch}.attention.key_length")) is not None and model.arch != "gpt2":
        config.head_dim = int(key_length)
    if model.arch == "gpt2":  # transformers maps these to names GPT2Config does not read
        if (ffn := model.field("gpt2.feed_forward_length")) is not None:
            config.n_inner = int(ffn)
        if (ctx := model.field("gpt2.context_length")) is not None:
            config.n_positions = int(ctx)
    if model.arch in _GEMMA_27B_LAYERS:
        _gemma_config(model, config)
    if model.arch == "phi3":
        _phi3_config(model, config)
    return config


def _phi3_config(model: Any, config: Any) -> None:
    """What llama.cpp's Phi-3 converter stores and transformers' GGUF mapping drops: the sliding window
    (Phi-3-mini-4k's 2047, which the original model and llama.cpp attend within), and a rotary dimension
    short of head_dim (Phi-4-mini's partial RoPE), kept so that the model refuses it rather than rotating
    the whole head."""
    if (window := model.field("phi3.attention.sliding_window")) is not None and int(window) > 0:
        config.sliding_window = int(window)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if (dims := model.field("phi3.rope.dimension_count")) is not None and int(dims) != head_dim:
        config.rope_parameters = {**(getattr(config, "rope_parameters", None) or {}),
                                  "partial_rotary_factor": int(dims) / head_dim}


def _gemma_config(model: Any, config: Any) -> None:
    """What llama.cpp stores, or assumes, for Gemma and transformers' GGUF mapping does not read:
    soft-capping, the sliding-window pattern, the query scale, Gemma 3's local RoPE base and scaling."""
    arch = model.arch
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if (value := model.field(f"{arch}.{key}")) is not None:
            setattr(config, key, float(value))
    pattern = model.field(f"{arch}.attention.sliding_window_pattern")
    if pattern is not None:  # an int n (every n-th layer global) or one flag per layer (True: sliding)
        n = config.num_hidden_layers
        flags = ([bool(f) for f in pattern] if isinstance(pattern, list)
                 else [int(pattern) == 0 or (i + 1) % int(pattern) != 0 for i in range(n)])
        config.layer_types = ["sliding_attention" if f else "full_attention" for f in flags]
    # llama.cpp: 1 / sqrt(head_dim), except the 27B models' 1 / sqrt(hidden / heads)
    big = config.num_hidden_layers == _GEMMA_27B_LAYERS[arch]
    config.query_pre_attn_scalar = (config.hidden_size // config.num_attention_heads if big
                                    else config.head_dim)
    if arch == "gemma3":
        rope = dict(getattr(config, "rope_parameters", None) or {})
        full = dict(rope.get("full_attention") or {"rope_type": "default"})
        if (theta := model.field("gemma3.rope.freq_base")) is not None:
            full["rope_theta"] = float(theta)
        if model.field("gemma3.rope.scaling.type") == "linear":  # global layers only, as llama.cpp
            full.update(rope_type="linear", factor=float(model.field("gemma3.rope.scaling.factor")))
        local = dict(rope.get("sliding_attention") or {"rope_type": "default"})
        local["rope_theta"] = float(model.field("gemma3.rope.freq_base_swa", 10000.0))
        config.rope_parameters = {"full_attention": full, "sliding_attention": local}


def load_tokenizer(model: Any, config: Any) -> Any:
    """transformers' tokenizer for the file (`config`: load_config's)."""
    from engine.weights import gguf_meta

    try:  # what AutoTokenizer makes of the file, without the config pass it makes to choose the class
        return gguf_meta.tokenizer(model, config)
    except gguf_meta.Unsupported:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model.path.parent, gguf_file=model.path.name)


def config_and_tokenizer(model: Any, architecture: str, say: Callable[[str], None] = lambda _: None
                         ) -> tuple[Any, Any]:  # fmt: skip
    """(config, tokenizer), converted once per file (gguf_meta.py, else transformers' GGUF reading) and then
    read back from a cache folder."""
    config, tokenizer = config_then_tokenizer(model, architecture, say)
    return config, tokenizer()


def config_then_tokenizer(model: Any, architecture: str, say: Callable[[str], None] = lambda _: None
                          ) -> tuple[Any, Callable[[], Any]]:  # fmt: skip
    """(config, a function returning the tokenizer), as config_and_tokenizer. A first load converts the
    tokenizer and fills the cache folder in a thread while the caller goes on (a cold load repacks its
    weights meanwhile, in C++ that releases the GIL: a 1.7B load hid its ~1.5 s of tokenizer there)."""
    from transformers import PreTrainedTokenizerFast

    folder = _cache_folder(model.path)
    if folder is not None and (folder / _FULL_CONFIG).is_file():
        say("reading the tokenizer")
        try:
            # tokenizer.json as saved, through the generic fast class: a model's own tokenizer class may
            # rebuild it from pieces a GGUF conversion does not save (Gemma's fails on its unk token)
            config, tokenizer = _read_config(folder / _FULL_CONFIG), PreTrainedTokenizerFast.from_pretrained(folder)
            return config, lambda: tokenizer
        except Exception:  # a damaged cache: convert again
            shutil.rmtree(folder, ignore_errors=True)
    say("converting the tokenizer")
    config = load_config(model, architecture)
    tmp = None
    if folder is not None:
        try:  # here, not in the thread: the caller may set attributes on the config as it builds the model
            # a name of its own per conversion: a load that failed after starting one (say on a refused
            # quantization) leaves its thread to finish while the next load of the file starts another
            folder.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f"{folder.name}.", suffix=".tmp", dir=folder.parent))
            config.save_pretrained(tmp)
            full = {**config.to_dict(), _ALIASES: dict(type(config).attribute_map)}
            (tmp / _FULL_CONFIG).write_text(json.dumps(full, indent=1, default=str))
        except OSError:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            tmp = None
    return config, _in_thread(lambda: _convert_tokenizer(model, config, folder, tmp))


def _convert_tokenizer(model: Any, config: Any, folder: Path | None, tmp: Path | None) -> Any:
    try:
        tokenizer = load_tokenizer(model, config)
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if folder is not None and tmp is not None:
        try:
            tokenizer.save_pretrained(tmp)
            _list_added_tokens(tmp)
            os.replace(tmp, folder)  # whole or not at all, also with two rosechats starting
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    release_freed_memory()  # the conversion's temporaries, freed in this thread's own malloc arena
    return tokenizer


def _in_thread(work: Callable[[], Any]) -> Callable[[], Any]:
    """Run `work` in a thread now; the function returned waits for its result (or raises its exception)."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = work()
        except BaseException as e:  # handed to the caller, raised where it waits
            result["error"] = e

    thread = threading.Thread(target=run, name="rosechat-tokenizer", daemon=True)
    thread.start()

    def wait() -> Any:
        thread.join()
        if "error" in result:
            raise result["error"]
        return result["value"]

    return wait


def _list_added_tokens(folder: Path) -> None:
    """Copy tokenizer.json's added tokens into tokenizer_config.json as added_tokens_decoder, as transformers 4
    saved them: without it, reading the tokenizer back parses all of tokenizer.json in Python for them (0.13 s
    of a warm load for SmolLM2's). The same AddedToken fields either way (tokenization_utils_base)."""
    config_file = folder / "tokenizer_config.json"
    try:  # a tokenizer saved otherwise (no tokenizer.json) is read back the slower way
        config = json.loads(config_file.read_text(encoding="utf-8"))
        added = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"]
        listed = {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added}
    except (OSError, ValueError, KeyError, TypeError):
        return
    if "added_tokens_decoder" not in config:
        config["added_tokens_decoder"] = listed
        config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# Every key of the config, its class's defaults included: read back as a plain PretrainedConfig, it spares a
# warm load importing the model's config class (LlamaConfig pulls in torch.distributed and accelerate: ~1 s)
_FULL_CONFIG = "rosechat_config.json"
_ALIASES = "rosechat_attribute_map"  # the class's aliases (GPT-2's hidden_size is n_embd)


def _read_config(path: Path) -> Any:
    from transformers.configuration_utils import PretrainedConfig

    full = json.loads(path.read_text())
    aliases = full.pop(_ALIASES)
    config = PretrainedConfig.from_dict(full)
    config.model_type = full["model_type"]  # class attributes of the model's config class
    for alias, name in aliases.items():
        setattr(config, alias, getattr(config, name))
    return config


def _cache_folder(path: Path) -> Path | None:
    import transformers

    root = cache_root()
    if root is None:
        return None
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}|{_CACHE_VERSION}"
    return root / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


__all__ = ["cache_root", "config_and_tokenizer", "config_then_tokenizer", "load_config", "load_tokenizer"]
