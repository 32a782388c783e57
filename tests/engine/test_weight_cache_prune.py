"""The weight cache's pruning (engine/weights/cache_entries.py): what each load removes and keeps, through
the real load path (test_weight_cache.py tests the entries themselves)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from engine.weights import cache as weight_cache
from engine.weights import cache_entries
from engine.weights.loader import load_model
from tests.gguf_helpers import write_gguf
from tests.helpers import PagedHarness

IDS = [5, 17, 42, 9, 77, 3, 64, 21]


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("ROSECHAT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "weights"


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "llama-q4_1.gguf"
    write_gguf(path, "llama", qtype="Q4_1", embed_qtype="Q8_0")
    return path


def _load(path: Path, stages: list[str] | None = None, **kw):
    loaded = load_model(str(path), progress=(lambda p: stages.append(p.stage)) if stages is not None else None, **kw)
    weight_cache.wait_for_saves()  # the save and the pruning after it (or after a warm load)
    return loaded


def _warm(path: Path, **kw) -> bool:
    """Load `path`: whether it came from the cache (else it was repacked)."""
    stages: list[str] = []
    _load(path, stages, **kw)
    assert ("loading cached weights" in stages) != ("repacking weights" in stages), stages
    return "loading cached weights" in stages


def _sources(cache_dir: Path) -> list[str]:
    found = cache_entries.entries(cache_dir)
    assert all(e.file.suffix == ".safetensors" for e in found), found
    return sorted(Path(e.source).name for e in found)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copyfile(src, dst)
    return dst


def test_an_entry_names_its_source_file_and_variant(model_file: Path, cache_dir: Path) -> None:
    _load(model_file)
    (entry,) = cache_entries.entries(cache_dir)
    assert entry.source == str(model_file.resolve()) and not entry.stale and not entry.writing
    assert entry.variant.split()[:2] == ["auto", "float32"] and entry.size == entry.file.stat().st_size


def test_the_entries_of_a_deleted_or_changed_file_go_at_the_next_load(tmp_path: Path, model_file: Path,
                                                                      cache_dir: Path) -> None:
    a, b = _copy(model_file, tmp_path / "a.gguf"), _copy(model_file, tmp_path / "b.gguf")
    assert not _warm(a) and not _warm(b)
    assert _sources(cache_dir) == ["a.gguf", "b.gguf"]
    a.unlink()
    assert _warm(b)  # a warm load prunes too
    assert _sources(cache_dir) == ["b.gguf"]
    (old,) = cache_entries.entries(cache_dir)
    stat = b.stat()
    os.utime(b, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the same bytes, another mtime: a new key
    assert not _warm(b)
    (new,) = cache_entries.entries(cache_dir)
    assert new.file != old.file and not old.file.exists() and new.source == str(b.resolve())
    assert _warm(b)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()  # reaped: /proc has it no more
    assert not Path(f"/proc/{proc.pid}").exists()
    return proc.pid


def _tmp(cache_dir: Path, pid: int, age_s: float) -> Path:
    tmp = cache_dir / f"gone-0123456789abcdef.safetensors.{pid}.tmp"
    tmp.write_bytes(b"\0" * 100)
    past = tmp.stat().st_mtime - age_s
    os.utime(tmp, (past, past))
    return tmp


def test_an_older_layout_junk_and_abandoned_files_go_files_being_written_stay(model_file: Path, cache_dir: Path,
                                                                              monkeypatch) -> None:
    now = weight_cache.LAYOUT_VERSION
    with monkeypatch.context() as m:  # an entry an older rosechat wrote
        for module in (weight_cache, cache_entries):
            m.setattr(module, "LAYOUT_VERSION", now - 1)
        _load(model_file)
    (older,) = cache_entries.entries(cache_dir)
    assert older.stale == "" and f"(layout {now - 1}" in older.variant  # another install's, in use
    unused = older.used - cache_entries.OTHER_LAYOUT_KEEP_S - 86400
    os.utime(older.file, (unused, unused))
    (older,) = cache_entries.entries(cache_dir)
    assert older.stale == f"layout version {now - 1}, not {now}, unused for 15 days"
    junk = cache_dir / "junk-0123456789abcdef.safetensors"
    junk.write_bytes(b"\x10" + b"\0" * 63)
    old = cache_entries.ABANDONED_S + 60
    abandoned = _tmp(cache_dir, _dead_pid(), old)
    fresh = _tmp(cache_dir, _dead_pid() + 1_000_000, 0)  # its writer not here, but it was written to just now
    live = _tmp(cache_dir, os.getpid(), old)  # its writer is running (a slow disk)
    assert {e.file: bool(e.stale) for e in cache_entries.entries(cache_dir) if e.writing} == {
        abandoned: True, fresh: False, live: False}
    assert not _warm(model_file)  # the older layout misses
    left = {e.file for e in cache_entries.entries(cache_dir)}
    (current,) = left - {fresh, live}
    assert not older.file.exists() and not junk.exists() and not abandoned.exists()
    meta = json.loads(json.loads(_header(current))["__metadata__"]["rosechat.weights"])
    assert meta["version"] == now


def _header(file: Path) -> str:
    data = file.read_bytes()
    return data[8 : 8 + int.from_bytes(data[:8], "little")].decode()


def test_each_file_keeps_its_two_most_recently_used_variants(tmp_path: Path, model_file: Path,
                                                             cache_dir: Path) -> None:
    def kept() -> list[str]:
        return [e.variant.split()[0] for e in cache_entries.entries(cache_dir)]  # most recently used first

    other = _copy(model_file, tmp_path / "other.gguf")
    assert not _warm(other)  # another file's entry: not counted against this one's
    for quantization in ("auto", "int8"):
        assert not _warm(model_file, quantization=quantization)
    assert kept() == ["int8", "auto", "auto"]
    assert not _warm(model_file, quantization="int4")
    assert kept() == ["int4", "int8", "auto"] and _sources(cache_dir) == ["llama-q4_1.gguf"] * 2 + ["other.gguf"]
    assert _warm(model_file, quantization="int8")  # used again: now the most recent
    assert kept()[:2] == ["int8", "int4"]
    assert not _warm(model_file, quantization="auto")  # evicted above: repacked, and int4 goes
    assert kept() == ["auto", "int8", "auto"]
    # the entry just used is kept whatever the bound: here the older of the two
    (int8,) = [e.file for e in cache_entries.entries(cache_dir) if e.variant.startswith("int8")]
    removed = cache_entries.prune(cache_dir, keep=int8, keep_per_file=1)
    assert [e.variant.split()[0] for e in removed] == ["auto"] and int8.exists()
    assert Path(removed[0].source) == model_file.resolve()


def test_a_cleared_entry_keeps_serving_the_process_that_maps_it(model_file: Path, cache_dir: Path) -> None:
    """`rosechat cache --clear` (or another process pruning) while a rosechat runs: on Linux the mapping
    keeps the removed file's pages, so the model still computes what it did."""
    _load(model_file)
    warm = _load(model_file)
    before = PagedHarness(warm).step(prefills=[(0, IDS)])
    removed, left = cache_entries.clear(cache_dir)
    assert len(removed) == 1 and left == [] and cache_entries.entries(cache_dir) == []
    assert torch.equal(PagedHarness(warm).step(prefills=[(0, IDS)]), before)
    assert not _warm(model_file)  # and the next load repacks


def test_another_layouts_entries_in_use_stay_and_keep_their_own_count(model_file: Path, cache_dir: Path,
                                                                      monkeypatch) -> None:
    """Two rosechat installs sharing the cache folder (a release and a checkout) each keep their entries:
    pruning the other's at every load made them repack the same file in turn."""
    now = weight_cache.LAYOUT_VERSION
    with monkeypatch.context() as m:
        for module in (weight_cache, cache_entries):
            m.setattr(module, "LAYOUT_VERSION", now + 1)
        _load(model_file)
    (other,) = cache_entries.entries(cache_dir)
    assert not _warm(model_file)  # this install's own entry is written beside it
    assert _warm(model_file)
    assert cache_entries.prune(cache_dir, keep_per_file=1) == []
    assert {e.version for e in cache_entries.entries(cache_dir)} == {now, now + 1} and other.file.exists()
