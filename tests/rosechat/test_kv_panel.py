"""KV panel: cell folding, numbers, and an SVG snapshot of a fixed synthetic cache."""

from __future__ import annotations

from textual.app import App, ComposeResult

from engine.events import CACHED, FREE, NULL, USED, CacheSnapshot
from rosechat.widgets.kv_panel import (
    K_CACHED,
    K_FREE,
    K_NULL,
    K_SHARED,
    K_USED,
    KVPanel,
    OwnerStyle,
    group_cells,
    legend_text,
    stats_text,
)


def synthetic_snapshot(num_blocks: int = 160) -> CacheSnapshot:
    """Three tabs: A and its fork B share a 6-block prefix (one CoW'd block), C is separate;
    some free blocks still hold prefix-cache hashes."""
    state = [FREE] * num_blocks
    refcount = [0] * num_blocks
    owners: list[tuple[str, ...]] = [()] * num_blocks

    def hold(blocks, *holders):
        for b in blocks:
            state[b] = USED
            refcount[b] = len(holders)
            owners[b] = tuple(sorted(holders))

    hold(range(0, 6), "conv-a", "conv-b")  # shared prefix (fork)
    hold(range(6, 14), "conv-a")
    hold(range(14, 20), "conv-b")  # B's own turns after the fork
    hold(range(20, 23), "conv-a", "conv-b", "conv-c")  # a system prompt all three share
    hold(range(23, 40), "conv-c")
    for b in range(40, 52):
        state[b] = CACHED
    for b in range(60, 64):
        state[b] = CACHED
    return CacheSnapshot(
        num_blocks=num_blocks, block_size=16, state=tuple(state), refcount=tuple(refcount),
        owners=tuple(owners), num_running=2, num_waiting=1, prefix_cache_queries=900,
        prefix_cache_hits=600, cow_copies=3, preemptions=1, tokens_per_s=123.4, time=1.0,
    )


OWNERS = {
    "conv-a": OwnerStyle("1 Chat about blocks", "#e5677f"),
    "conv-b": OwnerStyle("2 Fork of chat", "#5fb3f6"),
    "conv-c": OwnerStyle("3 Another chat", "#98c379"),
}


class PanelApp(App):
    def __init__(self, snapshot: CacheSnapshot) -> None:
        super().__init__()
        self.snapshot = snapshot

    def compose(self) -> ComposeResult:
        yield KVPanel()

    def on_mount(self) -> None:
        self.query_one(KVPanel).show(self.snapshot, OWNERS)


def test_group_cells_one_block_per_cell() -> None:
    snap = synthetic_snapshot()
    per_cell, cells = group_cells(snap, capacity=1000)
    assert per_cell == 1 and len(cells) == snap.num_blocks
    assert cells[0].kind == K_SHARED and cells[0].refcount == 2 and cells[0].owner == "conv-a"
    assert cells[21].kind == K_SHARED and cells[21].refcount == 3
    assert cells[14].kind == K_USED and cells[14].owner == "conv-b"
    assert cells[45].kind == K_CACHED and cells[100].kind == K_FREE
    assert sum(c.kind == K_SHARED for c in cells) == snap.shared_blocks == 9


def test_group_cells_folds_and_keeps_the_most_interesting_state() -> None:
    snap = synthetic_snapshot(num_blocks=4000)
    per_cell, cells = group_cells(snap, capacity=500)
    assert per_cell == 8 and len(cells) == 500
    assert cells[0].kind == K_SHARED  # blocks 0-7: shared beats private
    assert cells[2].kind == K_SHARED and cells[2].refcount == 3  # blocks 16-23: highest refcount wins
    assert cells[3].kind == K_USED and cells[3].owner == "conv-c"
    assert cells[5].kind == K_CACHED  # blocks 40-47: cached, free
    assert cells[7].kind == K_CACHED  # 56-63: 60-63 cached, the rest free
    assert cells[8].kind == K_FREE


