"""Command line entry point: ``rosechat [options]`` starts the app; ``rosechat bench|info ...``."""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys
from typing import Any

from rosechat import config as rosechat_config
from rosechat.config import BACKENDS, DTYPES, QUANTIZATIONS, ConfigError, load_config


def backend_summary() -> str:
    import torch

    from kernels import triton_status

    device = f"CUDA ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else "CPU"
    return f"torch {torch.__version__} | device {device} | triton {triton_status()}"


CLEAR_LINE = "\x1b[2K"  # erase the terminal line (the "opening…" status)

# flag dest -> dotted config key. Flags left out (None) do not override anything.
FLAG_KEYS = {
    "model": "model.name",
    "dtype": "model.dtype",
    "quantization": "model.quantization",
    "device": "model.device",
    "backend": "model.attention_backend",
    "threads": "model.threads",
    "block_size": "cache.block_size",
    "kv_cache_mib": "cache.kv_cache_mib",
    "num_blocks": "cache.num_blocks",
    "max_num_seqs": "cache.max_num_seqs",
    "max_batched_tokens": "cache.max_num_batched_tokens",
    "prefix_caching": "cache.enable_prefix_caching",
    "temperature": "sampling.temperature",
    "top_p": "sampling.top_p",
    "top_k": "sampling.top_k",
    "min_p": "sampling.min_p",
    "max_tokens": "sampling.max_tokens",
    "repetition_penalty": "sampling.repetition_penalty",
    "repetition_window": "sampling.repetition_window",
    "seed": "sampling.seed",
    "system_prompt": "chat.system_prompt",
    "alternatives": "chat.alternatives",
    "history": "history.path",
    "theme": "ui.theme",
    "kv_panel": "ui.show_kv_panel",
    "remote": "remote.url",
    "api_key": "remote.api_key",
}


def _options(parser: argparse.ArgumentParser) -> None:
    """The options of the app and of `rosechat info`: each overrides one config.toml key."""
    parser.add_argument("--config", metavar="FILE", help="a TOML file overriding the user config")
    m = parser.add_argument_group("model")
    m.add_argument("--model", metavar="PATH_OR_ID",
                   help='a .gguf file, a folder (one .gguf, or a Hugging Face model), a hub id, '
                   '"smollm2-135m-instruct" (the default) or "demo" (random weights)')
    m.add_argument("--dtype", choices=DTYPES, help="weights and KV cache "
                   "(auto: bfloat16 on CUDA and bf16-capable CPUs, else float32)")
    m.add_argument("--quantization", choices=QUANTIZATIONS,
                   help="packed weights: auto (the default: GGUF tensors packed as the file has them), "
                   "none (dequantized: exact), int8, int4")
    m.add_argument("--device", help='"auto", "cpu", "cuda", "cuda:N"')
    m.add_argument("--backend", choices=BACKENDS, help="paged-attention implementation (auto: triton on CUDA)")
    m.add_argument("--threads", type=int, metavar="N", help="CPU threads for the model (0 = one per core)")
    c = parser.add_argument_group("KV cache and scheduling")
    c.add_argument("--block-size", type=int, metavar="N", help="tokens per KV block (a power of two)")
    c.add_argument("--kv-cache-mib", type=int, metavar="MIB", help="KV cache budget (0 = automatic)")
    c.add_argument("--num-blocks", type=int, metavar="N", help="fixed KV pool size (0 = from the budget)")
    c.add_argument("--max-num-seqs", type=int, metavar="N", help="sequences per engine step")
    c.add_argument("--max-batched-tokens", type=int, metavar="N",
                   help="tokens per engine step (longer prompts are prefilled in chunks)")
    c.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV blocks of prefixes seen before")
    s = parser.add_argument_group("sampling (the model's own settings apply where these are not given)")
    s.add_argument("--temperature", type=float, help="0 = greedy")
    s.add_argument("--top-p", type=float, help="nucleus sampling mass, (0, 1]")
    s.add_argument("--top-k", type=int, help="0 = off")
    s.add_argument("--min-p", type=float, help="drop tokens below min_p x the top probability; 0 = off")
    s.add_argument("--max-tokens", type=int, help="longest reply (lowered to what the context leaves)")
    s.add_argument("--repetition-penalty", type=float, help="> 1 discourages repeats; 1 = off")
    s.add_argument("--repetition-window", type=int, metavar="N",
                   help="the penalty looks at the reply's last N tokens; 0 = the whole chat")
    s.add_argument("--seed", type=int, help="-1 = random")
    a = parser.add_argument_group("chat and app")
    a.add_argument("--system-prompt", metavar="TEXT", help="system prompt of new conversations")
    a.add_argument("--alternatives", type=int, metavar="N", help="replies sampled by ctrl+r")
    a.add_argument("--history", metavar="PATH", help="SQLite file for saved conversations")
    a.add_argument("--theme", help="a Textual theme, e.g. textual-dark, nord, gruvbox")
    a.add_argument("--kv-panel", action=argparse.BooleanOptionalAction, default=None, help="show the KV panel")


