"""A streaming reply in the app: every piece of text reaches the screen in order, and a paragraph that
grows within its last line is repainted without laying the screen out again (issue 27, point 4)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rosechat.widgets import chat
from rosechat.widgets.reply_markdown import ReplyParagraph
from tests.rosechat.test_app import SIZE, make_app, wait_for


def _paragraphs(view: chat.MessageView) -> list[ReplyParagraph]:
    return list(view.markdown.query(ReplyParagraph))


def _shown(paragraph: ReplyParagraph) -> list[str]:
    """The paragraph's lines as drawn at its width (what the compositor gets)."""
    return [strip.text.rstrip() for strip in paragraph.render_lines(paragraph.size.region)]


async def test_a_paragraph_growing_on_its_line_is_not_laid_out_again(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        view = chat.MessageView("assistant")
        await app.active_tab.log_view.mount(view)
        await view.markdown.append("Once upon")
        await wait_for(pilot, lambda: _paragraphs(view) and _paragraphs(view)[0].size.height == 1, "one line")
        (paragraph,) = _paragraphs(view)
        layouts, height, width = paragraph.layouts, view.size.height, paragraph.size.width

        await view.markdown.append(" a time")  # the same line, longer: a repaint only
        await wait_for(pilot, lambda: _shown(paragraph) == ["Once upon a time"], "the longer line drawn")
        assert paragraph.layouts == layouts and view.size.height == height

        words = " there lived a dragon who could not read" * (2 * width // 40)  # wraps onto more lines
        await view.markdown.append(words)
        await wait_for(pilot, lambda: paragraph.size.height > 1, "the paragraph to grow")
        assert paragraph.layouts == layouts + 1  # it asked for the layout that grew it
        lines = _shown(paragraph)
        assert len(lines) == paragraph.size.height and " ".join(lines).split() == ("Once upon a time" + words).split()
        await wait_for(pilot, lambda: view.size.height == height + paragraph.size.height - 1, "the reply to grow")


@pytest.mark.parametrize("interval", [0.0, 0.05])
async def test_many_deltas_end_as_the_whole_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 interval: float) -> None:
    """Hundreds of pieces (words, newlines, a list, a code block), written as they come (interval 0) or
    batched: the Markdown's source is the text, and its blocks are drawn from all of it."""
    monkeypatch.setattr(chat, "REDRAW_INTERVAL", interval)
    text = ("The dragon sat by the river and opened a book. " * 12 + "\n\nShe learned:\n\n1. letters\n2. words\n\n"
            "```\nread(book)\n```\n\n" + "Then she read every book in the land. " * 10)
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        view = chat.MessageView("assistant")
        await app.active_tab.log_view.mount(view)
        for piece in pieces:
            await view.add_delta(0, piece)
        await wait_for(pilot, lambda: view.markdown.source == text, "every piece written")

        def last_words() -> bool:  # the blocks are built after the source is set (the stream's task)
            *_, last = _paragraphs(view)
            return bool(_shown(last)) and _shown(last)[-1].endswith("in the land.")

        await wait_for(pilot, last_words, "the last words drawn")
        first = _paragraphs(view)[0]
        assert " ".join(_shown(first)).split() == ("The dragon sat by the river and opened a book. " * 12).split()
        assert "read(book)" in str(view.markdown.query_one("MarkdownFence")._content)
        await view.set_texts([text])  # the reply's end: nothing to change
        assert view.markdown.source == view.text == text
