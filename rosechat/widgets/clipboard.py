"""Copying the last reply, or the last code block in it, through the terminal's clipboard (OSC 52).

The tab says which message is its last reply; these copy it and tell the user what was copied
(or why nothing was): a clipboard write gives no sign of its own.
"""

from __future__ import annotations

import re

from textual.widget import Widget

from rosechat.widgets.chat import ChatMessage

# A fenced block (``` or ~~~, with or without an info string): the fences on lines of their own
_CODE_FENCE = re.compile(r"^[ \t]*(?:```|~~~)[^\n]*\n(.*?)\n?[ \t]*(?:```|~~~)[ \t]*$", re.DOTALL | re.MULTILINE)


def _reply_text(widget: Widget, reply: ChatMessage | None) -> str | None:
    if reply is None or not reply.content.strip():
        widget.notify("No reply to copy yet.", timeout=3)
        return None
    return reply.content


def copy_reply(widget: Widget, reply: ChatMessage | None) -> None:
    """Copy ``reply`` (the alternative shown; None: there is no reply yet)."""
    if (text := _reply_text(widget, reply)) is not None:
        widget.app.copy_to_clipboard(text)
        widget.notify(f"Copied the reply ({len(text):,} characters).", timeout=3)


def copy_code(widget: Widget, reply: ChatMessage | None) -> None:
    """Copy the last fenced code block of ``reply``, without its fences."""
    if (text := _reply_text(widget, reply)) is None:
        return
    if not (blocks := _CODE_FENCE.findall(text)):
        widget.notify("The last reply has no code block (ctrl+y copies all of it).", timeout=3)
        return
    widget.app.copy_to_clipboard(blocks[-1])
    widget.notify(f"Copied the code block ({blocks[-1].count(chr(10)) + 1} lines).", timeout=3)
