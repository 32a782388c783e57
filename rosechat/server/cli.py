"""`rosechat serve`: load the model with the model, cache and sampling options it shares with the app
(rosechat/cli.py), then serve it until Ctrl+C."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys

from rosechat.config import Config
from rosechat.server.tools import PARSERS

API_KEY_ENV = "ROSECHAT_API_KEY"


def add_serve_options(parser: argparse.ArgumentParser) -> None:
    """The server's own options. Each has its default here: the parser may suppress absent options."""
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    g.add_argument("--port", type=int, default=8000, help="TCP port (0 = any free one; default 8000)")
    # not dest api_key: that is the app's --api-key, the key of a remote server (remote.api_key)
    g.add_argument("--api-key", dest="server_api_key", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on every endpoint but /health (or set ${API_KEY_ENV})")
    g.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id clients send (default: --model)")
    g.add_argument("--max-queued", type=int, default=256, metavar="N",
                   help="requests in flight (running + waiting) before new ones get 503 (default 256)")
    g.add_argument("--max-n", type=int, default=16, metavar="N", help="most samples (n) per request (default 16)")
    g.add_argument("--allow-unknown-fields", action="store_true", default=False,
                   help="ignore request fields the API does not define (logged once) instead of answering 400; "
                   "fields of the API that rosechat does not implement are refused either way")
    g.add_argument("--tool-call-parser", choices=PARSERS, default="auto",
                   help="how the model writes tool calls: hermes (<tool_call> JSON, Qwen2.5/3 and templates "
                   "without tools), llama3_json (Llama 3.1+); auto (default) picks from the chat template")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def serve(config: Config, args: argparse.Namespace) -> int:
    from engine import LLMEngine, generation_defaults
    from rosechat.model_choice import ModelChoiceError, choose_model
    from rosechat.server.app import ServerSettings, create_app
    from rosechat.server.loading import LoadingServer
    from rosechat.server.run import bind, uvicorn_config

    api_key = args.server_api_key or os.environ.get(API_KEY_ENV) or None
    if not _is_loopback(args.host) and not api_key:
        print(f"rosechat serve: warning: listening on {args.host} without an API key: anyone who can reach "
              "this port can use the model", file=sys.stderr)
    try:
        model, notice = choose_model(config)
    except ModelChoiceError as e:
        print(f"rosechat serve: {e}", file=sys.stderr)
        return 2
    if notice:
        print(f"rosechat serve: {notice}", file=sys.stderr)
    try:
        sock = bind(args.host, args.port)
    except OSError as e:
        print(f"rosechat serve: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    sampling = config.sampling_kwargs(model_defaults=generation_defaults(model))
    sampling.pop("n", None)
    # the default model missing, the demo runs instead (notice): clients must not be told otherwise
    name = args.served_model_name or ("demo" if notice else config.model.name)
    settings = ServerSettings(model_name=name, api_key=api_key,
                              max_n=args.max_n, max_queued=args.max_queued, sampling_defaults=sampling,
                              allow_unknown_fields=args.allow_unknown_fields, tool_call_parser=args.tool_call_parser)
    import uvicorn

    host, port = sock.getsockname()[:2]
    address = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    failed: list[str] = []

    def say(line: str) -> None:
        print(f"rosechat serve: {line}", file=sys.stderr, flush=True)

    def ready(llm: LLMEngine) -> None:
        info = llm.info
        say(f"{settings.model_name} ({info.device}, {info.dtype}, {info.num_blocks} KV blocks of {info.block_size}, "
            f"context {info.max_model_len}) on {address}/v1{' (API key required)' if api_key else ''}")
        if info.notice:
            say(info.notice)

    def load_failed(error: str) -> None:
        failed.append(error)
        server.should_exit = True

    app = LoadingServer(lambda progress: LLMEngine.from_pretrained(model, progress, **config.engine_kwargs()),
                        lambda llm: create_app(llm, settings), log=say, on_ready=ready, on_failed=load_failed)
    server = uvicorn.Server(uvicorn_config(app, log_level="info"))  # type: ignore[arg-type]
    say(f"listening on {address}; loading {model.display_name} (/health answers 503 with the stage until it is "
        "ready)")
    try:  # Ctrl+C: uvicorn stops accepting, ends open streams, runs the shutdown (the engine thread stops)
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the signal once it has shut down cleanly
        pass
    if failed:  # the model did not load (said above): the exit status of a model refused before the start
        return 2
    print("rosechat serve: stopped", file=sys.stderr)
    return 0
