"""What the KV panel draws a block as: the kinds of cell in order of interest, their glyphs and colours, and the
folding of a pool into cells (several blocks a cell when the pool outgrows the panel). No widget here."""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

from rich.style import Style

from engine.events import CACHED, NULL, USED, CacheSnapshot

# Distinct on dark and light backgrounds; tabs take them in order, unknown owners by a stable hash.
PALETTE = (
    "#e5677f", "#5fb3f6", "#98c379", "#e5c07b", "#c678dd", "#56b6c2",
    "#f08d49", "#a3be8c", "#ff79c6", "#8be9fd", "#d19a66", "#b48ead",
)

# Cell kinds, in order of interest: a cell that groups several blocks shows its most interesting one; held blocks
# are K_USED and up. Speculation adds two short-lived kinds: a block that held guesses as they were checked, and a
# block a rollback gave back to the pool (drawn by the one snapshot after it, then plain free).
K_NULL, K_FREE, K_CACHED, K_RETURNED, K_USED, K_SHARED, K_GUESS = range(-1, 6)
GUESS_STYLE, RETURNED_STYLE = Style(color="#000000", bgcolor="#ffffff", bold=True), Style(color="#ff5f5f", bold=True)
# A model with sliding-window layers has KV cache groups: the full group's blocks are solid, a windowed group's
# shaded, so its few blocks are seen sliding along and going back to the pool.
USED_GLYPHS, CACHED_GLYPHS = ("█", "▓", "▚"), ("▒", "░", "░")


def owner_color(owner: str) -> str:
    """A stable colour for an owner id (crc32, not hash(): that changes between runs)."""
    return PALETTE[zlib.crc32(owner.encode()) % len(PALETTE)]


@dataclass(frozen=True)
class OwnerStyle:
    label: str
    color: str


@dataclass(frozen=True)
class Cell:
    kind: int
    owner: str | None = None  # for K_USED and up: the holder the colour comes from
    refcount: int = 0
    group: int = 0  # the KV cache group of its block (USED/CACHED)


def group_cells(snapshot: CacheSnapshot, capacity: int) -> tuple[int, list[Cell]]:
    """Fold the pool into at most ``capacity`` cells; returns (blocks per cell, cells)."""
    n = snapshot.num_blocks
    per_cell = max(1, math.ceil(n / max(1, capacity)))
    state, refcount, owners = snapshot.state, snapshot.refcount, snapshot.owners
    group = snapshot.group or (0,) * n
    guess, returned = set(snapshot.spec_guess_blocks), set(snapshot.spec_returned_blocks)
    cells: list[Cell] = []
    for start in range(0, n, per_cell):
        best_kind, best_block = K_NULL - 1, start
        for b in range(start, min(start + per_cell, n)):
            s = state[b]
            kind = ((K_GUESS if b in guess else K_SHARED if refcount[b] > 1 else K_USED) if s == USED
                    else K_NULL if s == NULL else K_RETURNED if b in returned else K_CACHED if s == CACHED
                    else K_FREE)  # fmt: skip
            if kind > best_kind or (kind == K_SHARED and refcount[b] > refcount[best_block]):
                best_kind, best_block = kind, b
        if best_kind >= K_USED:
            holders = owners[best_block]
            cells.append(Cell(best_kind, holders[0] if holders else None, refcount[best_block], group[best_block]))
        else:
            cells.append(Cell(best_kind, group=max(0, group[best_block])))
    return per_cell, cells


def glyph(glyphs: tuple[str, ...], group: int) -> str:
    """A KV cache group's glyph: the full group's first, windowed ones' after."""
    return glyphs[min(group, len(glyphs) - 1)]


__all__ = ["CACHED_GLYPHS", "GUESS_STYLE", "K_CACHED", "K_FREE", "K_GUESS", "K_NULL", "K_RETURNED", "K_SHARED",
           "K_USED", "PALETTE", "RETURNED_STYLE", "USED_GLYPHS", "Cell", "OwnerStyle", "glyph", "group_cells",
           "owner_color"]
