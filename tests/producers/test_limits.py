"""producers/_limits.py: the per-event limit and free-text cutting (pure, no broker)."""

from __future__ import annotations

import pytest

from producers._limits import DEFAULT_RECORD_LIMIT, MAX_EVENT_BYTES_CAP, TextTrimmer, max_event_bytes_for, truncate_text


@pytest.mark.parametrize(("record_limit", "expected"), [
    (DEFAULT_RECORD_LIMIT, MAX_EVENT_BYTES_CAP),  # 1,048,588 // 4 is just over 256 KiB: the cap
    (200_000, 50_000),
    (100 * 1024 * 1024, MAX_EVENT_BYTES_CAP),
])
def test_max_event_bytes_is_a_quarter_of_the_record_limit_capped(record_limit, expected):
    assert max_event_bytes_for(record_limit) == expected


def test_text_within_its_cap_is_unchanged():
    assert truncate_text("short", 8) == ("short", 0)
    assert truncate_text("x" * 100, 100) == ("x" * 100, 0)


@pytest.mark.parametrize("text", ["a" * 50_000, "é" * 20_000, "日本語" * 9_000, "a" + "🙂" * 5_000])
def test_cut_text_fits_its_cap_marker_included_and_says_what_went(text):
    cap = 1001
    cut_text, removed = truncate_text(text, cap)
    raw, kept = text.encode(), cut_text.encode()
    assert len(kept) <= cap
    head, marker = cut_text.rsplit("…[truncated ", 1)
    assert marker == f"{removed} bytes]"
    assert text.startswith(head) and len(head.encode()) + removed == len(raw)
    assert len(kept) > cap - 8  # a multi-byte character at the edge costs at most 3 bytes of room


def test_trimmer_remembers_each_field_it_cut():
    trim = TextTrimmer(cap_bytes=64)
    out = trim.mapping("alerts[0].annotations", {"summary": "ok", "description": "d" * 500})
    assert out["summary"] == "ok" and len(out["description"].encode()) <= 64
    assert trim("alerts[0].generatorURL", None) is None
    assert trim.cut == {"alerts[0].annotations.description": 500 - len(out["description"].split("…")[0])}
