"""The KV panel shows speculation: blocks that held guesses as they were checked ("?") and blocks a rollback gave
back to the pool ("↩"), with their legend entries; from a synthetic snapshot, and end to end in the app with
prompt lookup on (snapshots from the engine thread, drawn by the panel)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from engine.events import CACHED, FREE, USED, CacheSnapshot
from rosechat.bridge import EventBuffer
from rosechat.server_stats import snapshot_from_json
from rosechat.widgets.kv_panel import (
    K_CACHED,
    K_FREE,
    K_GUESS,
    K_RETURNED,
    K_SHARED,
    K_USED,
    BlockMap,
    KVPanel,
    group_cells,
    legend_text,
)
from tests.rosechat.test_app import SIZE, make_app, ready, replied, send, wait_for
from tests.rosechat.test_kv_panel import OWNERS, PanelApp


def spec_snapshot() -> CacheSnapshot:
    """conv-a holds blocks 0-5 (0-1 shared with conv-b), its guesses were checked in 4-5 and a rollback gave 6 back;
    block 7 is cached, the rest free."""
    n = 24
    state = [USED] * 6 + [FREE, CACHED] + [FREE] * (n - 8)
    refcount = [2, 2, 1, 1, 1, 1] + [0] * (n - 6)
    owners = [("conv-a", "conv-b")] * 2 + [("conv-a",)] * 4 + [()] * (n - 6)
    return CacheSnapshot(n, 16, tuple(state), tuple(refcount), tuple(owners), spec_drafts=3, spec_draft_tokens=12,
                         spec_accepted_tokens=5, spec_guess_blocks=(4, 5), spec_returned_blocks=(6,),
                         spec_recent_guesses=4, spec_recent_rejected=3)


def test_guess_and_returned_blocks_are_cells_of_their_own() -> None:
    snap = spec_snapshot()
    _, cells = group_cells(snap, capacity=100)
    assert [c.kind for c in cells[:9]] == [K_SHARED, K_SHARED, K_USED, K_USED, K_GUESS, K_GUESS, K_RETURNED,
                                           K_CACHED, K_FREE]
    assert cells[4].owner == "conv-a"  # still its holder's
    assert snap.used_blocks + snap.cached_blocks + snap.free_blocks == snap.num_blocks  # marks are not states
    # folded, two blocks a cell: a returned block outranks a cached one beside it; a guess block its holder's
    _, folded = group_cells(snap, capacity=12)
    assert [c.kind for c in folded[:5]] == [K_SHARED, K_USED, K_GUESS, K_RETURNED, K_FREE]
    _, folded = group_cells(snap, capacity=6)  # four a cell: the guesses outrank the rollback beside them
    assert [c.kind for c in folded[:3]] == [K_SHARED, K_GUESS, K_FREE]
    legend = legend_text(snap, OWNERS).plain
    assert "? guesses" in legend and "↩ rolled back" in legend
    plain = dataclasses.replace(snap, spec_drafts=0, spec_draft_tokens=0, spec_accepted_tokens=0,
                                spec_guess_blocks=(), spec_returned_blocks=())
    assert "guesses" not in legend_text(plain, OWNERS).plain  # no speculation: no entries


def test_a_snapshot_nobody_drew_leaves_its_marks_to_the_next() -> None:
    """The bridge keeps the newest snapshot of a burst: the marks of those it drops come with it, as blocks are
    now (returned block 6 taken again since is not returned; guess block 5 given back since is)."""
    earlier = spec_snapshot()
    state = list(earlier.state)
    state[5], state[6] = FREE, USED
    later = dataclasses.replace(earlier, state=tuple(state), spec_guess_blocks=(3,), spec_returned_blocks=(5,),
                                spec_recent_guesses=2, spec_recent_rejected=1)
    both = later.after(earlier)
    assert (both.spec_guess_blocks, both.spec_returned_blocks) == ((3, 4), (5,))
    assert (both.spec_recent_guesses, both.spec_recent_rejected) == (6, 4)
    quiet = dataclasses.replace(earlier, spec_guess_blocks=(), spec_returned_blocks=(), spec_recent_guesses=0)
    assert later.after(quiet) is later
    buf = EventBuffer()
    buf.push(earlier)
    buf.push(later)
    assert buf.drain().snapshot == both


def test_the_marks_cross_the_kv_json() -> None:
    snap = spec_snapshot()
    back = snapshot_from_json(json.loads(json.dumps(dataclasses.asdict(snap))))
    assert (back.spec_guess_blocks, back.spec_returned_blocks) == ((4, 5), (6,))
    assert (back.spec_recent_guesses, back.spec_recent_rejected) == (4, 3)


async def test_panel_draws_the_guess_and_returned_glyphs() -> None:
    app = PanelApp(spec_snapshot())
    async with app.run_test(size=(100, 16)) as pilot:
        await pilot.pause()
        row = app.query_one(BlockMap).render_line(0).text
        assert row.startswith("2 2 █ █ ? ? ↩ ▒ · "), row
        legend = str(app.query_one("#kv-legend").render())
        assert "? guesses" in legend and "↩ rolled back" in legend


async def test_the_app_shows_speculation_in_the_panel(tmp_path: Path) -> None:
    """Prompt lookup on, with a proposer that always guesses, partly wrong: the engine thread's snapshots carry
    guess and returned blocks, and the panel draws them."""
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4})
    app = make_app(tmp_path, in_process=True,  # its proposer replaced below
                   **{"model.speculative_config": spec, "cache.block_size": 4, "cache.num_blocks": 256,
                      "sampling.max_tokens": 40, "sampling.temperature": 0.0, "ui.show_kv_panel": True})
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        # the greedy demo model repeats itself: a guess of its last token stands, the ones after it (another) do not
        app.llm.scheduler.proposer.propose = lambda ids, k, index=None: ([int(ids[-1])] + [int(ids[-1]) + 1] * k)[:k]
        app.llm.scheduler.proposer.kind = lambda seq: 0  # guesses at every step, of one kind
        panel = app.query_one(KVPanel)
        shown: list[CacheSnapshot] = []
        show = panel.show
        panel.show = lambda snapshot, owners=None: (shown.append(snapshot), show(snapshot, owners))[1]
        tab = await send(pilot, "guess along with me")
        await wait_for(pilot, lambda: replied(tab), "the reply")
        guessed = [s for s in shown if s.spec_guess_blocks]
        returned = [s for s in shown if s.spec_returned_blocks]
        assert guessed and returned, "the snapshots marked guess and returned blocks"
        both = [s for s in guessed if s.spec_returned_blocks]
        for snap in both[:1] or [guessed[-1], returned[-1]]:  # drawn: one that marks both, else one of each
            show(snap)
            await drawn(pilot, panel.query_one(BlockMap), snap)
        legend = str(panel.query_one("#kv-legend").render())
        assert "? guesses" in legend and "↩ rolled back" in legend and tab.chat_title in legend


async def drawn(pilot, block_map: BlockMap, snap: CacheSnapshot) -> None:
    """Wait for the map to draw snap, its guess blocks as "?" and its returned ones as "↩"."""
    kinds = {K_GUESS: snap.spec_guess_blocks, K_RETURNED: snap.spec_returned_blocks}
    await wait_for(pilot, lambda: block_map.snapshot is snap and len(block_map.cells) == snap.num_blocks
                   and all(block_map.cells[b].kind == kind for kind, blocks in kinds.items() for b in blocks),
                   "the marked blocks drawn")
    text = "".join(block_map.render_line(y).text for y in range(block_map.size.height))
    assert ("?" in text) == bool(snap.spec_guess_blocks) and ("↩" in text) == bool(snap.spec_returned_blocks)
