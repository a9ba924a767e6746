"""An allocation whose holding turns out to have started earlier — an earlier ``gpu.assigned`` (or claim
reservation) of it read after a later one — goes out under the earlier event's id, and the id it went
out under first is withdrawn: sent again one version up, closed at its start, ``end_reason``
``withdrawn`` (a tombstone readers and checksums skip). Before, that first id stayed in
``gpu_allocations`` for ever: a holding that never ended, next to the real one."""

from __future__ import annotations

import random

from schemas.outputs import ALLOCATION_WITHDRAWN
from streams.controls.policy import Policy
from streams.controls.rules import ControlEngine
from tests.streams.harness import Driver, at, claim_event, dra_device, gpu_event, kafka_orders, pod_event, release

DRA = "gpu.nvidia.com"
CLAIMED = f"{DRA}/n1/gpu-0"
GPU_P = "GPU-" + "p" * 8


def held(d: Driver) -> dict:
    return {aid: a for aid, a in d.latest_allocations(versions=True).items() if a["end_reason"] != ALLOCATION_WITHDRAWN}


def tombstones(d: Driver) -> list:
    return [a for a in d.allocations.values() if a.end_reason == ALLOCATION_WITHDRAWN]


def test_a_later_assignment_read_first_is_withdrawn_when_the_earlier_one_arrives():
    first = [release("release.registered", 0, rid="r1"), pod_event("scheduler.scheduled", 5, release_id="r1"),
             gpu_event("gpu.assigned", 20)]  # the kubelet collector's re-list, read first
    d = Driver().feed(first).flush_parked()
    [open_] = d.allocations.values()
    assert (open_.started_at, open_.ended_at) == (at(20), None)
    d.feed([gpu_event("gpu.assigned", 10), gpu_event("gpu.released", 40)]).flush_parked()
    [gone] = tombstones(d)
    assert gone.allocation_id == open_.allocation_id and gone.version == open_.version + 1
    assert (gone.started_at, gone.ended_at, gone.node, gone.gpu_id, gone.pod) == (at(20), at(20), "n1", "GPU-1111", "p1")
    [alloc] = [a for a in d.allocations.values() if a.end_reason != ALLOCATION_WITHDRAWN]
    assert (alloc.started_at, alloc.ended_at, alloc.end_reason, alloc.identity.release_id) == (at(10), at(40), "released", "r1")
    # what readers see is what a run that read them in order stored
    in_order = Driver().feed([*first[:2], gpu_event("gpu.assigned", 10), gpu_event("gpu.assigned", 20), gpu_event("gpu.released", 40)])
    assert tombstones(in_order.flush_parked()) == []
    assert held(d) == held(in_order)
    assert d.conflicts == 0


def test_a_withdrawn_allocation_that_comes_back_goes_out_above_its_withdrawal_in_any_order():
    """a10, r15, a20, r30: two holdings. Read a20 first, then a10 — one holding from 10, a20's id
    withdrawn — then r15: a20 starts a holding again, above the version it was withdrawn at."""
    events = [release("release.registered", 0, rid="r1"), pod_event("scheduler.scheduled", 5, release_id="r1"),
              gpu_event("gpu.assigned", 10), gpu_event("gpu.released", 15), gpu_event("gpu.assigned", 20), gpu_event("gpu.released", 30)]
    reference = Driver().feed(events).flush_parked()
    assert sorted((a["started_at"], a["ended_at"]) for a in held(reference).values()) == [(at(10), at(15)), (at(20), at(30))]
    d = Driver().feed([*events[:2], events[4], events[2]]).flush_parked()
    assert len(tombstones(d)) == 1
    d.feed([events[3], events[5]]).flush_parked()
    assert tombstones(d) == [] and held(d) == held(reference)  # back, at a higher version than its tombstone
    assert d.conflicts == 0
    for seed, order in kafka_orders(events, range(1, 13)):
        other = Driver(seed=seed).feed(order).flush_parked()
        assert other.conflicts == 0, f"order {seed}"
        assert held(other) == held(reference), f"order {seed}"


