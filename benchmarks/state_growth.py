"""How an entity's state and its cost per event grow with a long history, for developing the engine's
bounds: not a test (it reports what it measures).

    PYTHONPATH=. .venv/bin/python benchmarks/state_growth.py [shape ...]   # default: every shape

Shapes (each run through the tests' ``Driver`` — the worker's functions — and, for the controls, the
``ControlEngine``, with ``VERIFY_UNCHANGED`` off as in a worker):

- ``workload``: a serving Deployment's churning pods (each scheduled, a GPU held and released, deleted),
  all of one workload and release. Prints the correlation entity's *head* bytes (what ``streams.store``
  writes whole at every touch: the state less its chunked ``rows``/``links``) and the controls stage's
  workload key (one changelog record, not chunked), per pod, and the pods at which each would reach a
  1 MB record (the broker's default ``max.message.bytes``; a state that does not fit is dead-lettered
  and the key recovers without it).
- ``statefulset``: one pod name created again and again (a StatefulSet's or LeaderWorkerSet's pod at each
  rollout, eviction, node loss), each incarnation holding a GPU. Prints the pod's rows and ms per event.
- ``alerts``: one long-lived pod collecting alerts (50 flapping fingerprints). Prints rows and ms per event.

Measured at 59d9852 (this machine): ``workload``: the correlation head grew ~46 bytes a pod before
``_forget_forwards`` (1 MB at ~21,000 pods); since, 19–33 bytes a pod up to ``MAX_GONE_LINKS`` pods let go
(``gone_links``: 1,024 by name, ~16 KB), then no more. The controls' workload key: ~925 bytes a pod,
**1 MB at ~1,080 pods** — its ``links`` hold every pod's scheduler rows, with no bound (an Indexed Job of
1,024 completions is near it); since ``control_chunks`` its links and violations are written in chunks and
its head stays small (the whole key still grows, in memory and in each evaluation's walk). ``statefulset``: rows grow ~2–4 per incarnation (each incarnation's facts
carriers, run start and deletion are kept: ``_needed``), past ``MAX_ROWS``; 5 ms per event at 100
incarnations, 21 at 200, 52 at 400 (180 at 800) — and **every row of the pod goes out again at each new
incarnation** (``Incarnations.const``, in every row's version, counts every incarnation's runs): 50 correlated
rows out per input event at 100 incarnations, 150 at 200, 270 at 400. ``alerts``: every event re-derives every row of the pod
(``_refresh_all``): 1.5 ms per event at 500 rows, 4 at 1,000, 6 at the row bound (20 with the tests'
``VERIFY_UNCHANGED``). The last two are not bounded yet: see docs/operations.md.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import streams.correlate.entities as entities  # noqa: E402
from streams.controls.policy import Policy  # noqa: E402
from streams.controls.rules import ControlEngine  # noqa: E402
from tests.streams.harness import Driver, alert, gpu_event, pod_event, release  # noqa: E402  (sets VERIFY_UNCHANGED)

entities.VERIFY_UNCHANGED = False  # (as a worker: the tests' check renders every output)
LIMIT = 1_000_000
CHUNKED = ("rows", "links", "sent")  # (``streams.correlate.agents.entity_chunks``: written apart once big)
CONTROL_CHUNKED = ("links", "emitted")  # (``streams.controls.agents.control_chunks``)


def _bytes(value) -> int:
    return len(orjson.dumps(value))


def _head(state: dict) -> int:
    return _bytes({k: v for k, v in state.items() if k not in CHUNKED})


def workload(sizes=(250, 500, 1000)) -> None:
    print("workload: pods | correlation head bytes (wl) | controls key bytes (wl), whole and its head | per pod: head, controls")
    for n in sizes:
        events = [release("release.registered", 0, rid="r1"), release("release.approved", 0.1, rid="r1"),
                  pod_event("scheduler.admitted", 0.5, pod=None, workload="ml/Deployment/srv", release_id="r1")]
        for i in range(n):
            m = 1 + i * 0.01
            events += [pod_event("scheduler.scheduled", m, pod=f"srv-{i}", workload="ml/Deployment/srv", release_id="r1"),
                       gpu_event("gpu.assigned", m + 0.001, pod=f"srv-{i}", device=f"GPU-{i % 8}"),
                       gpu_event("gpu.released", m + 0.005, pod=f"srv-{i}", device=f"GPU-{i % 8}"),
                       pod_event("scheduler.deleted", m + 0.006, pod=f"srv-{i}", workload="ml/Deployment/srv", release_id="r1")]
        d = Driver().feed(events).flush_parked()
        head = _head(d.entities["wl:ml/Deployment/srv"])
        engine = ControlEngine(d.directory, Policy())
        engine.feed(d.rows.values(), d.allocations.values()).run()
        key = engine.states["wl:ml/Deployment/srv"]
        ctl = _bytes(key)
        ctl_head = _bytes({k: v for k, v in key.items() if k not in CONTROL_CHUNKED})
        print(f"  {n:6,} | {head:9,} | {ctl:9,} {ctl_head:7,} | {head / n:6.1f}, {ctl / n:6.1f} "
              f"(whole, 1 MB at ~{LIMIT * n // max(head, 1):,} and ~{LIMIT * n // max(ctl, 1):,} pods)")


def statefulset(sizes=(100, 200, 400)) -> None:
    print("statefulset: incarnations | pod rows | ms/event, correlated rows out per event, over the last 100 incarnations")
    for n in sizes:
        d = _counting(Driver()).feed([release("release.registered", 0, rid="r1")])
        t, out = 0.0, 0
        for i in range(n):
            m = 1 + i * 0.01
            batch = [pod_event("scheduler.scheduled", m, pod="w-0", workload="ml/StatefulSet/w", release_id="r1", pod_uid=f"u{i}"),
                     gpu_event("gpu.assigned", m + 0.001, pod="w-0", device=f"GPU-{i % 8}"),
                     gpu_event("gpu.released", m + 0.002, pod="w-0", device=f"GPU-{i % 8}"),
                     pod_event("scheduler.deleted", m + 0.003, pod="w-0", workload="ml/StatefulSet/w", pod_uid=f"u{i}")]
            if i == n - 100:
                t, out = time.perf_counter(), _count_outputs(d)
            d.feed(batch)
        ms = (time.perf_counter() - t) / 400 * 1000
        print(f"  {n:6,} | {len(d.entities['pod:ml/w-0']['rows']):6,} | {ms:7.1f}, {(_count_outputs(d) - out) / 400:7.1f}")


def _count_outputs(d: Driver) -> int:
    """The correlated rows ``d``'s refreshes emitted so far (``_counting``): each one a record on the
    correlated topic and a row for the sink, whether its content changed or only its version."""
    return getattr(d, "_emitted", 0)


def _counting(d: Driver) -> Driver:
    """``d`` with every refresh's correlated rows counted (the Driver keeps only the latest of each)."""
    import tests.streams.harness as harness

    real = entities.refresh

    def refresh(state, directory, park=True, memo=None):
        out = real(state, directory, park=park, memo=memo)
        d._emitted = getattr(d, "_emitted", 0) + len(out.correlated)
        return out

    harness.refresh = refresh
    return d


def alerts(sizes=(500, 1000, 2000)) -> None:
    print("alerts: alerts | pod rows | ms/event over the last 200")
    for n in sizes:
        d = Driver().feed([release("release.registered", 0, rid="r1"), pod_event("scheduler.scheduled", 1, pod="s-0", release_id="r1"),
                           gpu_event("gpu.assigned", 1.1, pod="s-0")])
        t = 0.0
        for i in range(n):
            if i == n - 200:
                t = time.perf_counter()
            d.feed([alert(2 + i * 0.01, fp=f"fp{i % 50}", namespace="ml", pod="s-0", node="n1")])
        ms = (time.perf_counter() - t) / 200 * 1000
        print(f"  {n:6,} | {len(d.entities['pod:ml/s-0']['rows']):6,} | {ms:7.1f}")


SHAPES = {"workload": workload, "statefulset": statefulset, "alerts": alerts}

if __name__ == "__main__":
    for name in sys.argv[1:] or SHAPES:
        SHAPES[name]()