def build_parser() -> argparse.ArgumentParser:
    from rosechat import __version__

    p = argparse.ArgumentParser(
        prog="rosechat",
        description="Terminal chat for local language models on a paged KV-cache engine. "
        "Options override config.toml; see `rosechat --print-config-path`.",
    )
    p.add_argument("--version", action="version", version=f"rosechat {__version__}")
    p.add_argument("--print-config-path", action="store_true", help="print where the user config file goes")
    _options(p)
    r = p.add_argument_group("remote server (instead of the in-process engine)")
    r.add_argument("--remote", metavar="URL", help="an OpenAI-compatible server: vLLM, SGLang, llama.cpp, Ollama, "
                   "rosechat serve (e.g. http://localhost:8000/v1); --model then names the served model")
    r.add_argument("--api-key", metavar="KEY", help="the remote server's API key (or set $ROSECHAT_API_KEY)")
    commands = p.add_subparsers(dest="command", title="commands (without one, the app starts)", metavar="")
    info = commands.add_parser("info", help="the backend, the model and each effective sampling setting with "
                               "where it comes from", description="Show the backend, the model and each "
                               "effective sampling setting with where it comes from; takes the app's options.")
    _options(info)
    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server over the engine",
                                description="Serve the model over an OpenAI-compatible HTTP API (chat and text "
                                "completions, /v1/models, /health, /metrics); takes the app's model, cache and "
                                "sampling options (sampling ones are defaults for fields a request leaves out).")
    _options(serve)
    from rosechat.server.cli import add_serve_options

    add_serve_options(serve)
    commands.add_parser("bench", add_help=False, help="benchmarks and checks (`rosechat bench --help`)")
    return p


def overrides_from(args: argparse.Namespace) -> dict[str, Any]:
    return {key: getattr(args, dest) for dest, key in FLAG_KEYS.items() if getattr(args, dest) is not None}


def _bench(argv: list[str]) -> int:
    try:
        from rosechat import bench
    except ModuleNotFoundError as e:
        if e.name != "rosechat.bench":
            raise
        print("rosechat bench: the benchmark module (rosechat/bench.py) is not available", file=sys.stderr)
        return 2
    return int(bench.main(argv) or 0)


def _info(config: rosechat_config.Config) -> int:
    """Versions, the backend, the model and each effective sampling value with its source."""
    from rosechat import __version__
    from rosechat.model_choice import ModelChoiceError, choose_model

    print(f"rosechat {__version__}")
    print(backend_summary())
    try:
        model, notice = choose_model(config)
    except ModelChoiceError as e:
        print(f"model: {e}")
        return 2
    from engine import generation_defaults

    where = f" ({model.path})" if model.path else ""
    print(f"model: {model.display_name} [{model.kind}]{where}")
    if notice:
        print(f"  {notice.splitlines()[0]}")
    source = "GGUF metadata" if model.kind == "gguf" else "generation_config.json"
    settings = config.sampling_settings(generation_defaults(model), source)
    print("sampling (effective value: where it comes from):")
    for key, (value, origin) in settings.items():
        print(f"  {key:<20} {value!s:<8} {_origin_label(config, origin)}")
    return 0


def _origin_label(config: rosechat_config.Config, origin: str) -> str:
    if origin == "defaults":
        return "rosechat default (config.toml; the model sets none)"
    if origin == "command line":
        return "command-line flag"
    if origin.endswith(("GGUF metadata", "generation_config.json")):
        return f"the model's {origin}"
    return f"config file {origin}"


def main(argv: list[str] | None = None) -> int:
    # libgomp reads this when torch loads it: its idle threads then spin ~10k pauses (not ~300k, some
    # milliseconds) after each of ATen's parallel ops, so they do not take the cores that our CPU
    # kernels' pool (kernels/cpu_pool.h) is using in the same decode step
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    args = build_parser().parse_args(argv)
    info = args.command == "info"
    if args.print_config_path:
        print(rosechat_config.user_config_path())
        return 0
    try:
        config = load_config(args.config, overrides_from(args))
        if config.remote.url and args.model and args.command is None:  # --model names the served model
            overrides = overrides_from(args)
            overrides["remote.model"] = overrides.pop("model.name")
            config = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"rosechat: config error: {e}", file=sys.stderr)
        return 2
    if info:
        return _info(config)
    if args.command == "serve":
        from rosechat.server.cli import serve

        return serve(config, args)

    from rosechat.model_choice import ModelChoiceError, choose_model

    model, notice, tty = None, None, sys.stderr.isatty()
    if not config.remote.url:  # a remote server's model is the server's business
        if tty:  # the check reads the model file's header: say why the screen waits (erased after)
            print(f"rosechat: opening {config.model.name}…", end="\r", file=sys.stderr, flush=True)
        try:
            model, notice = choose_model(config)
        except ModelChoiceError as e:
            print(f"{CLEAR_LINE if tty else ''}rosechat: {e}", file=sys.stderr)
            return 2

    from rosechat.history import HistoryError, HistoryStore

    path = config.history_path()
    try:
        history = HistoryStore(path)
    except (HistoryError, OSError, sqlite3.Error) as e:
        print(f"rosechat: cannot open the history database {path}: {e}", file=sys.stderr)
        return 2

    from rosechat.app import RoseChatApp

    try:
        app = RoseChatApp(config, history, model=model, model_notice=notice)
        app.run()
    finally:
        history.close()
    return app.return_code or 0


if __name__ == "__main__":
    raise SystemExit(main())