def test_a_dra_holding_the_kubelet_reported_before_its_claim_is_one_allocation_from_the_claim():
    """The kubelet's report read before the claim's reservation (which starts the holding earlier): the
    holding goes out from the kubelet's row, then from the claim's, and the first id is withdrawn."""
    head = [release("release.registered", 0, rid="r1"), dra_device(0, pool="n1", device="gpu-0", uuid=GPU_P),
            pod_event("scheduler.scheduled", 4, pod="c2", release_id="r1")]
    kubelet = gpu_event("gpu.assigned", 6, pod="c2", device=CLAIMED, resource=DRA, container="main")
    claim = claim_event("gpu.claim_reserved", 5, pod="c2", pod_uid="uid-c2", claim="c2-gpu")
    d = Driver().feed([*head, kubelet]).flush_parked()
    [first] = d.allocations.values()
    assert first.started_at == at(6)
    d.feed([claim]).flush_parked()
    [gone] = tombstones(d)
    assert (gone.allocation_id, gone.gpu_id, gone.started_at, gone.ended_at) == (first.allocation_id, CLAIMED, at(6), at(6))
    [alloc] = [a for a in d.allocations.values() if a.end_reason != ALLOCATION_WITHDRAWN]
    assert (alloc.started_at, alloc.gpu, alloc.container) == (at(5), GPU_P, "main")
    assert held(d) == held(Driver().feed([*head, claim, kubelet]).flush_parked())


def test_a_withdrawn_allocation_is_no_holding_for_the_retirement_control():
    """Control 8 (a retired release still holding GPUs past its grace) read the first id's open interval,
    superseded by nothing: a release retired and released in time was 'still holding' for ever."""
    rel = lambda etype, minutes, **kw: release(etype, minutes, rid="r1", **kw)  # noqa: E731
    history = [rel("release.registered", 0, actor="ci-pipeline"), rel("release.approved", 1, actor="alice", approval_id="CHG-1"),
               rel("release.promoted", 2, actor="alice", to_environment="prod"), pod_event("scheduler.scheduled", 9, release_id="r1")]
    d = Driver().feed([*history, gpu_event("gpu.assigned", 12)]).flush_parked()
    engine = ControlEngine(d.directory, Policy(), at(200))
    engine.feed(list(d.rows.values()), list(d.allocations.values())).run()  # the holding from 12, open
    later = [gpu_event("gpu.assigned", 10), rel("release.retired", 30, actor="alice"), gpu_event("gpu.released", 50),
             pod_event("scheduler.deleted", 50, release_id="r1")]
    d.feed(later).flush_parked()
    engine.feed(list(d.rows.values()), list(d.allocations.values())).run()  # the tombstone, and the holding from 10
    assert [v.detail for v in engine.current() if v.control_id == 8] == []
    # (a tombstone is closed at its start, inside the holding that replaced it: no control reads a holding in it)
    assert len(tombstones(d)) == 1
    # (and one still held is found: the control reads the holding that replaced it)
    d2 = Driver().feed([*history, gpu_event("gpu.assigned", 12)]).flush_parked()
    engine = ControlEngine(d2.directory, Policy(), at(200))
    engine.feed(list(d2.rows.values()), list(d2.allocations.values())).run()
    d2.feed([gpu_event("gpu.assigned", 10), rel("release.retired", 30, actor="alice")]).flush_parked()
    engine.feed(list(d2.rows.values()), list(d2.allocations.values())).run()
    [v8] = [v for v in engine.current() if v.control_id == 8]
    assert v8.opened_at == at(90) and v8.evidence[1] == gpu_event("gpu.assigned", 10).event_id, v8.evidence


def test_random_gpu_histories_leave_the_same_allocations_in_any_order():
    """Random assignments and releases of two devices and two containers, with a pod deletion: the
    allocations readers see (with versions) are the same in every order (a probe of this shape found
    differing allocations — mostly ids left behind — in ~10 % of histories before the withdrawal)."""
    for s in range(150):
        rng = random.Random(s)
        events = [release("release.registered", 0, rid="r1"), pod_event("scheduler.scheduled", 1, release_id="r1", pod_uid="u1")]
        for i in range(rng.randint(2, 8)):
            events.append(gpu_event(rng.choice(["gpu.assigned", "gpu.assigned", "gpu.released"]), rng.randint(2, 60) + i / 100,
                                    device=rng.choice(["GPU-1111", "GPU-2222"]), container=rng.choice(["main", "main", "side"])))
        if rng.random() < 0.3:
            events.append(pod_event("scheduler.deleted", rng.randint(30, 70), release_id="r1", pod_uid="u1"))
        events = list({e.event_id: e for e in events}.values())
        reference = Driver().feed(events).flush_parked()
        for seed, order in kafka_orders(events, range(1, 5)):
            d = Driver(seed=seed).feed(order).flush_parked()
            assert d.conflicts == 0, f"history {s}, order {seed}"
            assert held(d) == held(reference), f"history {s}, order {seed}"


