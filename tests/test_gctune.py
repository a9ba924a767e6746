"""gpuledger.gctune.bulk: no collections and a short GIL switch interval while stores load
(nested, from several threads), the loaded objects frozen when the last load ends;
gctune.freeze: dead cycles collected, then what is alive frozen (a worker's epoch commit);
gctune.stats: the frozen count read at most once a minute."""

from __future__ import annotations

import gc
import sys
import threading
import weakref

from gpuledger import gctune


def test_bulk_loads_pause_collections_until_the_last_ends_then_freeze_what_they_loaded():
    assert gc.isenabled()
    loaded: list[dict] = []
    inside = threading.Event()
    release = threading.Event()

    def other_load():
        with gctune.bulk():
            inside.set()
            release.wait(10)

    frozen_before = gc.get_freeze_count()
    interval = sys.getswitchinterval()
    try:
        with gctune.bulk():
            assert not gc.isenabled() and sys.getswitchinterval() == gctune.BULK_SWITCH_INTERVAL_S
            loader = threading.Thread(target=other_load)
            loader.start()
            assert inside.wait(10)
            loaded.extend({"key": str(i), "rows": {}} for i in range(1000))
        assert not gc.isenabled() and sys.getswitchinterval() == gctune.BULK_SWITCH_INTERVAL_S  # the other load is still under way
        release.set()
        loader.join(10)
        assert gc.isenabled() and sys.getswitchinterval() == interval
        assert gc.get_freeze_count() >= frozen_before + 1000  # what was loaded is in the permanent generation
    finally:
        gc.unfreeze()
        gc.enable()


def test_a_load_that_loaded_nothing_freezes_nothing():
    frozen_before = gc.get_freeze_count()
    with gctune.bulk(freeze=False):
        assert not gc.isenabled()
    assert gc.isenabled() and gc.get_freeze_count() == frozen_before


def test_freeze_frees_dead_cycles_then_freezes_what_is_alive():
    class Node:
        pass

    frozen_before = gc.get_freeze_count()
    kept = [{"key": str(i), "rows": {}} for i in range(1000)]  # 1,001 tracked containers, alive
    dead = Node()
    dead.me = dead  # a reference cycle: only the collector frees it
    gone = weakref.ref(dead)
    gc.collect(1)  # alive now: moved to the oldest generation, as an automatic collection during an epoch would
    del dead
    try:
        gctune.freeze()
        assert gone() is None  # collected, not frozen for ever
        assert gc.get_freeze_count() >= frozen_before + len(kept) + 1
        assert gc.get_count()[0] < len(kept)  # the young generation no longer holds them
    finally:
        gc.unfreeze()


def test_the_frozen_count_is_read_at_most_once_a_minute(monkeypatch):
    """``stats()`` (every health page) reports the objects in the permanent generation, read by
    ``gc.get_freeze_count()`` — a walk of the whole generation — at most every ``FROZEN_EVERY_S``."""
    calls = []
    real = gc.get_freeze_count
    clock = [1000.0]
    monkeypatch.setattr(gctune, "_frozen", [0, None])
    monkeypatch.setattr(gctune.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(gc, "get_freeze_count", lambda: calls.append(1) or real())
    try:
        kept = [[i] for i in range(5000)]  # lists: always tracked by the collector (a dict of ints is not)
        gctune.freeze()
        first = gctune.stats()["frozen"]
        assert first >= len(kept) and len(calls) == 1
        with gctune.bulk():
            loaded = [[i] for i in range(3000)]
        clock[0] += gctune.FROZEN_EVERY_S - 1
        assert gctune.stats()["frozen"] == first and len(calls) == 1  # read less than a minute ago: not walked again
        clock[0] += 1
        assert gctune.stats()["frozen"] >= first + len(loaded) and len(calls) == 2
    finally:
        gc.unfreeze()
