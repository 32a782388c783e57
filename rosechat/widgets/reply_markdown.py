"""A reply's Markdown: Textual's, with line breaks as the model wrote them, and a streaming reply's
last paragraph redrawn in place while its height holds.

A streaming reply grows in its last block, mostly a paragraph. Textual's ``Static.update`` asks for a
layout at every change, and a layout is the whole screen's: every widget arranged again, then every one
that moved repainted (10-15 ms of Python on a small CPU, twice per write since the reply's containers
then change their virtual size), while the in-process engine waits for the GIL. A paragraph that grew by
a few words on its last line keeps its height: it needs only its own lines repainted. It asks for a
layout when it wraps onto a new line (or shrinks), and new blocks are mounted (a layout) as before.
That layout is the only one: the reply's widgets (``LaidOutOnce``) do not ask for a second.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from markdown_it import MarkdownIt
from markdown_it.rules_core import StateCore
from textual.content import Content
from textual.geometry import Size
from textual.widget import Widget
from textual.widgets import Markdown
from textual.widgets._markdown import MarkdownParagraph
from textual.widgets.markdown import MarkdownBlock

_PARSER: MarkdownIt | None = None


def markdown_parser() -> MarkdownIt:
    """Markdown where a single newline in a reply is a line break, as the model wrote it (a poem,
    an address, a list without Markdown). Code blocks are untouched. Textual asks for a parser at
    every write: one, built once (0.4 ms, and its rules compiled at first parse, 0.5 ms more); a parse
    keeps its state in its own objects, so the Markdown widgets (and Textual's parsing thread) share it."""
    global _PARSER
    if _PARSER is None:
        parser = MarkdownIt("gfm-like")
        parser.core.ruler.push("hard_breaks", _hard_breaks)
        parser.parse("")  # compiles the rule chains now, on one thread
        _PARSER = parser
    return _PARSER


def _hard_breaks(state: StateCore) -> None:
    # markdown-it's "breaks" option changes only its HTML renderer; Textual reads the tokens
    for token in state.tokens:
        for child in token.children or ():
            if child.type == "softbreak":
                child.type = "hardbreak"


# A mixin for widgets; not a widget itself: Textual finds a widget's CSS type names (its DEFAULT_CSS, and
# queries by type) through the first widget class among its bases, which must stay Markdown, Vertical...
_Mixin = Widget if TYPE_CHECKING else object


class LaidOutOnce(_Mixin):
    """A widget that grows (a streaming reply, its Markdown, its paragraphs) without a second layout each time.

    When a layout changes a widget's size, Textual sets its ``virtual_size``, a reactive that asks for
    another layout of the whole screen on the next frame. A widget that does not scroll has nothing
    to do with it: the layout that sized it arranged its children too, so the second one finds every
    widget where the first put it, and costs as much (half of the UI thread's time in layouts while a
    reply streams, by `rosechat bench app`'s profile). Set without the reactive's refresh, it is not asked for.
    """

    def _size_updated(self, size: Size, virtual_size: Size, container_size: Size, layout: bool = True) -> bool:
        return super()._size_updated(size, virtual_size, container_size, layout=False)

    def _lay_out_if_resized(self, width: int, height: int) -> bool:
        """After new content (repainted, not laid out): ask for a layout if it was never laid out or no longer
        takes ``height`` lines at ``width`` (its content size before); True if it asked."""
        if width and self.get_content_height(self.container_size, self.screen.size, width) == height:
            return False
        self.refresh(layout=True)
        return True


class ReplyParagraph(LaidOutOnce, MarkdownParagraph):
    """A paragraph that lays the screen out again only when its height changes."""

    layouts = 0  # how many of its updates asked for a layout (read by tests)

    def set_content(self, content: Content) -> None:
        width, height = self.content_size
        self._content = content
        self.update(content, layout=False)  # a repaint of its own lines
        if not self.is_mounted:  # a new block: mounting it lays the screen out
            return
        # Not laid out yet, or wrapped onto more (or fewer) lines: its size, and the screen's layout, change.
        if self._lay_out_if_resized(width, height):
            self.layouts += 1


class ReplyMarkdown(LaidOutOnce, Markdown):
    """A reply's Markdown: its paragraphs are ``ReplyParagraph``; every other block is Textual's."""

    BLOCKS: dict[str, type[MarkdownBlock]] = {**Markdown.BLOCKS, "paragraph_open": ReplyParagraph}

    def __init__(self, markdown: str = "") -> None:
        super().__init__(markdown, parser_factory=markdown_parser)