def test_a_dra_holding_split_again_keeps_growing_versions_and_closes(monkeypatch):
    """One DRA device the kubelet reports for two containers: side 10–15, main 20–30. Read main@20, then
    side@10 (one holding from 10: main's id withdrawn), then side's release@15 (main's holding again, above
    its withdrawal): a merged holding's version was the sum over its group's spans, which falls when a
    group splits — main's release@30 then came at a version no higher than the one it was back at, and
    the worker, trusting versions, left main's allocation open for ever (conflicts in event order too).
    Every holding of a device now counts every report of the device."""
    import streams.correlate.entities as entities

    monkeypatch.setattr(entities, "VERIFY_UNCHANGED", False)  # as the worker runs: versions trusted, nothing compared
    head = [release("release.registered", 0, rid="r1"), dra_device(0, pool="n1", device="gpu-0", uuid=GPU_P),
            pod_event("scheduler.scheduled", 5, release_id="r1")]
    side_a, side_r, main_a, main_r = (gpu_event(etype, m, device=CLAIMED, resource=DRA, container=c) for etype, m, c in (
        ("gpu.assigned", 10, "side"), ("gpu.released", 15, "side"), ("gpu.assigned", 20, "main"), ("gpu.released", 30, "main")))
    d = Driver().feed([*head, main_a]).flush_parked()
    for later in (side_a, side_r, main_r):
        d.feed([later]).flush_parked()
    spans = sorted((a["container"], a["started_at"], a["ended_at"], a["end_reason"]) for a in held(d).values())
    assert spans == [("main", at(20), at(30), "released"), ("side", at(10), at(15), "released")]
    assert held(d) == held(Driver().feed([*head, side_a, side_r, main_a, main_r]).flush_parked())


def test_random_dra_and_claim_histories_leave_the_same_allocations_in_any_order():
    """The kubelet's reports of a DRA device for two containers and the claims' reservations, in random
    orders (a probe of this shape: conflicts in 16 of 150 histories in event order itself, versions
    differing by order in 25, before every holding of a device counted every report of it)."""
    for s in range(120):
        rng = random.Random(s)
        events = [release("release.registered", 0, rid="r1"), dra_device(0, pool="n1", device="gpu-0", uuid=GPU_P),
                  pod_event("scheduler.scheduled", 1, release_id="r1", pod_uid="u1")]
        for i in range(rng.randint(2, 9)):
            t = rng.randint(2, 60) + i / 100
            if rng.random() < 0.5:
                events.append(gpu_event(rng.choice(["gpu.assigned", "gpu.assigned", "gpu.released"]), t, device=CLAIMED, resource=DRA,
                                        container=rng.choice(["main", "side"])))
            else:
                etype = rng.choice(["gpu.claim_reserved", "gpu.claim_released"])
                events.append(claim_event(etype, t, pod_uid="u1", claim=rng.choice(["cA", "cB"]),
                                          reason="unreserved" if etype == "gpu.claim_released" else None))
        events = list({e.event_id: e for e in events}.values())
        reference = Driver().feed(events).flush_parked()
        assert reference.conflicts == 0, f"history {s}"
        for seed, order in kafka_orders(events, range(1, 5)):
            d = Driver(seed=seed).feed(order).flush_parked()
            assert d.conflicts == 0, f"history {s}, order {seed}"
            assert held(d) == held(reference), f"history {s}, order {seed}"