def test_stats_text_numbers() -> None:
    snap = synthetic_snapshot()
    text = stats_text(snap, blocks_per_cell=1).plain
    assert f"{snap.used_blocks} / 160" in text  # 40 used
    assert "shared      9 blocks" in text
    # without sharing: 6*2 + 8 + 6 + 3*3 + 17 = 52 blocks; 40 used -> 12 saved
    assert "saved       12 blocks by sharing" in text
    assert "66.7% (600/900 tok)" in text
    assert "CoW copies  3" in text and "preemptions 1" in text
    assert "2 running, 1 waiting" in text and "123.4" in text


async def test_panel_map_reflects_the_snapshot() -> None:
    app = PanelApp(synthetic_snapshot())
    async with app.run_test(size=(100, 16)) as pilot:
        await pilot.pause()
        panel = app.query_one(KVPanel)
        block_map = panel.query_one("#kv-map")
        assert block_map.blocks_per_cell == 1
        assert len(block_map.cells) == 160
        legend = str(panel.query_one("#kv-legend").render())
        for style in OWNERS.values():
            assert style.label in legend


def test_snapshot_panel(snap_compare) -> None:
    assert snap_compare(PanelApp(synthetic_snapshot()), terminal_size=(100, 16))


def test_snapshot_panel_folded(snap_compare) -> None:
    # A pool much larger than the panel: several blocks per cell, said in the numbers.
    assert snap_compare(PanelApp(synthetic_snapshot(num_blocks=3000)), terminal_size=(100, 16))


def test_stats_text_says_how_many_guesses_stand() -> None:
    snap = CacheSnapshot(4, 16, (0,) * 4, (0,) * 4, ((),) * 4, spec_drafts=10, spec_draft_tokens=40,
                         spec_accepted_tokens=25)
    assert "guesses     62% kept (3.5 tok/check)" in stats_text(snap).plain
    assert "guesses" not in stats_text(CacheSnapshot(4, 16, (0,) * 4, (0,) * 4, ((),) * 4)).plain


def windowed_snapshot() -> CacheSnapshot:
    """A sliding-window model's pool: the null block, one chat's full group (blocks 1-10) and its windowed
    group's blocks in the window (11-13), blocks the window left cached (14-15), the rest free."""
    n = 24
    state = [NULL] + [USED] * 13 + [CACHED] * 2 + [FREE] * 8
    group = [-1] + [0] * 10 + [1] * 5 + [-1] * 8
    owners = [()] + [("conv-a",)] * 13 + [()] * 10
    refcount = [0] + [1] * 13 + [0] * 10
    return CacheSnapshot(num_blocks=n, block_size=16, state=tuple(state), refcount=tuple(refcount),
                         owners=tuple(owners), group=tuple(group), group_names=("full", "window 512"))


def test_windowed_groups_have_their_own_glyphs_counts_and_legend() -> None:
    snap = windowed_snapshot()
    _, cells = group_cells(snap, capacity=100)
    assert cells[0].kind == K_NULL and cells[5].group == 0 and cells[12].group == 1
    assert cells[14].kind == K_CACHED and cells[14].group == 1
    assert snap.group_blocks() == [10, 3] and snap.free_blocks == 8 and snap.used_blocks == 13
    assert "groups      █ full 10 · ▓ window 512: 3" in stats_text(snap).plain
    assert "groups" not in stats_text(synthetic_snapshot()).plain  # one group: nothing to tell apart
    legend = legend_text(snap, OWNERS).plain
    assert "█ full" in legend and "▓ window 512" in legend and "× null" in legend
    assert "window" not in legend_text(synthetic_snapshot(), OWNERS).plain


async def test_panel_draws_the_window_and_its_null_block() -> None:
    app = PanelApp(windowed_snapshot())
    async with app.run_test(size=(100, 16)) as pilot:
        await pilot.pause()
        row = app.query_one("#kv-map").render_line(0).text
        assert row.startswith("× █ █") and "▓ ▓ ▓ ░ ░ · " in row
