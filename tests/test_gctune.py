"""gpuledger.gctune.bulk: no collections and a short GIL switch interval while stores load
(nested, from several threads), the loaded objects frozen when the last load ends;
gctune.freeze: dead cycles collected, then what is alive frozen (a worker's epoch commit)."""

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


def test_the_frozen_count_is_counted_as_objects_are_frozen(monkeypatch):
    """``stats()`` (every health page) reports the objects frozen since start, counted by each
    freeze (an epoch commit's ``freeze``, the end of a ``bulk`` load) rather than by walking the
    permanent generation at every call."""
    before = gctune.stats()["frozen"]
    kept = [[i] for i in range(5000)]
    gctune.freeze()
    after_freeze = gctune.stats()["frozen"]
    assert after_freeze >= before + len(kept)
    with gctune.bulk():
        loaded = [[i] for i in range(3000)]  # lists: always tracked by the collector (a dict of ints is not)
    assert gctune.stats()["frozen"] >= after_freeze + len(loaded)
    assert gctune.stats()["frozen"] == gctune.stats()["frozen"]  # reading it changes nothing

    def walk():
        raise AssertionError("stats() walked the permanent generation")

    monkeypatch.setattr(gc, "get_freeze_count", walk)
    assert gctune.stats()["frozen"] >= after_freeze + len(loaded)
