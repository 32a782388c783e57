"""Bad files and models too large, through each front end: one line naming the problem and exit 2 from
`rosechat` and `rosechat serve` (before the app or the server starts), the load error in the app."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from rosechat import cli
from rosechat import config as cfg
from rosechat.app import RoseChatApp
from tests.gguf_helpers import write_gguf, write_typed

LIMIT = "ROSECHAT_MEMORY_LIMIT"


@pytest.fixture(autouse=True)
def no_user_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(cfg, "user_config_path", lambda: tmp_path / "absent" / "config.toml")


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("good") / "tiny-q4.gguf"
    write_gguf(path, "llama", qtype="Q4_0")
    return path


def _bad(kind: str, good: Path, folder: Path) -> tuple[Path, str]:
    """A file of the `kind` of trouble, and what its line must say."""
    if kind == "truncated":
        path = folder / "cut.gguf"
        path.write_bytes(good.read_bytes()[: good.stat().st_size * 2 // 3])
        return path, "is truncated or damaged"
    if kind == "split":
        path = folder / "model-00001-of-00002.gguf"
        shutil.copy(good, path)
        return path, "one part of a split GGUF"
    if kind == "architecture":
        path = folder / "bert.gguf"
        write_typed(path, "F16", arch="bert")
        return path, "GGUF architecture 'bert' is not supported"
    path = folder / "q8_1.gguf"
    write_typed(path, "Q8_1")
    return path, "tensor 'token_embd.weight' has type Q8_1, which rosechat cannot load"


def _one_line(capsys, argv: list[str], prefix: str) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(prefix), err
    return err


@pytest.mark.parametrize("kind", ["truncated", "split", "architecture", "tensor type"])
def test_a_bad_file_is_one_line_and_exit_2_from_the_app_and_serve(kind, good: Path, tmp_path: Path, capsys,
                                                                  monkeypatch) -> None:
    monkeypatch.setattr(RoseChatApp, "run", lambda self, *a, **k: pytest.fail("the app started"))
    path, says = _bad(kind, good, tmp_path)
    assert says in _one_line(capsys, ["--model", str(path), "--history", str(tmp_path / "h.db")], "rosechat: ")
    assert says in _one_line(capsys, ["serve", "--model", str(path), "--port", "0"], "rosechat serve: ")


def test_a_model_too_large_is_one_line_with_the_figures(good: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(RoseChatApp, "run", lambda self, *a, **k: pytest.fail("the app started"))
    monkeypatch.setenv(LIMIT, "200000")
    figures = r"tiny-q4.gguf needs about \d+\.\d GB for its weights plus \d+\.\d GB for the smallest KV cache; " \
              r"0\.0 GB is available"
    err = _one_line(capsys, ["--model", str(good), "--history", str(tmp_path / "h.db")], "rosechat: ")
    assert re.search(figures, err), err
    err = _one_line(capsys, ["serve", "--model", str(good), "--port", "0"], "rosechat serve: ")
    assert re.search(figures, err), err
    monkeypatch.setenv(LIMIT, str(1 << 40))  # room enough: the app starts
    started: list[RoseChatApp] = []
    monkeypatch.setattr(RoseChatApp, "run", lambda self, *a, **k: started.append(self))
    assert cli.main(["--model", str(good), "--history", str(tmp_path / "h.db")]) == 0 and started


async def test_memory_gone_by_the_time_the_app_loads_shows_the_error(good: Path, tmp_path: Path, monkeypatch) -> None:
    """Memory taken between the check at the start and the load: the app's load fails with the same line."""
    from engine import resolve_model
    from rosechat.config import load_config
    from rosechat.history import HistoryStore
    from rosechat.widgets.loading import LoadBar
    from tests.rosechat.test_app import SIZE, wait_for

    config = load_config(overrides={"model.name": str(good), "history.path": str(tmp_path / "h.sqlite3")},
                         user_file=None)
    monkeypatch.setenv(LIMIT, "200000")
    app = RoseChatApp(config, HistoryStore(config.history_path()), model=resolve_model(str(good)))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.load_error is not None, "the load to fail", timeout=60)
        assert "for the smallest KV cache; 0.0 GB is available" in app.query_one("#loading-bar", LoadBar).text
