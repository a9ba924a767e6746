"""The read side's HTML pages: one Jinja2 environment, one layout, one stylesheet.

Input: a page template under ``templates/`` (``incident.html.j2`` — the incident
timeline, ``audit.html.j2`` — the controls' evidence) and the values it shows.
Output: one self-contained HTML document: ``base.html.j2`` inlines ``report.css`` (and
the page's script, if it has one) and sets a Content-Security-Policy that forbids every
fetch, so a report opens anywhere — a laptop, an attachment to a postmortem — as is.
Guarantees: autoescape is on for every template, and every ``{{ value }}`` goes through
``sinks.read.text.printable`` first (``finalize``), so stored text can neither add markup
nor reorder the page with bidi or control characters. ``inline()`` is the only way raw
text reaches the page, and it only reads files that sit beside the templates.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, StrictUndefined
from markupsafe import Markup

from sinks.read.text import printable

TEMPLATES = Path(__file__).with_name("templates")


def _finalize(value: Any) -> Any:
    # Markup is already safe HTML (inline assets, nested renders); everything else is text.
    return value if isinstance(value, Markup) else printable(value, multiline=True)


def _inline(name: str) -> Markup:
    """A stylesheet or script from templates/, inlined verbatim (not a template: CSS
    braces would otherwise need escaping)."""
    return Markup((TEMPLATES / Path(name).name).read_text())


@lru_cache(maxsize=1)
def environment() -> Environment:
    env = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=True, finalize=_finalize, undefined=StrictUndefined,
                      trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    env.globals["inline"] = _inline
    return env


def render_page(template: str, **context: Any) -> str:
    """``template`` rendered with ``context`` (see the module docstring)."""
    return environment().get_template(template).render(**context)
