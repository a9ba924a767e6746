"""Garbage-collector settings for gpuledger's long-running processes (worker, sink).

CPython's default thresholds (700, 10, 10) run a young collection every 700 net
container allocations and a full one after every 100 young ones. A worker keeps its
entity and control stores in memory — hundreds of thousands of JSON-shaped dicts — and
allocates a few hundred objects per event, so it ran thousands of collections per
minute, and every full collection traversed the whole store: measured on the bench
mix (``benchmarks/bench.py``), 5.5 s of a 25 s run, for almost nothing reclaimed
(decoded JSON holds no reference cycles).

``tune()`` raises the young threshold to ``GEN0`` (``GEN0_STATEFUL`` in the worker and its
controls stage, which freeze what each epoch leaves alive): collections become ~70× rarer, and
full ones rarer still, while every cycle is still collected (Faust's and asyncio's
cyclic garbage — futures, tracebacks — dies young and goes in the young collections).
``freeze()`` (the receiver, once it listens) moves every object alive at that point — the
modules, settings and app of a started service — into the permanent generation
(``gc.freeze``), so no collection traverses them again: the receiver allocates a few
hundred short-lived objects per request, and its full collections walked the whole
start-up heap (py-spy: a sixth of its CPU at load, before this and ``tune()``).
``bulk()`` (a worker recovering its stores from their changelogs) pauses collections
while decoded state piles up — tens of thousands of entity states, each a tree of dicts
that only grows the heap every full collection walks (py-spy: a third of a restart's
decoding) — and freezes what it loaded when the last bulk load ends: state that lives
until it is replaced, and then goes by reference counting (it holds no cycles). It also
shortens the GIL switch interval while a load runs in its thread: with the default 5 ms,
the event loop — which gives the GIL up at every poll and socket call — waited up to 5 ms
to get it back each time (the convoy effect), and a restart's first batch, ready to run,
waited for the other store's whole load.
``freeze()`` again in a worker, after each epoch commit (``streams.app.WorkerContext.commit_state``):
it collects, then freezes what is still alive: the states of the batches just committed,
the bulk of what a worker allocates that lives on, never again traversed. Young and middle
collections otherwise walked them, and every reference out of them into the older store —
measured (benchmarks/engine_cpu.py, 100,000 events) 15–25 % of the engine's CPU, most of it
not in the collections' own time but in the cache misses they left behind; ``make bench``'s
worker 0.158 → 0.144 ms/event, its collections 1.2 → 0.6 s. The collection walks what the
epoch left alive once — the two stateful processes' higher young threshold
(``GEN0_STATEFUL``) spares them a second walk by the epoch's young collections. The price:
a reference cycle that was alive at a commit and dies later is never collected. The worker
makes few (``make bench``: tens of unreachable objects per commit, most of them — a
tenacity retry loop per batch — gone since ``sinks.retry.call_retrying``; the health page
shows ``collected``). A cycle that outlives a commit is not visible there — it would show
only as memory growing beyond what the store's keys explain.
``stats()`` is what the health pages show: collections per generation, the CPU seconds the
collecting thread spent in them and the unreachable objects they freed since the process
started, and the objects frozen (read at most once a minute).
"""

from __future__ import annotations

import gc
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

GEN0, GEN1, GEN2 = 50_000, 20, 50
#: The young threshold of a process that freezes after every epoch commit (the worker, its
#: controls stage): what an epoch leaves alive — a bulk epoch of the bench ~100,000 tracked
#: objects, its states — and what a batch holds while it runs (every decoded message of a
#: 10,000-event batch: ~10 tracked objects each) are then walked once, by the freeze's
#: collection, rather than by young collections first: with ``GEN0`` those were ~30 in a
#: 50,000-event bench run, ~1.3 s of the worker's CPU. Measured (benchmarks/engine_cpu.py,
#: 50,000 events): 50,000 → 200,000 → 1,000,000 took the engine from 0.131 to 0.122 to
#: 0.106 ms/event with epochs of 7 batches of 1,000 (collections 1.4 → 1.0 → 0.64 s), and
#: from 0.123 to 0.111 ms/event at 200,000 vs 1,000,000 with one commit per 10,000-event
#: batch (collections 1.6 → 1.05 s). A young collection that does run — a bulk batch of
#: tens of thousands of events, an epoch whose commit waits long — walks up to this many
#: objects at once (~0.5 s); a live epoch (~10,000 events a commit) stays well below it.
GEN0_STATEFUL = 1_000_000

