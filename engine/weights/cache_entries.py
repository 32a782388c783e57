"""The weight cache's folder (cache.py writes and maps one entry): what each entry holds, read from its
header, and the removal of the entries no load will use again (`rosechat cache` lists and clears them).

`prune` runs in the background after an entry is written and after one is loaded (cache.py). It removes:
  * a temporary file (`<entry>.<token>.<pid>.tmp`, written then renamed) whose writer is gone: its process is not
    running on this machine and it has not been written to for ABANDONED_S (a writer on another machine
    sharing the folder has another process table, and writes continuously). A file being written stays;
  * an entry that cannot be read, is incomplete, or whose source GGUF file is gone or has another size or
    mtime: no load can hit it again (its key includes them);
  * an entry of another LAYOUT_VERSION not used for OTHER_LAYOUT_KEEP_S: another rosechat install sharing the
    folder (a release and a checkout, or two checkouts) loads its own entries, which refreshes them; pruning
    them at once made two versions repack at every alternate load;
  * of the entries of one source file and layout still there (other quantizations or dtypes, or the kernels
    of another CPU when the home folder moved or is shared), all but the KEEP_PER_FILE most recently used
    (an entry's mtime: set when it is written and again each time it is loaded). So the cache stays
    within a small multiple of the GGUF files the user keeps, and shrinks when they go.
The entry just written or loaded is always kept. Deleting an entry another process has mapped is safe on
Linux (cache.py maps it MAP_PRIVATE and never truncates it: the mapping keeps the file's pages, and its
space is freed when it is unmapped); where the OS refuses (Windows), the entry stays for the next prune.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from engine.weights.gguf_config import cache_root

LAYOUT_VERSION = 6  # bump when a packed format's tensors or their layout, or an entry's header, change
# (5: an untied GGUF embedding is packed; 6: the header names its source file and variant, for pruning)
META = "rosechat.weights"  # the safetensors metadata key of an entry's own header
KEEP_PER_FILE = 2  # entries kept per source file: the variant in use and one other (e.g. a second CPU)
OTHER_LAYOUT_KEEP_S = 14 * 86400  # an entry of another layout version (another install's) unused this long goes
ABANDONED_S = 600  # a temporary file not written to for this long, by no process here, is abandoned
log = logging.getLogger(__name__)


class CacheMiss(Exception):
    """A cache entry that cannot be used (why, in words)."""


@dataclass(frozen=True)
class Entry:
    """One file in the cache folder: an entry, or a temporary file an entry is being written to."""

    file: Path
    size: int  # bytes on disk
    used: float  # when it was last written or loaded (its mtime, seconds since the epoch)
    source: str  # the GGUF file it was packed from ("" if unknown: unreadable, or being written)
    variant: str  # "quantization dtype ISA", e.g. "auto float32 avx2"
    stale: str  # why no load will use it again; "" when one may
    writing: bool = False  # a temporary file (being written, or abandoned if stale)
    version: object = None  # its LAYOUT_VERSION, as its header says


def folder() -> Path | None:
    """The weight cache's folder: "weights/" beside the GGUF config cache; None when caching is off
    (ROSECHAT_CACHE_DIR="")."""
    root = cache_root()
    return None if root is None else root.parent / "weights"


def read_header(f: BinaryIO, size: int) -> tuple[int, dict, dict]:
    """(where the data starts, the tensors' header, our metadata) of an entry open as `f`, `size` bytes
    long; CacheMiss (or ValueError) if the header is damaged or the file is not as long as it says."""
    head = f.read(8)
    if len(head) < 8:
        raise CacheMiss("no header")
    (length,) = struct.unpack("<Q", head)
    if length > min(size, 64 << 20):
        raise CacheMiss("bad header length")
    header = json.loads(f.read(length))
    if not isinstance(header, dict):
        raise CacheMiss("the header is not a table")
    meta = json.loads(header.pop("__metadata__", {}).get(META, "{}"))
    start = 8 + length
    if start + max((v["data_offsets"][1] for v in header.values()), default=0) != size:
        raise CacheMiss(f"{size} bytes, not what the header describes")
    return start, header, meta


def source_stat(path: str) -> dict[str, int | str]:
    """What an entry records of its source file, to tell later whether the file is still the same one."""
    stat = os.stat(path)
    return {"path": path, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def describe(file: Path, now: float | None = None) -> Entry:
    """An entry or a temporary file, read from its header, and whether it is stale."""
    stat = file.stat()
    now = time.time() if now is None else now
    if file.name.endswith(".tmp"):
        gone = _abandoned(file, stat.st_mtime, now)
        return Entry(file, stat.st_size, stat.st_mtime, "", "", "abandoned: its writer is gone" if gone else "",
                     writing=True)
    meta: dict = {}
    try:
        with open(file, "rb") as f:
            _, _, meta = read_header(f, stat.st_size)
        source, variant = meta.get("source") or {}, meta.get("variant") or {}
        name = str(source.get("path", ""))
        what = " ".join(str(variant.get(k, "?")) for k in ("quantization", "dtype", "isa"))
        if meta.get("version") != LAYOUT_VERSION:
            what += f" (layout {meta.get('version')}: another rosechat's)"
        stale = _stale(meta.get("version"), source, now - stat.st_mtime)
    except (CacheMiss, OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        name, what, stale = "", "", f"unreadable: {e}"
    return Entry(file, stat.st_size, stat.st_mtime, name, what, stale, version=meta.get("version"))


def _stale(version: object, source: dict, unused_s: float) -> str:
    if version != LAYOUT_VERSION and unused_s >= OTHER_LAYOUT_KEEP_S:
        return f"layout version {version}, not {LAYOUT_VERSION}, unused for {unused_s / 86400:.0f} days"
    if not source.get("path"):
        return "names no source file"
    try:
        now = source_stat(str(source["path"]))
    except (FileNotFoundError, NotADirectoryError):
        return "its source file is gone"
    except OSError:
        return ""  # cannot tell (permissions): kept
    if (now["size"], now["mtime_ns"]) != (source.get("size"), source.get("mtime_ns")):
        return "its source file has changed"
    return ""


def _abandoned(tmp: Path, mtime: float, now: float) -> bool:
    """Whether a temporary file's writer is gone (`<entry>.<token>.<pid>.tmp`): not written to for ABANDONED_S
    and its process not running here (where /proc tells)."""
    if now - mtime < ABANDONED_S:
        return False
    pid = tmp.name.rsplit(".", 2)[-2] if tmp.name.count(".") >= 2 else ""
    return not (pid.isdigit() and Path("/proc/self").exists() and Path(f"/proc/{pid}").exists())


def entries(root: Path) -> list[Entry]:
    """Every entry and temporary file in the cache folder `root`, most recently used first."""
    now, found = time.time(), []
    for file in root.glob("*") if root.is_dir() else ():
        if file.is_file() and file.name.endswith((".safetensors", ".tmp")):
            try:
                found.append(describe(file, now))
            except FileNotFoundError:  # removed meanwhile (another process pruned it, or renamed its .tmp)
                continue
    return sorted(found, key=lambda e: -e.used)


def prune(root: Path, keep: Path | None = None, keep_per_file: int = KEEP_PER_FILE) -> list[Entry]:
    """Remove the stale entries and abandoned temporary files, and all but the `keep_per_file` most
    recently used entries of each source file (`keep`, the entry just written or loaded, always stays);
    return what was removed."""
    found = entries(root)  # most recently used first
    doomed = [e for e in found if e.stale and e.file != keep]
    live = sorted((e for e in found if not e.stale and not e.writing), key=lambda e: e.file != keep)  # stable
    count: dict[tuple[str, object], int] = {}
    for entry in live:  # `keep` first, then by recency
        mine = (entry.source, entry.version)  # another layout's entries are another install's to keep
        count[mine] = count.get(mine, 0) + 1
        if count[mine] > keep_per_file:
            doomed.append(entry)
    return [e for e in doomed if _remove(e, "stale" if e.stale else "least recently used")]


def prune_abandoned(entry: Path) -> None:
    """Remove the abandoned temporary files of one entry (its writer killed mid-write)."""
    for tmp in entry.parent.glob(f"{entry.name}.*.tmp"):
        try:
            found = describe(tmp)
        except FileNotFoundError:
            continue
        if found.stale:
            _remove(found, "stale")


def clear(root: Path) -> tuple[list[Entry], list[Entry]]:
    """Remove every entry and abandoned temporary file: (removed, left: being written, or refused)."""
    removed, left = [], []
    for entry in entries(root):
        if entry.writing and not entry.stale:
            left.append(entry)
        else:
            (removed if _remove(entry, "cleared") else left).append(entry)
    return removed, left


def _remove(entry: Entry, why: str) -> bool:
    try:
        entry.file.unlink(missing_ok=True)
    except OSError as e:  # e.g. mapped by a process on an OS that refuses: the next prune tries again
        log.warning("weight cache: could not remove %s: %s", entry.file.name, e)
        return False
    log.info("weight cache: removed %s (%s%s, %d MiB)", entry.file.name, why,
             f": {entry.stale}" if entry.stale else "", entry.size >> 20)
    return True


__all__ = ["ABANDONED_S", "KEEP_PER_FILE", "LAYOUT_VERSION", "CacheMiss", "Entry", "clear", "describe", "entries",
           "folder", "prune", "prune_abandoned", "read_header", "source_stat"]
