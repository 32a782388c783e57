"""Command line entry point: ``rosechat [options]`` starts the app; ``rosechat info|serve|cache|bench ...``, each
with its own options (the ones several commands take are defined once, below)."""

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
    "weight_cache": "model.weight_cache",
    "device": "model.device",
    "backend": "model.attention_backend",
    "threads": "model.threads",
    "speculative_config": "model.speculative_config",
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


# --- options: one definition each, composed per command --------------------------------------------
# Every parser here is built with argument_default=SUPPRESS: an option that is not given is absent
# from the namespace (overrides_from reads it with a default), so an option given before the command
# (`rosechat --config F serve`) is not reset by the command's own default.


class Parser(argparse.ArgumentParser):
    """argparse's parser, saying which options it takes (argparse keeps its actions private)."""

    @property
    def flags(self) -> dict[str, str]:
        """Each dest -> its first option string."""
        return {a.dest: a.option_strings[0] if a.option_strings else a.dest for a in self._actions}

    @property
    def option_strings(self) -> set[str]:
        return {s for a in self._actions for s in a.option_strings}


def _config_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="a TOML file overriding the user config")


def _model_options(parser: argparse.ArgumentParser) -> None:
    m = parser.add_argument_group("model")
    m.add_argument("--model", metavar="PATH_OR_ID",
                   help='a .gguf file, a folder (one .gguf, or a Hugging Face model), a hub id, '
                   '"smollm2-135m-instruct" (the default) or "demo" (random weights)')
    m.add_argument("--dtype", choices=DTYPES, help="activations and KV cache (auto, the default: float32 on "
                   "the CPU, where our kernels compute in it; bfloat16 on CUDA, float16 where the GPU lacks it)")
    m.add_argument("--quantization", choices=QUANTIZATIONS,
                   help="weights: auto (the default: on the CPU a GGUF's tensors stay packed as the file has "
                   "them; on CUDA dense), none (dequantized at load: exact), int8, int4 (every linear layer "
                   "packed; CPU only)")
    m.add_argument("--weight-cache", action=argparse.BooleanOptionalAction,
                   help="keep repacked weights in the user cache, so the next load maps them (on by default)")
    m.add_argument("--device", help='"auto" (the default: CUDA when torch sees a GPU), "cpu", "cuda", "cuda:N"')
    m.add_argument("--backend", choices=BACKENDS,
                   help="paged-attention implementation (auto: triton on CUDA, torch on the CPU)")
    m.add_argument("--threads", type=int, metavar="N",
                   help="CPU threads for the model (0 = PyTorch's default, one per core)")
    m.add_argument("--speculative-config", metavar="JSON",
                   help='speculative decoding as vLLM takes it: "auto" (the default: \'{"method": "ngram", '
                   '"num_speculative_tokens": 4}\', prompt lookup: the same reply, sooner where it repeats earlier '
                   'text, guessing only where it is expected to gain), "off", or '
                   '\'{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}\' (a smaller model with '
                   'the same tokenizer guesses)')


def _cache_options(parser: argparse.ArgumentParser) -> None:
    c = parser.add_argument_group("KV cache and scheduling")
    c.add_argument("--block-size", type=int, metavar="N", help="tokens per KV block (a power of two)")
    c.add_argument("--kv-cache-mib", type=int, metavar="MIB", help="KV cache budget (0 = automatic)")
    c.add_argument("--num-blocks", type=int, metavar="N", help="fixed KV pool size (0 = from the budget)")
    c.add_argument("--max-num-seqs", type=int, metavar="N", help="sequences per engine step")
    c.add_argument("--max-batched-tokens", type=int, metavar="N",
                   help="tokens per engine step (longer prompts are prefilled in chunks)")
    c.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction,
                   help="reuse the KV blocks of prefixes seen before")


def _sampling_options(parser: argparse.ArgumentParser, title: str = "sampling", what: str = "") -> None:
    s = parser.add_argument_group(title, f"{what}The model's own settings apply where these are not given.")
    s.add_argument("--temperature", type=float, metavar="T", help="0 = greedy")
    s.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling mass, (0, 1]")
    s.add_argument("--top-k", type=int, metavar="K", help="0 = off")
    s.add_argument("--min-p", type=float, metavar="P",
                   help="drop tokens below min_p x the top probability; 0 = off")
    s.add_argument("--max-tokens", type=int, metavar="N", help="longest reply (lowered to what the context leaves)")
    s.add_argument("--repetition-penalty", type=float, metavar="X", help="> 1 discourages repeats; 1 = off")
    s.add_argument("--repetition-window", type=int, metavar="N",
                   help="the penalty looks at the reply's last N tokens; 0 = the whole context, prompt included")
    s.add_argument("--seed", type=int, metavar="N", help="-1 = a fresh random seed each time")


