"""Random-order probe of the engine's exactness, for developing it: not a test (it reports what is left).

    PYTHONPATH=. .venv/bin/python benchmarks/order_fuzz.py [first=0] [last=800]
    # SHARED=1: images several releases share; INTERLEAVE=1: release events reach the directory among the
    # entities' messages in the shuffled orders (else each as it is fed, before any entity message drains);
    # GPU=1: one pod's GPU holdings instead — a DRA device the kubelet reports for two containers, claims,
    # a device plugin's GPU and MIG slice, deletions, a second incarnation

Random small histories — releases whose manifests change, pods and a Kueue Workload whose release
labels, model labels, image digests, workloads and uids change between their events, GPU assignments
and alerts on the pods and their GPU — run through the tests' ``Driver`` (the worker's functions) in
event order and in four shuffled orders that keep each release's own events in order (one key, one
partition: Kafka keeps it) and, every fourth, deliver a third of them again. With the tests'
``VERIFY_UNCHANGED`` on, it counts per scenario the *conflicts* (a row whose content changed at a
version no higher than before: the latest version would not be the right content) and the orders
whose final rows and allocations (with versions; not the withdrawn allocations' tombstones) differ from
event order's, and prints which fields differ; and the entities a refresh now would still make emit
(a refresh the run missed: their rows keep versions below those the history gives them).

Measured (800 scenarios): cb2bd70 111 scenarios with conflicts, 147 with differing final rows;
after ``named_values``/``since``/holdings' and links' ``rids`` 0 and 97 (the links a pod of two
workloads left behind: versions, and in some attribution); after a pod links to every workload it
named (``own_named``) 0 and 0 — and 0 and 0 in 3,000, and with ``SHARED=1`` (docs/architecture.md).
With ``INTERLEAVE=1`` 5 of 400 differed, each with a missed refresh (a release event changes every
look-up the release ever answered: ``ReleaseDirectory.answered``); 0 of 3,000 since. ``GPU=1``, with
c180cae's entities: 14 of 400 with conflicts, 156 differing (allocations left behind, DRA holdings'
versions); 0 and 0 since the withdrawal and the per-device DRA versions.
"""

from __future__ import annotations

import copy
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from streams.correlate.entities import refresh  # noqa: E402
from tests.streams.harness import (Driver, alert, claim_event, dra_device, gpu_event, kafka_orders, pod_event,  # noqa: E402  (sets VERIFY_UNCHANGED)
                                   release)

DA, DB = "sha256:" + "a1" * 32, "sha256:" + "b1" * 32
DIGESTS = [DA, DA, DB, None] if os.environ.get("SHARED") else [DA, DB, None]
INTERLEAVE = bool(os.environ.get("INTERLEAVE"))  # release events reach the directory among the entities' messages (harness.Driver)


def scenario(rng: random.Random) -> list:
    events = []
    for _ in range(rng.randint(2, 8)):
        etype = rng.choice(["release.registered", "release.promoted", "release.rolled_back", "release.evaluated"])
        extra = {"to_environment": rng.choice(["prod", "dev"])} if etype in ("release.promoted", "release.rolled_back") else {}
        events.append(release(etype, rng.randint(0, 60), rid=f"r{rng.randint(0, 3)}", model=rng.choice(["ma", "mb"]),
                              version=rng.choice(["1", "2"]), digest=rng.choice(DIGESTS), env=rng.choice(["prod", "prod", "dev"]), **extra))
    pods = ["p1", "p2", None] if rng.random() < 0.6 else ["p1"]  # None: the Kueue Workload's own row
    for i in range(rng.randint(1, 7)):
        labels = {}
        if rng.random() < 0.5:
            labels["model_name"] = rng.choice(["ma", "mb"])
        if rng.random() < 0.3:
            labels["model_version"] = rng.choice(["1", "2"])
        if rng.random() < 0.2:
            labels["environment"] = rng.choice(["prod", "dev"])
        pod = rng.choice(pods)
        events.append(pod_event(rng.choice(["scheduler.scheduled", "scheduler.running", "scheduler.finished", "scheduler.queued"]),
                                rng.randint(0, 60) + i / 10, pod=pod, workload=rng.choice(["ml/Job/a", "ml/Job/a", "ml/Job/b"]),
                                release_id=rng.choice([None, None, None, "r0", "r1", "r9"]), digest=rng.choice(DIGESTS) if pod else None,
                                pod_uid=None if pod is None else rng.choice(["u1", "u1", "u2"]) + pod, **labels))
    for p in (p for p in pods if p):
        events += [gpu_event(rng.choice(["gpu.assigned", "gpu.released"]), rng.randint(0, 60), pod=p) for _ in range(rng.randint(0, 2))]
    events += [alert(rng.randint(0, 60), fp=f"g{i}", node="n1", gpu_id="GPU-1111") for i in range(rng.randint(0, 2))]
    events += [alert(rng.randint(0, 60), fp=f"f{i}", namespace="ml", pod=rng.choice([p for p in pods if p])) for i in range(rng.randint(0, 3))]
    return list({e.event_id: e for e in events}.values())