def test_a_tombstone_is_no_version_to_the_controls_so_their_violations_match_a_run_in_order():
    """The controls stage kept a withdrawn allocation's tombstone as a row of its pod and counted its
    version: control 8's violation of a retired release went out at version 139 in a run that read the
    holding's later assignment first, at 111 in one that read them in order (review helper-63). The
    allocations of each step as the correlation stage sends them: a pod's tombstones with the allocations
    that replaced them, one message (one evaluation)."""
    rel = lambda etype, minutes, **kw: release(etype, minutes, rid="r1", **kw)  # noqa: E731
    history = [rel("release.registered", 0, actor="ci-pipeline"), rel("release.approved", 1, actor="alice", approval_id="CHG-1"),
               rel("release.promoted", 2, actor="alice", to_environment="prod"), pod_event("scheduler.scheduled", 9, release_id="r1"),
               rel("release.retired", 30, actor="alice")]
    a10, a12 = gpu_event("gpu.assigned", 10), gpu_event("gpu.assigned", 12)

    def violations(steps):
        d = Driver()
        engine = ControlEngine(d.directory, Policy(), at(300))
        sent: dict = {}
        for step in steps:
            d.feed(step).flush_parked()
            engine.feed(list(d.rows.values())).run()
            news = [a for a in d.allocations.values() if sent.get(a.allocation_id) != a.version]
            sent.update((a.allocation_id, a.version) for a in news)
            engine.feed((), news).run()
        return {(v.control_id, v.opened_at, v.closed_at, v.detail): v.version for v in engine.current(include_withdrawn=True)}

    in_order = violations([history, [a10], [a12]])
    assert [k[0] for k in in_order] == [8]
    assert violations([history, [a12], [a10]]) == in_order


def test_the_row_cap_lets_a_holding_go_whole_or_not_at_all(monkeypatch):
    """Past the row cap, a closed holding's first assignment was let go while a repeated report of it stayed:
    the holding went out again from the repeat, beside the first (whose starting row was gone: it could not
    be withdrawn) — one GPU held twice over [10, 20] and [11, 20] (review helper-63)."""
    import streams.correlate.entities as entities

    monkeypatch.setattr(entities, "MAX_ROWS", 8)
    events = [release("release.registered", 0, rid="r1"), pod_event("scheduler.scheduled", 5, release_id="r1"),
              gpu_event("gpu.assigned", 10), gpu_event("gpu.assigned", 11), gpu_event("gpu.released", 20),
              *(pod_event("scheduler.running", 30 + i, release_id="r1") for i in range(5))]
    for seed, order in [(None, events), *kafka_orders(events, range(1, 9))]:
        d = Driver(seed=seed).feed(order).flush_parked()
        spans = sorted((a["started_at"], a["ended_at"]) for a in held(d).values())
        assert spans == [(at(10), at(20))], f"order {seed}: {spans}"
        assert d.conflicts == 0


def test_an_open_holdings_repeated_reports_still_go_past_the_row_cap(monkeypatch):
    """Its start stays (needed while it is held); the reports a collector repeats at every restart go, or a
    long-held GPU's pod grew past the cap with each re-list."""
    import streams.correlate.entities as entities

    monkeypatch.setattr(entities, "MAX_ROWS", 8)
    events = [release("release.registered", 0, rid="r1"), pod_event("scheduler.scheduled", 5, release_id="r1"),
              *(gpu_event("gpu.assigned", 10 + i) for i in range(30))]
    d = Driver().feed(events).flush_parked()
    assert len(d.entities["pod:ml/p1"]["rows"]) <= 8
    assert sorted((a["started_at"], a["ended_at"]) for a in held(d).values()) == [(at(10), None)]


def test_a_pod_at_its_row_cap_keeps_a_withdrawn_allocations_start_until_it_is_withdrawn(monkeypatch):
    """The pod at its cap when a holding's earlier report arrives: the fold let the later report go (a repeat of
    the holding now) before the refresh that would withdraw the allocation it started — which then could not
    be rebuilt, and stayed open beside the real one."""
    import streams.correlate.entities as entities

    monkeypatch.setattr(entities, "MAX_ROWS", 8)
    head = [release("release.registered", 0, rid="r1"), pod_event("scheduler.scheduled", 5, release_id="r1"), gpu_event("gpu.assigned", 12),
            *(pod_event("scheduler.running", 30 + i, release_id="r1") for i in range(6))]
    d = Driver().feed(head).flush_parked()
    assert len(d.entities["pod:ml/p1"]["rows"]) == 8
    d.feed([gpu_event("gpu.assigned", 10)]).flush_parked()
    assert sorted((a["started_at"], a["ended_at"]) for a in held(d).values()) == [(at(10), None)]
    assert [a.started_at for a in tombstones(d)] == [at(12)]
    d.feed([pod_event("scheduler.running", 40 + i, release_id="r1") for i in range(4)]).flush_parked()
    assert len(d.entities["pod:ml/p1"]["rows"]) <= 8  # withdrawn, its row goes like any other