_stats = {"collections": [0, 0, 0], "seconds": 0.0, "collected": 0}
_started: list[float] = [0.0]


def _measure(phase: str, info: dict) -> None:
    # The collecting thread's CPU time, not the wall clock: on a busy machine a collection
    # is descheduled as often as anything else, and wall time counted that as collecting.
    if phase == "start":
        _started[0] = time.thread_time()
    else:
        _stats["collections"][info["generation"]] += 1
        _stats["seconds"] += time.thread_time() - _started[0]
        _stats["collected"] += info.get("collected", 0)


def tune(young: int = GEN0) -> None:
    """Apply the thresholds (``young``: ``GEN0_STATEFUL`` in a process that freezes after every
    epoch commit) and start counting collections (idempotent)."""
    gc.set_threshold(young, GEN1, GEN2)
    if _measure not in gc.callbacks:
        gc.callbacks.append(_measure)


def freeze() -> None:
    """Exempt everything alive now from future collections: once a service has started, and in
    a worker after each epoch commit (see the module docstring). Collected first, so that a
    dead reference cycle is freed rather than frozen for ever; ``gc.freeze`` itself is O(1)
    (it moves the generations' lists into the permanent one).

    The collection walks what is alive since the last freeze — in a worker, the states its
    epoch wrote — once: with ``GEN0_STATEFUL`` no young collection walked it before. It must
    look every time: a worker makes cyclic garbage at unpredictable moments (every closed
    HTTP connection of a health probe leaves its transport in a reference cycle), and one
    frozen is never freed. Tried and dropped (2026-12): collecting only when a collection
    since the last freeze had found cycles — under ``make bench``'s health polling every
    freeze looked anyway, and with sparse probes each probe's transport would have been
    frozen for ever."""
    gc.collect()
    gc.freeze()


#: The objects in the permanent generation (``stats``), as ``gc.get_freeze_count()`` last
#: said it, and when (``time.monotonic()``). That call walks the whole permanent generation
#: (measured: 34 ms for 2 M objects, holding the GIL), and a worker's health page — polled by
#: probes, and by ``make bench`` many times a second — called it every time (4 % of a bulk
#: worker's CPU in py-spy); counting what each freeze moved instead (``gc.get_objects`` of
#: every generation) cost ~10 ms per epoch of the bench, a tenth of the freeze's collection.
#: So the count is read at most every ``FROZEN_EVERY_S``.
FROZEN_EVERY_S = 60.0
_frozen: list = [0, None]


def _frozen_count() -> int:
    now = time.monotonic()
    if _frozen[1] is None or now - _frozen[1] >= FROZEN_EVERY_S:
        _frozen[:] = [gc.get_freeze_count(), now]
    return _frozen[0]


_bulk = {"depth": 0}
_bulk_lock = threading.Lock()


#: The GIL switch interval while a bulk load runs (``bulk``).
BULK_SWITCH_INTERVAL_S = 0.0005


@contextmanager
def bulk(freeze: bool = True) -> Iterator[None]:
    """No collections and a short GIL switch interval while loading (in any thread; nested
    and concurrent loads count); when the last load ends, both are restored and — if any of
    the loads asked for it (``freeze``: it loaded something) — the objects alive then are frozen."""
    with _bulk_lock:
        _bulk["depth"] += 1
        if _bulk["depth"] == 1:
            _bulk["enabled"] = gc.isenabled()
            gc.disable()
            _bulk["interval"] = sys.getswitchinterval()
            sys.setswitchinterval(BULK_SWITCH_INTERVAL_S)
        _bulk["freeze"] = _bulk.get("freeze", False) or freeze
    try:
        yield
    finally:
        with _bulk_lock:
            _bulk["depth"] -= 1
            if _bulk["depth"] == 0:
                sys.setswitchinterval(_bulk.pop("interval"))
                if _bulk.pop("freeze", False):
                    gc.freeze()
                if _bulk.pop("enabled", True):
                    gc.enable()


def stats() -> dict:
    return {"thresholds": list(gc.get_threshold()), "frozen": _frozen_count(), "collections": list(_stats["collections"]),
            "seconds": round(_stats["seconds"], 3), "collected": _stats["collected"]}
