"""`rosechat cache`: list the weight cache's entries (engine/weights/cache_entries.py, through the engine's
public API) with their sizes and source files; `--prune` removes the stale ones now (as every load does),
`--clear` every one."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the engine (torch) is imported when the command runs, not for every `rosechat` parse
    from engine import WeightCacheEntry as Entry


def add_cache_options(parser: argparse.ArgumentParser) -> None:
    """The command's own options. Each has its default here: the parser may suppress absent options."""
    g = parser.add_argument_group("cache").add_mutually_exclusive_group()
    g.add_argument("--prune", action="store_true", default=False,
                   help="remove the entries no load can use again (an older layout, a source file gone or "
                   "changed) and each file's least recently used variants beyond the few kept (every load "
                   "does this too)")
    g.add_argument("--clear", action="store_true", default=False,
                   help="remove every entry (the next load of each model repacks it)")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _line(entry: Entry) -> str:
    used = time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.used))
    if entry.writing:
        what = f"temporary file ({entry.stale})" if entry.stale else "being written"
    else:
        what = f"{entry.variant or '?'}  {entry.source or '?'}" + (f"  [stale: {entry.stale}]" if entry.stale else "")
    return f"  {_size(entry.size):>10}  {used}  {what}\n  {'':>10}  {entry.file.name}"


def _total(found: list[Entry]) -> str:
    return f"{len(found)} file{'' if len(found) == 1 else 's'}, {_size(sum(e.size for e in found))}"


def run_cache(args: argparse.Namespace) -> int:
    from engine import clear_weight_cache, prune_weight_cache, weight_cache_entries, weight_cache_folder

    root = weight_cache_folder()
    if root is None:
        print("rosechat cache: the cache is off (ROSECHAT_CACHE_DIR is set to an empty string)", file=sys.stderr)
        return 2
    if args.clear:
        removed, left = clear_weight_cache(root)
        print(f"removed {_total(removed)} from {root}")
        for entry in left:
            print(f"kept {entry.file.name}: {'being written' if entry.writing else 'could not be removed'}")
        return 0
    if args.prune:
        removed = prune_weight_cache(root)
        print(f"removed {_total(removed)} from {root}")
        for entry in removed:
            print(_line(entry))
        return 0
    found = weight_cache_entries(root)
    print(f"weight cache {root}: {_total(found)}")
    for entry in found:
        print(_line(entry))
    if any(e.stale for e in found):
        print("`rosechat cache --prune` removes the stale ones now (the next load would); --clear removes all")
    return 0