def _app_options(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument_group("chat and app")
    a.add_argument("--system-prompt", metavar="TEXT", help="system prompt of new conversations")
    a.add_argument("--alternatives", type=int, metavar="N", help="replies sampled by ctrl+r")
    a.add_argument("--history", metavar="PATH", help="SQLite file for saved conversations")
    a.add_argument("--theme", help="a Textual theme, e.g. textual-dark, nord, gruvbox")
    a.add_argument("--kv-panel", action=argparse.BooleanOptionalAction, help="show the KV panel")
    r = parser.add_argument_group("remote server (instead of the in-process engine)")
    r.add_argument("--remote", metavar="URL", help="an OpenAI-compatible server: vLLM, SGLang, llama.cpp, Ollama, "
                   "rosechat serve (e.g. http://localhost:8000/v1); --model then names the served model")
    r.add_argument("--api-key", metavar="KEY", help="the remote server's API key (or set $ROSECHAT_API_KEY)")


def _parsers() -> tuple[Parser, dict[str, Parser]]:
    """The top-level parser (the app's options) and each command's own (info, serve, cache; bench parses its own)."""
    from rosechat import __version__
    from rosechat.cache_command import add_cache_options
    from rosechat.server.cli import add_serve_options

    quiet = argparse.SUPPRESS
    p = Parser(
        prog="rosechat", argument_default=quiet, exit_on_error=False,  # _parse names a misplaced option
        usage="%(prog)s [options]  (the app)\n       %(prog)s {info,serve,cache,bench} [options]",
        description="Terminal chat for local language models on a paged KV-cache engine. Without a command "
        "the app starts, with the options below. Options override config.toml; see `rosechat "
        "--print-config-path`. Each command has its own options: `rosechat COMMAND --help`.",
    )
    p.add_argument("--version", action="version", version=f"rosechat {__version__}")
    p.add_argument("--print-config-path", action="store_true", default=False,
                   help="print where the user config file goes")
    commands = p.add_subparsers(dest="command", title="commands (without one, the app starts)", metavar="COMMAND")
    info = commands.add_parser(
        "info", prog="rosechat info", argument_default=quiet,
        help="the model and where each sampling setting comes from",
        description="Show the versions, the backend, the model and each effective sampling setting with where "
        "it comes from (a flag, a config file, the model's own settings or rosechat's default).")
    serve = commands.add_parser(
        "serve", prog="rosechat serve", argument_default=quiet, help="an OpenAI-compatible HTTP server over the engine",
        description="Serve the model over an OpenAI-compatible HTTP API (chat and text completions, "
        "/v1/models, /health, /metrics). Options override config.toml, as for the app.")
    cache = commands.add_parser(
        "cache", prog="rosechat cache", argument_default=quiet, help="list or clear the packed-weight cache",
        description="List the weight cache's entries (a GGUF file's weights as our CPU kernels take them, "
        "kept so that the next load maps them instead of repacking), with their sizes, source files and "
        "why an entry is stale. Loads remove stale entries themselves.")
    commands.add_parser("bench", prog="rosechat bench", add_help=False,
                        help="benchmarks and checks (`rosechat bench --help`)")
    # the app
    _config_option(p)
    _model_options(p)
    _cache_options(p)
    _sampling_options(p)
    _app_options(p)
    # rosechat info: what choosing the model and reporting its sampling settings read
    _config_option(info)
    _model_options(info)
    _sampling_options(info)
    # rosechat serve
    _config_option(serve)
    _model_options(serve)
    _cache_options(serve)
    _sampling_options(serve, "sampling defaults", "For the fields a request leaves out. ")
    add_serve_options(serve)
    # rosechat cache: where the cache is comes from $ROSECHAT_CACHE_DIR, not the config
    add_cache_options(cache)
    return p, {"info": info, "serve": serve, "cache": cache}


def build_parser() -> argparse.ArgumentParser:
    return _parsers()[0]


def _hint(tokens: list[str], parser: Parser, parsers: dict[str, Parser]) -> str:
    """' (--host is an option of `rosechat serve`; ...)' for the first of `tokens` that another command takes."""
    for flag in (t.split("=")[0] for t in tokens if t.startswith("--")):
        if flag in parser.option_strings:
            continue
        owners = [who for who, c in parsers.items() if flag in c.option_strings]
        if owners:
            return f" ({flag} is an option of {' and '.join(owners)}; see `{parser.prog} --help`)"
    return ""


def _parse(argv: list[str]) -> argparse.Namespace:
    """Parse, refusing (exit 2, naming it) an option the command does not take, given before it or after it."""
    top, commands = _parsers()
    parsers = {"the app": top, **{f"`rosechat {name}`": c for name, c in commands.items()}}
    try:
        args, extra = top.parse_known_args(argv)
    except argparse.ArgumentError as e:  # e.g. `rosechat --host X`: X taken for the command
        top.error(f"{e}{_hint(argv, top, parsers)}")
    if args.command == "bench":  # main() hands `rosechat bench ...` to the bench before parsing
        top.error("`rosechat bench` takes no options before it: rosechat bench [options] (`rosechat bench --help`)")
    parser = commands.get(args.command, top)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}{_hint(extra, parser, parsers)}")
    if args.command in commands:  # an option given before the command must be one the command takes
        takes = parser.flags
        for dest in sorted(vars(args).keys() - takes.keys() - {"command", "print_config_path"}):
            parser.error(f"{top.flags[dest]} (given before the command) is an option of the app, not of "
                         f"`{parser.prog}`: its options go after it (see `{parser.prog} --help`)")
    return args


def overrides_from(args: argparse.Namespace) -> dict[str, Any]:
    """Config keys set by the options given; an option the command does not have overrides nothing."""
    return {key: value for dest, key in FLAG_KEYS.items() if (value := getattr(args, dest, None)) is not None}


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
    # kernels' pool (kernels/cpu/pool.h) is using in the same decode step
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    args = _parse(argv)
    info = args.command == "info"
    if args.print_config_path:
        print(rosechat_config.user_config_path())
        return 0
    if args.command == "cache":
        from rosechat.cache_command import run_cache

        return run_cache(args)
    config_file, overrides = getattr(args, "config", None), overrides_from(args)
    try:
        config = load_config(config_file, overrides)
        if config.remote.url and "model.name" in overrides and args.command is None:  # the served model
            overrides["remote.model"] = overrides.pop("model.name")
            config = load_config(config_file, overrides)
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
