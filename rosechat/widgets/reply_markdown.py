"""A reply's Markdown: Textual's, with line breaks as the model wrote them, and a streaming reply's
last paragraph redrawn in place while its height holds.

A streaming reply grows in its last block, mostly a paragraph. Textual's ``Static.update`` asks for a
layout at every change, and a layout is the whole screen's: every widget arranged again, then every one
that moved repainted (10-15 ms of Python on a small CPU, twice per write since the reply's containers
then change their virtual size), while the in-process engine waits for the GIL. A paragraph that grew by
a few words on its last line keeps its height: it needs only its own lines repainted. It asks for a
layout when it wraps onto a new line (or shrinks), and new blocks are mounted (a layout) as before.
"""

from __future__ import annotations

from markdown_it import MarkdownIt
from markdown_it.rules_core import StateCore
from textual.content import Content
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


class ReplyParagraph(MarkdownParagraph):
    """A paragraph that lays the screen out again only when its height changes."""

    layouts = 0  # how many of its updates asked for a layout (read by tests)

    def set_content(self, content: Content) -> None:
        width, height = self.content_size
        self._content = content
        self.update(content, layout=False)  # a repaint of its own lines
        if not self.is_mounted:  # a new block: mounting it lays the screen out
            return
        # Not laid out yet, or wrapped onto more (or fewer) lines: its size, and the screen's layout, change.
        if not width or self.get_content_height(self.container_size, self.screen.size, width) != height:
            self.layouts += 1
            self.refresh(layout=True)


class ReplyMarkdown(Markdown):
    """A reply's Markdown: its paragraphs are ``ReplyParagraph``; every other block is Textual's."""

    BLOCKS: dict[str, type[MarkdownBlock]] = {**Markdown.BLOCKS, "paragraph_open": ReplyParagraph}

    def __init__(self, markdown: str = "") -> None:
        super().__init__(markdown, parser_factory=markdown_parser)
