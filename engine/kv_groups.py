"""KV cache groups: how a model's layers share the paged pool when some attend a sliding window.

Layers of one kind (full attention, or one window size) form a group with a block table of its own per
sequence, over one pool of pages (vLLM's hybrid KV cache manager). A page holds one block of tokens for
`slots` layers: a group's i-th layer lives in slot i of its group's pages. A windowed group frees the
blocks wholly out of its window, so a page serves whichever group needs it next; a model of one kind has
one group and pages holding every layer, the layout of a plain paged cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVLayout:
    windows: tuple[int | None, ...]  # per group: its layers' sliding window, None = full attention (first)
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: its slot in its group's pages
    slots: int  # layers a page holds: the largest group's

    @classmethod
    def of(cls, layer_windows: Sequence[int | None]) -> KVLayout:
        """Groups by window, full attention first, then windows smallest first."""
        windows = tuple(sorted(set(layer_windows), key=lambda w: (w is not None, w or 0)))
        group = tuple(windows.index(w) for w in layer_windows)
        slot = tuple(group[:i].count(g) for i, g in enumerate(group))
        return cls(windows, group, slot, max(group.count(g) for g in range(len(windows))))

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def names(self) -> tuple[str, ...]:
        """How the visualiser labels the groups."""
        return tuple("full" if w is None else f"window {w}" for w in self.windows)


def first_needed_block(position: int, window: int | None, block_size: int) -> int:
    """The first block a query at `position` (and every later one) still sees: keys > position - window."""
    return 0 if window is None else max(0, position - window + 1) // block_size


__all__ = ["KVLayout", "first_needed_block"]
