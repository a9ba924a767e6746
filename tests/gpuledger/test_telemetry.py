"""gpuledger/telemetry.py: the repeated-line filter of every process's logging."""

from __future__ import annotations

import logging
import time

from gpuledger.telemetry import RepeatFilter


def test_a_repeated_lines_count_says_when_the_held_lines_were():
    """From an exploratory review: the count rode on the next line that passed, minutes after an
    outage, and said "in the last 60s" — read afterwards, the broker failed twice more."""
    mono, wall = [0.0], [time.mktime((2026, 12, 6, 14, 16, 38, 0, 0, -1))]
    flt = RepeatFilter(every_s=60.0, clock=lambda: mono[0], wall=lambda: wall[0])
    logger = logging.getLogger("test.repeat")

    def line() -> logging.LogRecord:
        return logger.makeRecord(logger.name, logging.ERROR, __file__, 1, "Connect to %s failed", ("127.0.0.1:9092",), None)

    first = line()
    assert flt.filter(first) and first.getMessage() == "Connect to 127.0.0.1:9092 failed"
    for _ in range(628):  # the outage: 14:16:39 .. 14:17:09, held
        mono[0] += 30 / 628
        wall[0] += 30 / 628
        assert not flt.filter(line())
    mono[0] += 150  # the next one, two and a half minutes later, passes with the count
    wall[0] += 150
    late = line()
    assert flt.filter(late)
    assert late.getMessage() == "Connect to 127.0.0.1:9092 failed [repeated 628 more time(s) between 14:16:38 and 14:17:08]", late.getMessage()
    again = line()
    mono[0] += 61
    assert flt.filter(again) and again.getMessage() == "Connect to 127.0.0.1:9092 failed"  # nothing held since
    info = logger.makeRecord(logger.name, logging.INFO, __file__, 1, "fine", (), None)
    assert all(flt.filter(info) for _ in range(3))  # below WARNING: never held
