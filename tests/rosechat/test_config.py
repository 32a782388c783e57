"""Config: defaults from the documented file, layering, and errors that name key, file and line."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from rosechat import config as cfg
from rosechat.config import ConfigError, load_config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_root_config_is_the_packaged_defaults() -> None:
    # The repository's config.toml documents the defaults; the wheel ships the same text.
    assert (ROOT / "config.toml").read_text() == cfg.default_config_text()


def test_defaults_load_and_every_option_is_documented() -> None:
    data = tomllib.loads((ROOT / "config.toml").read_text())
    c = load_config(user_file=None)
    for section, cls in cfg.SECTIONS.items():
        names = {f.name for f in dataclasses.fields(cls)}
        assert set(data[section]) == names, section
        for name in names:
            assert getattr(getattr(c, section), name) == data[section][name], f"{section}.{name}"
    assert c.chat.alternatives == 3
    assert c.cache.enable_prefix_caching is True
    assert isinstance(c.sampling.temperature, float)


def test_user_file_overrides_defaults_and_config_flag_overrides_user(tmp_path: Path) -> None:
    user = tmp_path / "user.toml"
    user.write_text('[model]\nname = "user-model"\n[cache]\nblock_size = 32\n[ui]\nshow_kv_panel = true\n')
    explicit = tmp_path / "explicit.toml"
    explicit.write_text("[cache]\nblock_size = 8\n[sampling]\ntemperature = 1\n")

    c = load_config(user_file=user)
    assert (c.model.name, c.cache.block_size, c.ui.show_kv_panel) == ("user-model", 32, True)
    assert c.sources[-1] == str(user)

    c = load_config(explicit, user_file=user)
    assert c.model.name == "user-model"  # from the user file, untouched by --config
    assert c.cache.block_size == 8
    assert c.sampling.temperature == 1.0 and isinstance(c.sampling.temperature, float)
    assert c.sources[1:] == (str(user), str(explicit))


def test_user_file_found_in_platform_config_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    user = tmp_path / "cfgdir" / "config.toml"
    user.parent.mkdir()
    user.write_text('[chat]\nsystem_prompt = "Be terse."\n')
    monkeypatch.setattr(cfg, "user_config_path", lambda: user)
    assert load_config().chat.system_prompt == "Be terse."


def test_cli_overrides_everything(tmp_path: Path) -> None:
    explicit = tmp_path / "c.toml"
    explicit.write_text('[model]\nname = "from-file"\ndevice = "cuda"\n')
    c = load_config(explicit, {"model.name": "demo", "model.device": None, "cache.kv_cache_mib": 64,
                               "model.threads": 3}, user_file=None)
    assert c.model.name == "demo"
    assert c.model.device == "cuda"  # None means "flag not given"
    assert c.engine_kwargs()["kv_cache_bytes"] == 64 * 2**20
    assert c.engine_kwargs()["num_threads"] == 3


def test_unknown_key_names_key_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[model]\nname = "demo"\n\n[cache]\n# a comment\nblock_size = 16\nblok_sise = 3\n')
    with pytest.raises(ConfigError) as e:
        load_config(path, user_file=None)
    err = e.value
    assert (err.key, err.source, err.line) == ("cache.blok_sise", str(path), 7)
    assert f"{path}:7" in str(err) and "cache.blok_sise" in str(err)


def test_unknown_section_names_its_header_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[model]\nname = "demo"\n[modle]\nname = "x"\n')
    with pytest.raises(ConfigError) as e:
        load_config(path, user_file=None)
    assert (e.value.key, e.value.line) == ("modle", 3)
    assert "did you mean 'model'" in str(e.value)


def test_wrong_type_names_key_file_and_line(tmp_path: Path) -> None:
    # The same key name in two tables: the line must come from the right table.
    path = tmp_path / "bad.toml"
    path.write_text('[model]\nname = "demo"\n\n[ui]\ntheme = "nord"\nshow_kv_panel = "yes"\n')
    with pytest.raises(ConfigError) as e:
        load_config(path, user_file=None)
    assert (e.value.key, e.value.source, e.value.line) == ("ui.show_kv_panel", str(path), 6)
    assert "true or false" in str(e.value)

    path.write_text('[sampling]\nmax_tokens = 10\n[cache]\nmax_num_seqs = true\n')
    with pytest.raises(ConfigError) as e:
        load_config(path, user_file=None)
    assert (e.value.key, e.value.line) == ("cache.max_num_seqs", 4)


def test_out_of_range_and_bad_choice(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[chat]\n\nalternatives = 0\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, user_file=None)
    assert (e.value.key, e.value.line) == ("chat.alternatives", 3)
    path.write_text('[model]\nattention_backend = "cuda"\n')
    with pytest.raises(ConfigError) as e:
        load_config(path, user_file=None)
    assert (e.value.key, e.value.line) == ("model.attention_backend", 2)
    with pytest.raises(ConfigError) as e:
        load_config(overrides={"model.threads": -1}, user_file=None)
    assert e.value.key == "model.threads"
    with pytest.raises(ConfigError) as e:
        load_config(overrides={"cache.block_size": 0}, user_file=None)
    assert e.value.key == "cache.block_size" and e.value.source == "command line"


def test_toml_syntax_error_has_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[model]\nname = "demo"\ndtype = \n')
    with pytest.raises(ConfigError) as e:
        load_config(path, user_file=None)
    assert e.value.source == str(path) and e.value.line == 3


def test_missing_config_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "nope.toml", user_file=None)
    assert e.value.source == str(tmp_path / "nope.toml")


def test_history_path_defaults_to_user_data_dir(tmp_path: Path) -> None:
    c = load_config(user_file=None)
    assert c.history_path().name == "history.sqlite3"
    assert "rosechat" in str(c.history_path())
    c = load_config(overrides={"history.path": str(tmp_path / "h.db")}, user_file=None)
    assert c.history_path() == tmp_path / "h.db"


def test_sampling_kwargs() -> None:
    c = load_config(overrides={"sampling.seed": -1}, user_file=None)
    assert c.sampling_kwargs(n=3)["seed"] is None and c.sampling_kwargs(n=3)["n"] == 3
    c = load_config(overrides={"sampling.seed": 7}, user_file=None)
    assert c.sampling_kwargs()["seed"] == 7


def test_theme_and_block_size_are_checked(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[ui]\ntheme = "no-such-theme"\n')
    with pytest.raises(ConfigError) as e:
        load_config(path, user_file=None)
    assert (e.value.key, e.value.line) == ("ui.theme", 2) and "textual-dark" in str(e.value)
    path.write_text("[cache]\nblock_size = 24\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, user_file=None)
    assert (e.value.key, e.value.line) == ("cache.block_size", 2) and "power of two" in str(e.value)


def test_exports_go_to_a_documented_folder_never_the_current_directory(tmp_path: Path, monkeypatch) -> None:
    import platformdirs

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(platformdirs, "user_documents_dir", lambda: str(tmp_path / "Documents"))
    c = load_config(user_file=None)
    assert c.export_path() == tmp_path / "Documents" / "rosechat"
    c = load_config(overrides={"history.export_dir": "~/exports"}, user_file=None)
    assert c.export_path() == Path("~/exports").expanduser()


def test_speculative_config_is_checked_and_reaches_the_engine(tmp_path: Path) -> None:
    path = tmp_path / "spec.toml"
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    path.write_text(f'[model]\nname = "demo"\nspeculative_config = \'{spec}\'\n')
    assert load_config(path, user_file=None).engine_kwargs()["speculative_config"] == spec
    assert load_config(user_file=None).engine_kwargs()["speculative_config"] == "auto"  # the default: on
    for off in ("", "off"):
        assert load_config(overrides={"model.speculative_config": off}, user_file=None
                           ).engine_kwargs()["speculative_config"] in (None, "off")
    path.write_text('[model]\n\nspeculative_config = \'{"method": "medusa"}\'\n')
    with pytest.raises(ConfigError) as e:
        load_config(path, user_file=None)
    assert (e.value.key, e.value.line) == ("model.speculative_config", 3)
    assert "'medusa' is not supported" in str(e.value)
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(overrides={"model.speculative_config": '{"tokens": 3}'}, user_file=None)


def test_a_draft_model_speculative_config_reaches_the_engine() -> None:
    spec = '{"method": "draft_model", "model": "smollm2-135m-instruct", "num_speculative_tokens": 3}'
    c = load_config(overrides={"model.speculative_config": spec}, user_file=None)
    assert c.engine_kwargs()["speculative_config"] == spec
    with pytest.raises(ConfigError, match="draft_model takes a model"):
        load_config(overrides={"model.speculative_config": '{"method": "draft_model"}'}, user_file=None)
