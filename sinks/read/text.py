"""Free text from the store made safe to show: the one escape for terminals and HTML.

Input: any value read back from the store (alert names, pod labels, reasons — text that
arrived from outside and was stored as is). Output: the same text with every character
that would change how the *rest* of the output looks replaced by a visible escape:
C0/C1 control characters (NUL, ESC — terminal escape sequences —, CR, …, DEL), line and
paragraph separators, and the Unicode bidi controls (U+202A–U+202E embeddings and
overrides, U+2066–U+2069 isolates, U+200E/U+200F/U+061C marks), which reorder what
follows them ("Trojan Source"). ``\\u202e`` prints as the six characters ``\\u202e``.
Newlines and tabs are kept only where the caller asks for multi-line text.

HTML escaping of ``<``, ``&``, quotes is Jinja2's autoescape (``sinks/read/report.py``);
rich markup (``[red]``) is escaped by ``markup``. Both call ``printable`` first.
"""

from __future__ import annotations

import re
from typing import Any

_BIDI = "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
_UNSAFE = re.compile(f"[\x00-\x1f\x7f-\x9f\u2028\u2029{_BIDI}]")
_UNSAFE_KEEP_LINES = re.compile(f"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029{_BIDI}]")


def _escape(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(value: Any, multiline: bool = False) -> str:
    """``value`` as text with control and bidi characters shown as ``\\xNN``/``\\uNNNN``
    (``None`` is the empty string). ``multiline`` keeps ``\\n`` and ``\\t``."""
    if value is None:
        return ""
    return (_UNSAFE_KEEP_LINES if multiline else _UNSAFE).sub(_escape, str(value))


def markup(value: Any, multiline: bool = False) -> str:
    """``printable`` text for a rich renderable built from markup strings (tree labels,
    table cells): ``[`` is escaped too, so stored text cannot style or break the output."""
    from rich.markup import escape

    return escape(printable(value, multiline))