DRA = "gpu.nvidia.com"
MIG = "MIG-" + "1" * 8 + "-1111-1111-1111-" + "1" * 12


def gpu_scenario(rng: random.Random) -> list:
    """One pod's GPU holdings (``GPU=1``), in the shapes whose allocation ids and versions are subtle:
    a DRA holding several reports make (``merge_dra``), claims, re-reports, deletions, incarnations."""
    events = [release("release.registered", 0, rid="r1"), release("release.registered", 0, rid="r2", model="m2", digest="sha256:" + "c" * 64),
              dra_device(0), pod_event("scheduler.scheduled", 1, release_id="r1", pod_uid="u1")]
    uid = lambda: rng.choice(["u1", "u1", "u2"])  # noqa: E731
    if rng.random() < 0.5:
        events.append(pod_event("scheduler.scheduled", rng.randint(20, 40), release_id="r2", pod_uid="u2"))
    for i in range(rng.randint(2, 9)):
        t, kind = rng.randint(2, 60) + i / 100, rng.choice(["dra", "claim", "plugin", "deleted", "running"])
        if kind == "dra":
            events.append(gpu_event(rng.choice(["gpu.assigned", "gpu.assigned", "gpu.released"]), t, device=f"{DRA}/n1/gpu-0", resource=DRA,
                                    container=rng.choice(["main", "side"])))
        elif kind == "claim":
            etype = rng.choice(["gpu.claim_reserved", "gpu.claim_released"])
            events.append(claim_event(etype, t, pod_uid=uid(), claim=rng.choice(["cA", "cB"]), reason="unreserved" if "released" in etype else None))
        elif kind == "plugin":
            events.append(gpu_event(rng.choice(["gpu.assigned", "gpu.assigned", "gpu.released"]), t, device=rng.choice(["GPU-1111", MIG]),
                                    container=rng.choice(["main", "side"])))
        else:
            events.append(pod_event(f"scheduler.{kind}", t, release_id=rng.choice(["r1", "r2"]), pod_uid=uid()))
    if rng.random() < 0.3:
        events.append(alert(rng.randint(2, 60), fp="g1", node="n1", gpu_id="GPU-1111"))
    return list({e.event_id: e for e in events}.values())


def held(d: Driver) -> dict:
    """The allocations readers see: not the tombstones of those withdrawn (``entities._withdraw``), which
    only a run that emitted the id first writes."""
    return {aid: a for aid, a in d.latest_allocations(versions=True).items() if a["end_reason"] != "withdrawn"}


def stale(d: Driver) -> int:
    """Entities that a refresh now would make emit (a row, an allocation, a link): a refresh the run
    missed — its rows keep versions below those the history gives them."""
    n = 0
    for state in d.entities.values():
        out = refresh(copy.deepcopy(state), d.directory, park=d.park)
        n += bool(out.correlated or out.allocations or out.forwards)
    return n


def main(first: int, last: int) -> None:
    started, with_conflicts, with_diffs, with_stale, fields = time.time(), 0, 0, 0, Counter()
    for s in range(first, last):
        events = (gpu_scenario if os.environ.get("GPU") else scenario)(random.Random(s))
        reference = Driver().feed(events).flush_parked()
        ref, ref_allocs = reference.latest(versions=True), held(reference)
        conflicts, diffs, missed = reference.conflicts, 0, stale(reference)
        for seed, order in kafka_orders(events, range(1, 5)):
            d = Driver(seed=seed, interleave=INTERLEAVE).feed(order).flush_parked()
            conflicts += d.conflicts
            missed += stale(d)
            got, got_allocs = d.latest(versions=True), held(d)
            if got != ref or got_allocs != ref_allocs:
                diffs += 1
                for what, (mine, theirs) in {"": (ref, got), "allocation ": (ref_allocs, got_allocs)}.items():
                    for cid in set(mine) | set(theirs):
                        a, b = mine.get(cid), theirs.get(cid)
                        if a != b:
                            fields[(what + "missing",) if a is None or b is None else tuple(sorted(what + f for f in a if a[f] != b[f]))] += 1
        with_conflicts += conflicts > 0
        with_diffs += diffs > 0
        with_stale += missed > 0
        if conflicts or diffs or missed:
            print(f"scenario {s}: {conflicts} conflict(s), {diffs} of 4 orders differ, {missed} entit(ies) a refresh was missed for", flush=True)
    print(f"{last - first} scenarios in {time.time() - started:.0f}s: {with_conflicts} with conflicts, {with_diffs} with differing final rows, "
          f"{with_stale} with a missed refresh")
    print("fields that differ (rows × orders):", fields.most_common(8))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 0, int(sys.argv[2]) if len(sys.argv) > 2 else 800)
