"""alt+1…alt+9 from the terminals that send them as ESC followed by the digit.

tmux, screen, xterm, GNOME Terminal, Konsole, Windows Terminal (and WezTerm) send alt+2 as the two
bytes ``ESC 2``. Textual 8.2 turns that into the character macOS types for Option+2: its sequence
table (``ANSI_SEQUENCES_KEYS`` in ``textual/_ansi_sequences.py``) maps ``"\\x1b1"`` … ``"\\x1b0"`` to
"¡™£¢∞§¶•ªº" (entries added for WezTerm on macOS), and ``XTermParser._sequence_to_key_events``
(``textual/_xterm_parser.py``) looks a complete sequence up in that table *before* its own rule that
ESC + character is alt + character (the one that makes ``ESC a`` alt+a). So ESC 2 reaches the app
as key ``trade_mark_sign`` with the printable character "™": no ``alt+2`` binding fires and the
focused text box types "™".

``use_alt_digits()`` points those nine entries of the table at keys named ``alt+1`` … ``alt+9``. The
parser reports an entry's keys by their ``.value`` with no character (a two-byte sequence), so the
app gets ``alt+2`` at once (no wait for the escape delay) and a text box has nothing to insert even
where no binding takes the key (a dialog). ESC 0, ESC - and the like keep Textual's mapping: no key
of ours uses them.

The trade-off: WezTerm on macOS is the one terminal that sends ESC + digit for Option+digit, so
there Option+1…9 switch tabs instead of typing ¡™£¢∞§¶•ª. Every other macOS terminal sends the
character itself (UTF-8), which does not pass through these entries and still types it. Mapping
the *characters* back to alt+digit instead would have taken keys people type on purpose: £ is
shift+3 on a UK keyboard, ¡ º ª have keys on a Spanish one, § on a German one.

The table is Textual's, shared by every app in the process; changing these nine entries is all
this does, and doing it twice changes nothing. tests/rosechat/test_keys.py feeds the bytes through
Textual's own parser, so a Textual release that moves the table fails there, not at a user's.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from enum import Enum
from typing import Any

from textual import _ansi_sequences

DIGITS = "123456789"


class AltDigit(str, Enum):
    """A key the sequence table can name (the parser reads ``.value``, as of Textual's ``Keys``)."""

    ALT_1 = "alt+1"
    ALT_2 = "alt+2"
    ALT_3 = "alt+3"
    ALT_4 = "alt+4"
    ALT_5 = "alt+5"
    ALT_6 = "alt+6"
    ALT_7 = "alt+7"
    ALT_8 = "alt+8"
    ALT_9 = "alt+9"


# ESC + digit, as the terminal sends it -> the key the app binds
ALT_DIGIT_SEQUENCES: dict[str, AltDigit] = {f"\x1b{d}": AltDigit(f"alt+{d}") for d in DIGITS}


def use_alt_digits(table: MutableMapping[str, Any] | None = None) -> None:
    """Make ESC 1 … ESC 9 the keys alt+1 … alt+9 in Textual's input parser (``table``: its sequence
    table, by default the one the parser reads)."""
    if table is None:
        table = _ansi_sequences.ANSI_SEQUENCES_KEYS  # a dict (typed Mapping), read at every lookup
    for sequence, key in ALT_DIGIT_SEQUENCES.items():
        table[sequence] = (key,)
