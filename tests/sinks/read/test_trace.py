"""sinks/read/trace.py and `gpuledger trace` against real ClickHouse holding one incident
(tests/sinks/incident.py), written by the real sink writers."""

from __future__ import annotations

import json
import re
from datetime import timedelta

import pytest
from typer.testing import CliRunner

from gpuledger.cli import app as cli_app
from sinks.read.query import DirectReader
from sinks.read.trace import TraceError, chain_of, parse_time, parse_window, trace
from tests.sinks import incident as inc

AT = inc.T0 + timedelta(minutes=70)  # after the alert, before the rollback
ENTRIES = [
    ("alert", inc.FP),
    ("release", inc.R7),
    ("workload", inc.W7),
    ("pod", f"risk/{inc.P2}"),
    ("pod", f"risk/{inc.P1}"),
    ("gpu", f"node-b/{inc.GPU_B}"),
    ("model", "fraud-scorer:7"),
    ("model", "fraud-scorer"),
]


@pytest.fixture(scope="module")
def store(clickhouse_client):
    return DirectReader(clickhouse_client), inc.load_store(clickhouse_client)


@pytest.mark.parametrize("at", [AT, None], ids=["at", "now"])
def test_every_entry_point_resolves_to_the_same_chain(store, at):
    reader, db = store
    results = {f"{k}={v}": trace(reader, db, k, v, at=at) for k, v in ENTRIES}
    chains = {name: chain_of(r) for name, r in results.items()}
    if at is None:
        # Without --at each entry anchors the window on its own time (the alert's
        # startsAt, the workload's latest event…): the window and what it selects (other
        # workloads' events, other alerts, other GPU holders) differ; the chain does not.
        assert {c["window"]["anchor"] for c in chains.values()} > {"the alert's startsAt"}
        chains = {name: {**{k: v for k, v in c.items() if k != "window"},
                         "scheduler_events": [e for e in c["scheduler_events"] if e["in_chain"]],
                         "alerts": [a for a in c["alerts"] if a["in_chain"]],
                         "gpus": [{**g, "others_in_window": None} for g in c["gpus"]]} for name, c in chains.items()}
    reference = chains[f"alert={inc.FP}"]
    for name, chain in chains.items():
        assert chain == reference, f"{name} differs from the alert's chain"
    assert all(r["entry"]["root"] == {"kind": "release", "id": inc.R7} for r in results.values())
    assert results["model=fraud-scorer:7"]["entry"]["other_releases"] == [inc.R7_STAGING]
    # Before the rollback v6 was replaced by v7's promotion; after it, v6 serves in prod again.
    assert results["model=fraud-scorer"]["entry"]["other_releases"] == ([inc.R7_STAGING, inc.R6] if at else [inc.R6, inc.R7_STAGING])


def test_the_chain_links_alert_release_workload_pods_gpus_and_neighbours(store):
    reader, db = store
    result = trace(reader, db, "alert", inc.FP, at=AT)
    rel = result["release"]
    assert rel["release_id"] == inc.R7 and rel["state"] == "release.promoted"
    assert {f: rel[f] for f in inc.MANIFEST7} == inc.MANIFEST7
    # (the incident's events carry no authenticated_by: typed names, said so)
    assert rel["approvals"] == [{"occurred_at": "2026-11-30T12:10:00.000Z", "actor": "alice (unauthenticated)", "approval_id": "CHG-1042"}]
    assert [p["to_environment"] for p in rel["promotions"]] == ["prod"]
    assert [e["event_type"] for e in rel["lifecycle"]] == ["release.registered", "release.evaluated", "release.approved", "release.promoted"]

    [wl] = result["workloads"]
    assert (wl["workload_id"], wl["queue"], wl["cluster_queue"], wl["priority_class"], wl["priority"]) == \
        (inc.W7, "prod-inference", "gpu-a100", "prod-high", 1000)
    assert wl["admitted_at"] == "2026-11-30T12:17:30.000Z" and len(wl["admissions"]) == 2
    assert [p["preemptor"] for p in wl["preemptions"]] == ["Workload/training/llm-finetune-3"]
    assert wl["pods"] == [f"risk/{inc.P1}", f"risk/{inc.P2}"]
    types = [e["event_type"] for e in wl["events"]]
    # The row first emitted without a workload, and the one first given a wrong one, appear once, here.
    assert types.count("scheduler.failed_scheduling") == 1 and types.count("scheduler.pods_ready") == 1

    pods = {f"{p['namespace']}/{p['pod']}": p for p in result["pods"]}
    assert pods[f"risk/{inc.P1}"]["allocations"][0]["ended_at"] == "2026-11-30T13:00:00.000Z"
    assert pods[f"risk/{inc.P2}"]["allocations"][0]["ended_at"] is None
    gpus = {f"{g['node']}/{g['gpu_id']}": g for g in result["gpus"]}
    assert [a["pod"] for a in gpus[f"node-a/{inc.GPU_A}"]["others_in_window"]] == [inc.PT]  # who took the GPU after the preemption

    events = {(e["event_type"], e.get("workload_id")): e for e in result["scheduler_events"]}
    assert events[("scheduler.preempted", inc.W7)]["in_chain"] is True
    assert events[("scheduler.scheduled", inc.WT)]["in_chain"] is False  # the preemptor landing on node-a
    alerts = {a["alert_fingerprint"]: a for a in result["alerts"]}
    assert alerts[inc.FP]["in_chain"] and alerts[inc.FP]["status"] == "firing" and alerts[inc.FP]["release_id"] == inc.R7
    assert alerts[inc.FP_XID]["in_chain"] is False  # other alert on node-b in the window
    assert inc.FP_OLD not in alerts  # v6's old alert is not this incident
    assert result["gaps"] == []


def test_as_of_at_an_allocation_that_ended_later_is_held(store):
    """`trace --at` before P1 lost its GPU (13:00): the allocation is held as of then — it
    showed the release that came later ("→ 13:00 (preempted)"), and a responder read a GPU as
    already free."""
    from sinks.read.tree import render_tree, tree_text

    reader, db = store
    before = inc.T0 + timedelta(minutes=50)
    result = trace(reader, db, "pod", f"risk/{inc.P1}", at=before)
    [alloc] = {f"{p['namespace']}/{p['pod']}": p for p in result["pods"]}[f"risk/{inc.P1}"]["allocations"]
    assert alloc["started_at"] < "2026-11-30T12:50:00.000Z" and alloc["ended_at"] is None and "end_reason" not in alloc
    gpu_allocs = [a for g in result["gpus"] for a in g["allocations"] if a["pod"] == inc.P1]
    assert gpu_allocs and all(a["ended_at"] is None for a in gpu_allocs)
    text = tree_text(render_tree(result), width=250)
    assert "13:00:00.000Z" not in text and f"{alloc['started_at']} → held" in text, text
    later = trace(reader, db, "pod", f"risk/{inc.P1}", at=AT)  # after it: ended, as before
    assert {f"{p['namespace']}/{p['pod']}": p for p in later["pods"]}[f"risk/{inc.P1}"]["allocations"][0]["ended_at"] == "2026-11-30T13:00:00.000Z"


def test_a_model_trace_names_the_models_other_releases(store):
    """`trace --model NAME` follows the model's most recently active release; the others (the one
    back in prod after a rollback, say) were only in the JSON. At AT v7 holds GPUs in prod; v6,
    replaced by its promotion, comes after staging's v7."""
    from sinks.read.tree import render_tree, tree_text

    reader, db = store
    text = tree_text(render_tree(trace(reader, db, "model", "fraud-scorer", at=AT)), width=250)
    assert f"release {inc.R7} " in text, text
    assert (f"other releases of model fraud-scorer, most recently active first (trace one with --release): {inc.R7_STAGING}, {inc.R6}"
            in text), text


def test_a_model_trace_follows_the_release_serving_not_the_one_just_rolled_back(clickhouse_client):
    """Found by an exploratory review: after v7's rollback (v6 restored in prod, v7's GPUs
    released, v6's workload on GPUs again) `trace --model fraud-scorer` showed v7 — its latest
    event was the newest — though the docs say "its most recently active release". The rollback
    makes v6 the active one; one holding GPUs comes first."""
    import asyncio

    from schemas import GpuAllocation
    from schemas.envelope import Identity
    from sinks.agents import SinkWriters

    db = inc.load_store(clickhouse_client)
    m = lambda minutes: inc.T0 + timedelta(minutes=minutes)  # noqa: E731
    ended_p2 = GpuAllocation(allocation_id="al-p2", version=2, node="node-b", gpu_id=inc.GPU_B, gpu=inc.GPU_B, namespace="risk",
                             pod=inc.P2, container="main", attribution="workload_release", started_at=m(62.5), ended_at=m(91),
                             end_reason="released", start_event_id="assign-al-p2", end_event_id="release-al-p2",
                             identity=Identity(release_id=inc.R7, workload_id=inc.W7, namespace="risk", pod=inc.P2, node="node-b",
                                               gpu_id=inc.GPU_B, pod_uid=f"uid-{inc.P2}"))
    restored = GpuAllocation(allocation_id="al-r6", version=0, node="node-b", gpu_id=inc.GPU_B, gpu=inc.GPU_B, namespace="risk",
                             pod="fraud-scorer-6-restore-0", container="main", attribution="workload_release", started_at=m(92),
                             start_event_id="assign-al-r6",
                             identity=Identity(release_id=inc.R6, namespace="risk", pod="fraud-scorer-6-restore-0", node="node-b",
                                               gpu_id=inc.GPU_B, pod_uid="uid-restore-0"))
    asyncio.run(SinkWriters(clickhouse_client, db).store_allocations([ended_p2, restored]))
    reader = DirectReader(clickhouse_client)

    def root_and_others(at):
        result = trace(reader, db, "model", "fraud-scorer", at=at)
        return result["release"]["release_id"], result["entry"]["other_releases"]

    assert root_and_others(None) == (inc.R6, [inc.R7_STAGING, inc.R7])  # v6 holds a GPU; v7 ended at its rollback
    assert root_and_others(AT) == (inc.R7, [inc.R7_STAGING, inc.R6])  # before the rollback: v7 held GPUs in prod
    # Between v7's GPU going (13:31) and v6's coming (13:32) nobody holds one: the rollback (13:30)
    # restored v6, and v7 ended there.
    assert root_and_others(m(91.5)) == (inc.R6, [inc.R7_STAGING, inc.R7])


def test_a_resolved_alerts_title_gives_when_it_resolved(store):
    """The title of a resolved alert gave its startsAt as the time it resolved."""
    from sinks.read.tree import render_tree, tree_text

    reader, db = store
    title = tree_text(render_tree(trace(reader, db, "alert", inc.FP)), width=250).splitlines()[0]
    assert "resolved at 2026-11-30T13:35:00.000Z, firing since 2026-11-30T13:05:00.000Z" in title, title
    title = tree_text(render_tree(trace(reader, db, "alert", inc.FP, at=AT)), width=250).splitlines()[0]
    assert "firing at 2026-11-30T13:05:00.000Z (fingerprint" in title, title


def test_an_alert_trace_is_anchored_on_the_alerts_starts_at(store):
    # Without --at the window ends at the alert's startsAt (13:05), not at the chain's
    # latest event (the resolution at 13:35): the preemptor landing on node-a at 13:00
    # is inside a 15-minute window.
    reader, db = store
    result = trace(reader, db, "alert", inc.FP, window=timedelta(minutes=15))
    assert result["window"] == {"from": "2026-11-30T12:50:00.000Z", "to": "2026-11-30T13:05:00.000Z", "length": "15m",
                                "anchor": "the alert's startsAt"}
    others = [(e["event_type"], e.get("workload_id")) for e in result["scheduler_events"] if not e["in_chain"]]
    assert ("scheduler.scheduled", inc.WT) in others
    from sinks.read.tree import render_tree, tree_text

    text = tree_text(render_tree(result), width=250).splitlines()
    assert "window 2026-11-30T12:50:00.000Z → 2026-11-30T13:05:00.000Z (anchored on the alert's startsAt)" in text[1]


@pytest.mark.parametrize("kind,value,anchor,to", [
    ("workload", inc.W7, "the workload's latest event", "2026-11-30T13:03:30.000Z"),
    ("pod", f"risk/{inc.P1}", "the pod's latest event", "2026-11-30T13:00:00.000Z"),
    ("release", inc.R7, "the chain's latest event", None),
    ("alert", inc.FP, "--at", "2026-11-30T13:10:00.000Z"),
])
def test_the_window_header_says_what_it_is_anchored_on_and_its_rows_are_inside(store, kind, value, anchor, to):
    reader, db = store
    at = AT if anchor == "--at" else None
    result = trace(reader, db, kind, value, at=at, window=timedelta(minutes=30))
    win = result["window"]
    assert win["anchor"] == anchor and (to is None or win["to"] == to)
    # what the window selects (other workloads' events, other alerts, other GPU holders) lies in it
    for e in result["scheduler_events"]:
        assert e["in_chain"] or win["from"] <= e["occurred_at"] <= win["to"], e
    for a in result["alerts"]:
        assert a["in_chain"] or win["from"] <= a["occurred_at"] <= win["to"], a


def test_one_preemption_seen_by_two_sources_is_one_row_with_its_sources(store):
    reader, db = store
    [wl] = trace(reader, db, "workload", inc.W7, at=AT)["workloads"]
    [preemption] = wl["preemptions"]
    assert preemption["preemptor"] == "Workload/training/llm-finetune-3" and preemption["occurred_at"] == "2026-11-30T13:00:00.000Z"
    assert preemption["sources"] == ["scheduler.preempted (Pod)", "scheduler.evicted (Workload)"]
    from sinks.read.tree import render_tree, tree_text

    lines = [line for line in tree_text(render_tree(trace(reader, db, "workload", inc.W7, at=AT)), width=250).splitlines()
             if re.search(r"(preempted|evicted)( \S+/\S+)? 2026", line)]
    assert len(lines) == 1 and "by Workload/training/llm-finetune-3" in lines[0] and "seen by scheduler.preempted (Pod), scheduler.evicted (Workload)" in lines[0]


def test_a_preemptor_named_by_uid_is_resolved_to_its_name(clickhouse_client):
    # Kueue names the preemptor by Workload uid; the collector resolves it only when it
    # already knows the Workload. Another victim's row that named it resolves it here.
    import asyncio

    from sinks.agents import SinkWriters

    db = inc.load_store(clickhouse_client)
    m = lambda minutes: inc.T0 + timedelta(minutes=minutes)  # noqa: E731
    message = "Preempted to accommodate a workload (UID: wl-uid-9, JobUID: job-9)"
    rows = [
        inc._sched("scheduler.admitted", m(20), "research/small", None, {"queue": "research"}, ns="research"),
        inc._sched("scheduler.evicted", m(30), "research/small", None, {"reason": "Preempted", "message": message,
                                                                         "preemptor": {"kind": "Workload", "name": "", "uid": "wl-uid-9"}},
                   ns="research"),
        inc._sched("scheduler.admitted", m(21), "research/other", None, {"queue": "research"}, ns="research"),
        inc._sched("scheduler.evicted", m(31), "research/other", None, {"reason": "Preempted", "message": message,
                                                                         "preemptor": {"kind": "Workload", "namespace": "research",
                                                                                       "name": "big-job", "uid": "wl-uid-9"}},
                   ns="research"),
        inc._sched("scheduler.admitted", m(22), "research/lonely", None, {"queue": "research"}, ns="research"),
        inc._sched("scheduler.evicted", m(32), "research/lonely", None, {"reason": "Preempted", "preemptor": {"kind": "Workload", "name": "", "uid": "wl-uid-unknown"}},
                   ns="research"),
    ]
    asyncio.run(SinkWriters(clickhouse_client, db).store_correlated(rows))
    reader = DirectReader(clickhouse_client)
    [small] = trace(reader, db, "workload", "research/small")["workloads"]
    assert [p["preemptor"] for p in small["preemptions"]] == ["Workload/research/big-job"]
    [lonely] = trace(reader, db, "workload", "research/lonely")["workloads"]
    assert [(p.get("preemptor"), p["preemptor_uid"]) for p in lonely["preemptions"]] == [(None, "wl-uid-unknown")]


def test_a_release_whose_latest_event_is_not_of_its_lifecycle_shows_its_lifecycle_too(clickhouse_client):
    """From an exploratory review: v7's reservation released after its rollback made the trace's
    line "state=release.reservation_released" — the rollback was not on it. The state stays the
    latest event (the rows' release_state); the lifecycle state is beside it."""
    import asyncio

    from sinks.agents import SinkWriters
    from sinks.read.tree import render_tree, tree_text

    db = inc.load_store(clickhouse_client)
    released_at = inc.ROLLBACK_AT + timedelta(minutes=2)
    row = inc._ce("release", "release.reservation_released", released_at, {"release_id": inc.R7, **inc.MANIFEST7},
                  {"actor": "carol"}, attribution="release_event", release_state="release.reservation_released")
    asyncio.run(SinkWriters(clickhouse_client, db).store_correlated([row]))
    result = trace(DirectReader(clickhouse_client), db, "release", inc.R7)
    rel = result["release"]
    assert (rel["state"], rel["lifecycle_state"]) == ("release.reservation_released", "release.rolled_back"), rel
    assert rel["lifecycle_since"] == "2026-11-30T13:30:00.000Z" and rel["state_since"] == "2026-11-30T13:32:00.000Z"
    text = tree_text(render_tree(result), width=250)
    assert (f"release {inc.R7}  state=release.reservation_released since 2026-11-30T13:32:00.000Z  "
            "lifecycle=release.rolled_back since 2026-11-30T13:30:00.000Z") in text, text
    # A latest event of the lifecycle: said once.
    before = tree_text(render_tree(trace(DirectReader(clickhouse_client), db, "release", inc.R7, at=released_at - timedelta(seconds=1))),
                       width=250)
    assert f"release {inc.R7}  state=release.rolled_back since 2026-11-30T13:30:00.000Z\n" in before, before


def test_a_release_registered_approved_and_promoted_in_one_instant_reads_promoted(clickhouse_client):
    """One --at for every step of a pipeline (docs/receiver.md): the trace read a release's rows by
    time and id, and a promoted release read state=release.approved or release.registered, its
    environment staging, by the hash of the ids (exploratory review). One instant's rows are read
    in the order a release lives them."""
    import asyncio

    from sinks.agents import SinkWriters
    from sinks.migrations import migrate
    from sinks.read.tree import render_tree, tree_text

    import uuid

    db = f"t_{uuid.uuid4().hex[:12]}"
    migrate(clickhouse_client, db)
    rid, at = "onetime:1", inc.T0
    steps = [("release.promoted", "0" * 32, {"actor": "alice", "to_environment": "prod"}, "prod"),
             ("release.registered", "1" * 32, {"actor": "ci"}, "staging"),
             ("release.approved", "2" * 32, {"actor": "alice", "approval_id": "C1"}, "staging")]
    rows = [inc._ce("release", etype, at, {"release_id": rid, "model_name": "m", "model_version": "1", "environment": env}, payload,
                    attribution="release_event").model_copy(update={"correlation_id": cid}) for etype, cid, payload, env in steps]
    asyncio.run(SinkWriters(clickhouse_client, db).store_correlated(rows))
    result = trace(DirectReader(clickhouse_client), db, "release", rid)
    rel = result["release"]
    assert (rel["state"], rel["lifecycle_state"], rel["environment"]) == ("release.promoted", "release.promoted", "prod"), rel
    assert [e["event_type"] for e in rel["lifecycle"]] == ["release.registered", "release.approved", "release.promoted"]
    assert f"release {rid}  state=release.promoted since" in tree_text(render_tree(result), width=250)


def test_at_before_the_rollback_shows_the_pre_rollback_state(store):
    reader, db = store
    before = trace(reader, db, "release", inc.R7, at=inc.ROLLBACK_AT - timedelta(minutes=1))
    after = trace(reader, db, "release", inc.R7, at=inc.ROLLBACK_AT + timedelta(minutes=1))
    now = trace(reader, db, "release", inc.R7)
    assert before["release"]["state"] == "release.promoted"
    assert "release.rolled_back" not in [e["event_type"] for e in before["release"]["lifecycle"]]
    assert after["release"]["state"] == now["release"]["state"] == "release.rolled_back"
    assert now["release"]["lifecycle"][-1]["actor"] == "bob"
    # Nothing after --at leaks in: the alert resolved after the rollback.
    assert [a["status"] for a in after["alerts"] if a["alert_fingerprint"] == inc.FP] == ["firing"]
    assert [a["status"] for a in now["alerts"] if a["alert_fingerprint"] == inc.FP] == ["firing", "resolved"]
    # Before the workload existed, the release had none: said as a gap.
    early = trace(reader, db, "release", inc.R7, at=inc.T0 + timedelta(minutes=12))
    assert early["release"]["state"] == "release.approved" and early["workloads"] == []
    assert any("no workload attributed" in g for g in early["gaps"])


def test_approvals_and_promotions_say_whether_their_actor_was_proven(clickhouse_client):
    """From an exploratory review: alice's approval proven by her token and one whose body only
    claimed to be hers (no credential) were two identical lines "user:alice" under approvals —
    only the lifecycle's summary marked the second — and a promotion by CI for alice said only
    "by service:ci-gitlab". They read as the controls judge them: "(unauthenticated)", "for"."""
    import asyncio

    from sinks.agents import SinkWriters
    from sinks.read.report import trace_report
    from sinks.read.tree import render_tree, tree_text

    db = inc.load_store(clickhouse_client)
    t = inc.T0 + timedelta(minutes=11)
    ident = {"release_id": inc.R7, **inc.MANIFEST7}
    rows = [inc._ce("release", "release.approved", t, ident, {"actor": "user:alice", "authenticated_by": "token", "approval_id": "C1"},
                    attribution="release_event", key="proven"),
            inc._ce("release", "release.approved", t + timedelta(seconds=1), ident,
                    {"actor": "user:alice", "approval_id": "C2", "actor_groups": ["release-managers"]}, attribution="release_event", key="typed"),
            inc._ce("release", "release.promoted", t + timedelta(seconds=2), ident,
                    {"actor": "service:ci-gitlab", "on_behalf_of": "user:alice", "authenticated_by": "oidc", "to_environment": "prod"},
                    attribution="release_event", key="delegated")]
    asyncio.run(SinkWriters(clickhouse_client, db).store_correlated(rows))
    reader = DirectReader(clickhouse_client)
    rel = trace(reader, db, "release", inc.R7)["release"]
    approvals = {a["approval_id"]: a for a in rel["approvals"]}
    assert (approvals["C1"]["actor"], approvals["C1"]["authenticated_by"]) == ("user:alice", "token")
    assert approvals["C2"]["actor"] == "user:alice (unauthenticated)" and "authenticated_by" not in approvals["C2"]
    [promo] = [p for p in rel["promotions"] if p["occurred_at"] == "2026-11-30T12:11:02.000Z"]
    assert (promo["actor"], promo["authenticated_by"]) == ("service:ci-gitlab for user:alice", "oidc")
    text = tree_text(render_tree(trace(reader, db, "release", inc.R7)), width=250)
    assert "2026-11-30T12:11:00.000Z  user:alice  C1" in text and "2026-11-30T12:11:01.000Z  user:alice (unauthenticated)  C2" in text, text
    assert "→ prod by service:ci-gitlab for user:alice" in text, text
    html = trace_report(reader, db, trace(reader, db, "release", inc.R7))
    assert "user:alice (unauthenticated)" in html and "service:ci-gitlab for user:alice" in html


def test_an_identity_with_colons_prints_as_it_is_not_as_an_emoji(clickhouse_client):
    """From an exploratory review: rich replaced ``:name:`` codes with emoji in printed text — an
    OIDC identity ``user:x:y`` printed as "user❌y", a release ``fraud:lock:7`` as "fraud🔒7"."""
    from gpuledger.cli._common import console, err

    db = inc.load_store(clickhouse_client)
    rid = "fraud:lock:7"
    import asyncio

    from sinks.agents import SinkWriters
    row = inc._ce("release", "release.approved", inc.T0, {"release_id": rid, **inc.MANIFEST7},
                  {"actor": "user:x:y", "authenticated_by": "oidc", "approval_id": "C:smile:1"}, attribution="release_event", key="emoji")
    asyncio.run(SinkWriters(clickhouse_client, db).store_correlated([row]))
    from sinks.read.tree import render_tree, tree_text

    text = tree_text(render_tree(trace(DirectReader(clickhouse_client), db, "release", rid)), width=250)
    assert f"release {rid}" in text and "user:x:y  C:smile:1" in text, text
    assert "❌" not in text and "🔒" not in text and "😄" not in text
    assert console._emoji is False and err._emoji is False


def test_at_shows_the_release_environment_of_that_time_not_the_one_known_now(clickhouse_client):
    """From an exploratory review: a release's rows keep their latest version, rendered with the
    manifest as known now — registered in staging, promoted to prod later, `trace --at` before
    the promotion said environment=prod. As of --at, the manifest comes from the events as sent
    (raw_events) up to that time; without --at, or where no raw event says, from the rows."""
    from schemas import Identity, ReleaseEvent, Source
    from schemas.release import ReleasePayload
    from sinks.read.tree import render_tree, tree_text

    def sent(etype, at, environment, event_id, **payload):
        return ReleaseEvent(event_id=event_id, event_type=etype, occurred_at=at, observed_at=at, source=Source(collector="releases"),
                            identity=Identity(release_id=inc.R7, **{**inc.MANIFEST7, "environment": environment}),
                            payload=ReleasePayload(**payload))

    raw = [sent("release.registered", inc.T0, "staging", "raw-r7-registered"),
           sent("release.promoted", inc.T0 + timedelta(minutes=15), "prod", "raw-r7-promoted", to_environment="prod")]
    reader = DirectReader(clickhouse_client)
    db = inc.load_store(clickhouse_client, raw_events=raw)
    before = trace(reader, db, "release", inc.R7, at=inc.T0 + timedelta(minutes=12))
    assert before["release"]["environment"] == "staging", before["release"]
    assert before["release"]["model_version"] == "7" and before["release"]["owner"] == "team-risk"
    text = tree_text(render_tree(before), width=250)
    assert "environment: staging" in text and "environment: prod" not in text, text
    assert trace(reader, db, "release", inc.R7, at=AT)["release"]["environment"] == "prod"
    assert trace(reader, db, "release", inc.R7)["release"]["environment"] == "prod"
    # The same release reached from its pod: the section is the same.
    via_pod = trace(reader, db, "pod", f"risk/{inc.P1}", at=inc.T0 + timedelta(minutes=20))
    assert via_pod["release"]["environment"] == "prod"


@pytest.mark.parametrize("kind,value", ENTRIES[:4] + [("gpu", f"node-a/{inc.GPU_A}")])
def test_final_and_argmax_read_the_same_chain(store, kind, value):
    reader, db = store
    for at in (AT, None):
        assert trace(reader, db, kind, value, at=at, mode="final") == trace(reader, db, kind, value, at=at, mode="argmax")


def test_missing_links_are_gaps_not_silence(store):
    reader, db = store
    # At T0+70m the training job holds node-a's GPU: a chain without a release.
    held = trace(reader, db, "gpu", f"node-a/{inc.GPU_A}", at=AT)
    assert held["entry"]["root"] == {"kind": "workload", "id": inc.WT} and held["release"] is None
    assert any("no release attributed" in g for g in held["gaps"])
    # A workload known only from a superseded row is not a workload.
    assert trace(reader, db, "workload", inc.W_WRONG)["entry"]["root"] is None
    # An unattributed alert on a node: the alert alone, with its node's neighbours.
    xid = trace(reader, db, "alert", inc.FP_XID, at=AT)
    assert xid["entry"]["root"] == {"kind": "alert", "id": inc.FP_XID}
    assert any("unattributed" in g for g in xid["gaps"])
    nothing = trace(reader, db, "alert", "no-such-fingerprint")
    assert nothing["entry"]["root"] is None and nothing["gaps"][0].startswith("no alert with fingerprint")


def test_options_are_validated():
    assert parse_window("90s") == timedelta(seconds=90) and parse_window("2h") == timedelta(hours=2)
    assert parse_time("2026-11-30T13:10:00Z") == parse_time("2026-11-30 13:10:00") == AT
    for bad in ("2x", "", "h"):
        with pytest.raises(TraceError):
            parse_window(bad)
    with pytest.raises(TraceError):
        parse_time("yesterday")
    with pytest.raises(TraceError):
        trace(None, "db", "pod", "no-namespace")


def test_cli_tree_and_json(store, clickhouse_dsn, tmp_path):
    reader, db = store
    env = {"GPULEDGER_CLICKHOUSE_DSN": clickhouse_dsn, "GPULEDGER_CLICKHOUSE_DATABASE": db, "GPULEDGER_DATA_DIR": str(tmp_path)}
    runner = CliRunner()
    out = runner.invoke(cli_app, ["trace", "--pod", f"risk/{inc.P2}", "--at", "2026-11-30T13:10:00Z", "--format", "json"], env=env)
    assert out.exit_code == 0, out.output
    assert chain_of(json.loads(out.stdout)) == chain_of(trace(reader, db, "alert", inc.FP, at=AT))
    tree = runner.invoke(cli_app, ["trace", "--alert", inc.FP, "--at", "2026-11-30T13:10:00Z"], env={**env, "COLUMNS": "200"})
    assert tree.exit_code == 0, tree.output
    for text in ("alert ModelQualityDegraded (critical) firing", f"release {inc.R7}  state=release.promoted",
                 f"workload {inc.W7}", "queue=prod-inference", f"pod risk/{inc.P2}", f"GPU node-b/{inc.GPU_B}", "preempted",
                 f"also training/{inc.PT}", "GpuXidError"):
        assert text in tree.stdout, text
    # A pod's scheduler event names the pod beside its workload (a workload's pods evicted together
    # were as many identical lines).
    assert f"scheduler.preempted  {inc.W7} pod {inc.P1} on node-a by Workload/training/" in tree.stdout, tree.stdout
    assert runner.invoke(cli_app, ["trace", "--alert", "nope"], env=env).exit_code == 4
    # A release id nothing names (it was a tree of gaps, exit 0), or not yet named as of --at.
    for args in (["--release", "nosuch"], ["--release", inc.R7, "--at", "2026-11-30T11:00:00Z"]):
        missing = runner.invoke(cli_app, ["trace", *args], env={**env, "COLUMNS": "200"})
        assert missing.exit_code == 4 and "matches nothing" in missing.stdout, (args, missing.output)
    # An --output that cannot be written: exit 2 naming it (it was a traceback).
    unwritable = runner.invoke(cli_app, ["trace", "--alert", inc.FP, "--format", "html", "--output", str(tmp_path / "missing" / "x.html")], env=env)
    assert unwritable.exit_code == 2 and "--output" in unwritable.output and "No such file" in unwritable.output, unwritable.output
    # --window 0: the chain alone (it silently became the default 2h).
    alone = runner.invoke(cli_app, ["trace", "--alert", inc.FP, "--at", "2026-11-30T13:10:00Z", "--window", "0s", "--format", "json"], env=env)
    assert alone.exit_code == 0, alone.output
    got = json.loads(alone.stdout)
    assert got["window"]["length"] == "0s" and not [a for a in got["alerts"] if not a["in_chain"]], got["window"]
    assert not [e for e in got["scheduler_events"] if not e["in_chain"]] and not [o for g in got["gpus"] for o in g["others_in_window"]]
    assert runner.invoke(cli_app, ["trace"], env=env).exit_code == 2
    assert runner.invoke(cli_app, ["trace", "--release", inc.R7, "--window", "soon"], env=env).exit_code == 2
    # A window reaching before year 1 (an OverflowError traceback): from the store's earliest time.
    wide = runner.invoke(cli_app, ["trace", "--alert", inc.FP, "--at", "2026-11-30T13:10:00Z", "--window", "1000000d", "--format", "json"], env=env)
    assert wide.exit_code == 0, wide.output
    got = json.loads(wide.stdout)
    assert got["window"]["from"] == "1900-01-01T00:00:00.000Z" and got["window"]["length"] == "1000000d", got["window"]
    narrow = chain_of(trace(reader, db, "alert", inc.FP, at=AT))
    assert {k: v for k, v in chain_of(got).items() if k not in ("window", "scheduler_events", "alerts", "gpus")} == \
        {k: v for k, v in narrow.items() if k not in ("window", "scheduler_events", "alerts", "gpus")}


def test_a_workload_shows_gpuledger_admits_decision_before_its_admission(clickhouse_client, clickhouse_dsn, tmp_path):
    import asyncio
    import uuid

    from sinks.agents import SinkWriters
    from sinks.migrations import migrate

    db = f"t_{uuid.uuid4().hex[:12]}"
    migrate(clickhouse_client, db)
    decided = inc.admission_row()
    asyncio.run(SinkWriters(clickhouse_client, db).store_correlated([*inc.correlated_rows(), decided]))
    section = next(w for w in trace(DirectReader(clickhouse_client), db, "workload", inc.W7, at=AT)["workloads"] if w["workload_id"] == inc.W7)
    [d] = section["admission_decisions"]
    assert (d["decision"], d["rule"], d["message"]) == ("allow", "approved", f"release {inc.R7} is approved for prod")
    assert section["state"].startswith("scheduler.")  # a decision is not the workload's state
    env = {"GPULEDGER_CLICKHOUSE_DSN": clickhouse_dsn, "GPULEDGER_CLICKHOUSE_DATABASE": db, "GPULEDGER_DATA_DIR": str(tmp_path), "COLUMNS": "200"}
    tree = CliRunner().invoke(cli_app, ["trace", "--workload", inc.W7, "--at", AT.isoformat()], env=env)
    assert tree.exit_code == 0, tree.output
    assert f"decision allow at {d['occurred_at']} by rule approved, before admission at {section['admitted_at']}" in tree.stdout


def test_a_dry_run_is_shown_as_one_never_as_the_workloads_decision(clickhouse_client, clickhouse_dsn, tmp_path):
    """Found by an exploratory review: a `kubectl diff` (a server-side dry run) of a GPU pod that was
    never created read "not admitted: denied by gpuledger admit", and a dry run of a Workload before it
    was queued was its decision before admission. A dry run is listed apart ("dry run", status
    ``dry-run``), never the workload's decision — also as an older gpuledger admit recorded it."""
    import asyncio
    import uuid

    from sinks.agents import SinkWriters
    from sinks.migrations import migrate
    from tests.sinks.read.test_audit import dry_runs

    db = f"t_{uuid.uuid4().hex[:12]}"
    migrate(clickhouse_client, db)
    at = inc.T0 + timedelta(minutes=20)
    asyncio.run(SinkWriters(clickhouse_client, db).store_correlated([*inc.correlated_rows(), *dry_runs(at)]))
    env = {"GPULEDGER_CLICKHOUSE_DSN": clickhouse_dsn, "GPULEDGER_CLICKHOUSE_DATABASE": db, "GPULEDGER_DATA_DIR": str(tmp_path), "COLUMNS": "300"}
    runner = CliRunner()
    out = runner.invoke(cli_app, ["trace", "--workload", "risk/Pod/diffed", "--format", "json"], env=env)
    assert out.exit_code == 0, out.output
    result = json.loads(out.stdout)
    [section] = [w for w in result["workloads"] if w["workload_id"] == "risk/Pod/diffed"]
    assert section["admission_decisions"] == [], section["admission_decisions"]
    assert [(d["decision"], d["rule"], d["status"], d["dry_run"]) for d in section["dry_runs"]] == [("deny", "unknown-release", "dry-run", True)]
    assert not [g for g in result["gaps"] if "risk/Pod/diffed" in g], result["gaps"]
    tree = runner.invoke(cli_app, ["trace", "--workload", "risk/Pod/diffed"], env=env)
    assert tree.exit_code == 0, tree.output
    assert (f"dry run at {section['dry_runs'][0]['occurred_at']}: would be deny by rule unknown-release  (webhook, server-side dry run: "
            "nothing created, not enforcement)") in tree.stdout, tree.stdout
    assert "dry run only: gpuledger admit answered server-side dry runs of it (kubectl diff, --dry-run=server); nothing was created" in tree.stdout
    assert "denied" not in tree.stdout and "pod risk/diffed" not in tree.stdout, tree.stdout
    assert ("risk", "diffed") not in {(p["namespace"], p["pod"]) for p in result["pods"]} and not [g for g in result["gaps"] if "diffed" in g], result
    # The incident's Workload, diffed (by an older admit) a minute before it was queued: no decision of its own.
    out = runner.invoke(cli_app, ["trace", "--workload", inc.W7, "--at", AT.isoformat(), "--format", "json"], env=env)
    [section] = [w for w in json.loads(out.stdout)["workloads"] if w["workload_id"] == inc.W7]
    assert section["admission_decisions"] == [] and [d["status"] for d in section["dry_runs"]] == ["dry-run"], section
    tree = runner.invoke(cli_app, ["trace", "--workload", inc.W7, "--at", AT.isoformat()], env=env)
    assert "decision deny" not in tree.stdout and f"dry run at {section['dry_runs'][0]['occurred_at']}: would be deny" in tree.stdout, tree.stdout


def test_a_workload_the_admission_check_holds_pending_reads_waiting_not_denied(clickhouse_client, clickhouse_dsn, tmp_path):
    """From a review (an ML platform engineer running gpuledger admit): a Workload the
    AdmissionCheck controller holds Pending until its release is approved read "not admitted:
    denied by gpuledger admit" — a wait, which the approval ends with no resubmission, drawn as
    a refusal. Its recorded decision is ``deny``; the check state it set says which."""
    import asyncio
    import uuid

    from producers.releases import COMMANDS, build_event
    from sinks.agents import SinkWriters
    from sinks.migrations import migrate
    from streams.controls.admission import AdmissionState

    command = {c.name: c for c in COMMANDS}
    t = inc.T0 + timedelta(hours=4)
    state = AdmissionState()
    state.ready.set()

    def release(name: str, rid: str, at, **options) -> None:
        state.apply(build_event(command[name], {"release_id": rid, "at": at.isoformat(), **options}))

    def workload(name: str, rid: str) -> dict:
        labels = {"gpuledger.io/release-id": rid, "gpuledger.io/environment": "prod"}
        return {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload", "metadata": {"name": name, "namespace": "risk", "uid": f"uid-{name}"},
                "spec": {"queueName": "prod-inference", "podSets": [{"name": "main", "count": 1, "template": {"metadata": {"labels": labels},
                         "spec": {"containers": [{"name": "c", "resources": {"requests": {"nvidia.com/gpu": "1"}}}]}}}]}}

    def submitted(wid: str, rid: str, at):
        return inc._ce("scheduler", "scheduler.submitted", at, {"workload_id": wid, "namespace": "risk", "release_id": rid},
                       {"object_kind": "Workload", "queue": "prod-inference", "cluster_queue": "gpu-a100", "gpus_requested": 1})

    waiting, rejected = workload("job-ranker-12-x7k2p", "ranker-v12-prod"), workload("job-ranker-11-b8c4d", "ranker-v11-prod")
    w12, w11 = "risk/job-ranker-12-x7k2p", "risk/job-ranker-11-b8c4d"
    # v12: unknown when first decided, registered (still unapproved) when re-decided — Pending both times.
    first = inc.admission_check_row(waiting, state, t + timedelta(seconds=1))
    release("register", "ranker-v12-prod", t + timedelta(minutes=1), model="ranker", version="12", artifact_digest="sha256:" + "a" * 64)
    again = inc.admission_check_row(waiting, state, t + timedelta(minutes=2))
    # v11: approved then revoked — Rejected (Kueue deactivates the Workload).
    release("register", "ranker-v11-prod", t - timedelta(days=1), model="ranker", version="11", artifact_digest="sha256:" + "b" * 64)
    release("approve", "ranker-v11-prod", t - timedelta(hours=20), actor="alice", env="prod")
    release("revoke", "ranker-v11-prod", t - timedelta(hours=1), actor="alice", reason="drift")
    refused = inc.admission_check_row(rejected, state, t + timedelta(seconds=1))
    db = f"t_{uuid.uuid4().hex[:12]}"
    migrate(clickhouse_client, db)
    asyncio.run(SinkWriters(clickhouse_client, db).store_correlated(
        [submitted(w12, "ranker-v12-prod", t), first, again, submitted(w11, "ranker-v11-prod", t), refused]))
    env = {"GPULEDGER_CLICKHOUSE_DSN": clickhouse_dsn, "GPULEDGER_CLICKHOUSE_DATABASE": db, "GPULEDGER_DATA_DIR": str(tmp_path), "COLUMNS": "300"}
    at = (t + timedelta(minutes=5)).isoformat()
    runner = CliRunner()

    out = runner.invoke(cli_app, ["trace", "--workload", w12, "--at", at, "--format", "json"], env=env)
    assert out.exit_code == 0, out.output
    result = json.loads(out.stdout)
    [section] = [w for w in result["workloads"] if w["workload_id"] == w12]
    assert [(d["decision"], d["rule"], d["gate"], d["check_state"], d["status"]) for d in section["admission_decisions"]] == [
        ("deny", "unknown-release", "admission-check", "Pending", "waiting"), ("deny", "unapproved", "admission-check", "Pending", "waiting")]
    # Not admitted and no pod: what the wait means, not missing links.
    assert not [g for g in result["gaps"] if w12 in g], result["gaps"]
    tree = runner.invoke(cli_app, ["trace", "--workload", w12, "--at", at], env=env)
    assert tree.exit_code == 0, tree.output
    since, last = section["admission_decisions"][0]["occurred_at"], section["admission_decisions"][1]["occurred_at"]
    assert (f"waiting: held by gpuledger admit since {since} (rule unapproved, last decided {last}) — its AdmissionCheck is Pending until "
            "release ranker-v12-prod is approved for its environment (gpuledger release approve)") in tree.stdout, tree.stdout
    assert f"decision deny at {last} by rule unapproved  (AdmissionCheck Pending)" in tree.stdout, tree.stdout
    assert "denied" not in tree.stdout and "admission: <gap>" not in tree.stdout, tree.stdout

    out = runner.invoke(cli_app, ["trace", "--workload", w11, "--at", at, "--format", "json"], env=env)
    [section] = [w for w in json.loads(out.stdout)["workloads"] if w["workload_id"] == w11]
    [d] = section["admission_decisions"]
    assert (d["decision"], d["rule"], d["check_state"], d["status"]) == ("deny", "revoked", "Rejected", "denied"), d
    tree = runner.invoke(cli_app, ["trace", "--workload", w11, "--at", at], env=env)
    assert (f"not admitted: denied by gpuledger admit at {d['occurred_at']} (rule revoked) — its AdmissionCheck is Rejected "
            "(Kueue deactivates the Workload)") in tree.stdout, tree.stdout
    assert "waiting" not in tree.stdout, tree.stdout


def test_a_workload_by_namespace_and_name_is_the_one_workload_of_that_name_else_the_form_is_named(clickhouse_client, clickhouse_dsn, tmp_path):
    """From a review: `trace --workload ns/name` of a Job, whose workload id is `ns/Job/name`,
    matched nothing and said nothing of the form an id has. The one workload of that namespace
    and name is traced, saying so; several are listed; none names the form."""
    import asyncio
    import uuid

    from sinks.agents import SinkWriters
    from sinks.migrations import migrate

    t = inc.T0 + timedelta(hours=5)

    def rows(wid: str, pod: str) -> list:
        ident = {"workload_id": wid, "namespace": "ml"}
        return [inc._ce("scheduler", "scheduler.submitted", t, ident, {"object_kind": "Workload", "queue": "research"}),
                inc._ce("scheduler", "scheduler.scheduled", t + timedelta(seconds=5), {**ident, "pod": pod, "node": "node-c"},
                        {"object_kind": "Pod"})]

    db = f"t_{uuid.uuid4().hex[:12]}"
    migrate(clickhouse_client, db)
    asyncio.run(SinkWriters(clickhouse_client, db).store_correlated(
        [*rows("ml/Job/train", "train-x1"), *rows("ml/job-sweep-1a2b3", "sweep-x1"), *rows("ml/Job/eval", "eval-x1"),
         *rows("ml/JobSet/eval", "eval-js-x1"), *rows("ml/Job/train-long", "train-long-x1")]))
    env = {"GPULEDGER_CLICKHOUSE_DSN": clickhouse_dsn, "GPULEDGER_CLICKHOUSE_DATABASE": db, "GPULEDGER_DATA_DIR": str(tmp_path), "COLUMNS": "400"}
    runner = CliRunner()

    def run(value: str, *more: str):
        return runner.invoke(cli_app, ["trace", "--workload", value, *more], env=env)

    # The Job's workload by its namespace and name: the same chain as by its id, and the note says which it traced.
    out = run("ml/train", "--format", "json")
    assert out.exit_code == 0, out.output
    got, exact = json.loads(out.stdout), json.loads(run("ml/Job/train", "--format", "json").stdout)
    assert got["entry"]["root"] == {"kind": "workload", "id": "ml/Job/train"} and got["entry"]["workload_id"] == "ml/Job/train", got["entry"]
    assert [w["workload_id"] for w in got["workloads"]] == ["ml/Job/train"], got["workloads"]
    assert {k: v for k, v in chain_of(got).items() if k != "gaps"} == {k: v for k, v in chain_of(exact).items() if k != "gaps"}
    assert got["gaps"][0].startswith("no workload has id ml/train; traced ml/Job/train, the one workload named train in ml"), got["gaps"]
    # A Kueue-queued Job's workload is its Kueue Workload (job-<name>-<hash>): by namespace and name, or by its Job's form.
    for value in ("ml/sweep", "ml/Job/sweep"):
        out = run(value, "--format", "json")
        assert out.exit_code == 0 and json.loads(out.stdout)["entry"]["root"] == {"kind": "workload", "id": "ml/job-sweep-1a2b3"}, out.output
    # Several kinds of that name: listed, none picked.
    several = run("ml/eval")
    assert several.exit_code == 4, several.output
    assert "2 workloads named eval in ml: ml/Job/eval, ml/JobSet/eval — trace one of them with --workload" in several.stdout, several.stdout
    # None: the form an id has.
    none = run("ml/nothing")
    assert none.exit_code == 4, none.output
    assert ("no workload has id ml/nothing, nor any workload named nothing in ml: a workload id is NAMESPACE/NAME of its Kueue Workload "
            "(ml/job-nothing-<hash> for a queued Job nothing) or else NAMESPACE/KIND/NAME of what owns its pods (ml/Job/nothing, ") in none.stdout, none.stdout
    alone = run("train")
    assert alone.exit_code == 4 and "no workload has id 'train': " in alone.stdout and "NS/Job/train" in alone.stdout, alone.stdout


def test_the_webhooks_deferral_of_a_queued_job_is_under_its_kueue_workload(clickhouse_client, clickhouse_dsn, tmp_path):
    """From a review: the webhook's deferral of a Kueue-queued Job (to the AdmissionCheck) is
    recorded under the Job's id, NS/Job/NAME — Kueue has made no Workload yet — and trace drew it
    as a second workload full of <gap>s beside the Workload (NS/job-NAME-<hash>) the check then
    held. It is that Workload's (by its kueue.x-k8s.io/job-uid label); one whose Workload the
    store does not have is shown as a deferral."""
    import asyncio
    import uuid

    from producers.releases import COMMANDS, build_event
    from sinks.agents import SinkWriters
    from sinks.migrations import migrate
    from streams.controls.admission import AdmissionState
    from streams.controls.policy import Admission, NamespaceAdmission, Policy

    command = {c.name: c for c in COMMANDS}
    t = inc.T0 + timedelta(hours=6)
    state = AdmissionState()
    state.ready.set()
    for rid in ("ranker-v12-prod", "ranker-v13-prod"):
        state.apply(build_event(command["register"], {"release_id": rid, "at": (t - timedelta(hours=1)).isoformat(), "model": "ranker",
                                                      "version": rid.split("-")[1], "artifact_digest": "sha256:" + "a" * 64}))
    policy = Policy(admission=Admission(namespaces={"ml": NamespaceAdmission(gate="admission-check")}))

    def job(name: str, rid: str) -> dict:
        labels = {"gpuledger.io/release-id": rid, "gpuledger.io/environment": "prod"}
        return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "namespace": "ml", "uid": f"uid-job-{name}",
                                                                       "labels": {**labels, "kueue.x-k8s.io/queue-name": "research"}},
                "spec": {"suspend": True, "template": {"metadata": {"labels": labels}, "spec": {"containers": [
                    {"name": "c", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}}}

    # Kueue's Workload for Job train (its job-uid label names the Job), held Pending by the AdmissionCheck.
    labels = {"gpuledger.io/release-id": "ranker-v12-prod", "gpuledger.io/environment": "prod"}
    workload = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
                "metadata": {"name": "job-train-4f2a1", "namespace": "ml", "uid": "uid-wl-train",
                             "labels": {"kueue.x-k8s.io/job-uid": "uid-job-train"}},
                "spec": {"queueName": "research", "podSets": [{"name": "main", "count": 1, "template": {"metadata": {"labels": labels},
                         "spec": {"containers": [{"name": "c", "resources": {"requests": {"nvidia.com/gpu": "1"}}}]}}}]}}
    kueue_wl = "ml/job-train-4f2a1"
    submitted = inc._ce("scheduler", "scheduler.submitted", t + timedelta(seconds=1),
                        {"workload_id": kueue_wl, "namespace": "ml", "release_id": "ranker-v12-prod"},
                        {"object_kind": "Workload", "queue": "research", "labels": {"kueue.x-k8s.io/job-uid": "uid-job-train"}})
    deferral = inc.webhook_row(job("train", "ranker-v12-prod"), state, t, policy)
    orphan = inc.webhook_row(job("orphan", "ranker-v13-prod"), state, t, policy)
    assert json.loads(deferral.payload_json)["rule"] == "deferred-to-admission-check" and deferral.identity.workload_id == "ml/Job/train"
    db = f"t_{uuid.uuid4().hex[:12]}"
    migrate(clickhouse_client, db)
    asyncio.run(SinkWriters(clickhouse_client, db).store_correlated(
        [deferral, submitted, inc.admission_check_row(workload, state, t + timedelta(seconds=2)), orphan]))
    env = {"GPULEDGER_CLICKHOUSE_DSN": clickhouse_dsn, "GPULEDGER_CLICKHOUSE_DATABASE": db, "GPULEDGER_DATA_DIR": str(tmp_path), "COLUMNS": "300"}
    at = (t + timedelta(minutes=5)).isoformat()
    runner = CliRunner()

    def run(value: str, *more: str):
        out = runner.invoke(cli_app, ["trace", "--workload", value, "--at", at, *more], env=env)
        assert out.exit_code == 0, out.output
        return out.stdout

    got = json.loads(run(kueue_wl, "--format", "json"))
    [section] = got["workloads"]
    assert section["workload_id"] == kueue_wl, got["workloads"]
    assert [(d["rule"], d["status"], d.get("recorded_as")) for d in section["admission_decisions"]] == [
        ("deferred-to-admission-check", "deferred", "ml/Job/train"), ("unapproved", "waiting", None)], section["admission_decisions"]
    # By the Job's id, the same chain (the id the decision was recorded under still finds it); argMax reads the same.
    assert chain_of(json.loads(run("ml/Job/train", "--format", "json"))) == chain_of(got)
    argmax = trace(DirectReader(clickhouse_client), db, "workload", kueue_wl, at=t + timedelta(minutes=5), mode="argmax")
    assert json.loads(json.dumps(chain_of(argmax), default=str)) == chain_of(got)
    tree = run(kueue_wl)
    assert [line.split("── ", 1)[1].split("  ")[0] for line in tree.splitlines() if "── workload " in line] == [f"workload {kueue_wl}"], tree
    deferred_at = section["admission_decisions"][0]["occurred_at"]
    assert f"decision allow at {deferred_at} by rule deferred-to-admission-check  (webhook, recorded as ml/Job/train)" in tree, tree
    # By the Job's namespace and name: its Workload, not a choice between it and its deferral.
    assert json.loads(run("ml/train", "--format", "json"))["entry"]["workload_id"] == kueue_wl

    # A Job whose Workload the store does not have: what it is, not a workload of gaps.
    tree = run("ml/Job/orphan")
    assert "workload ml/Job/orphan  queue=- cluster_queue=- priority=-" in tree, tree
    assert (f"deferred: let in by gpuledger admit's webhook at {deferred_at} for the AdmissionCheck to decide on its Kueue Workload "
            "(rule deferred-to-admission-check); no Workload in the store carries its uid") in tree, tree
    assert "admission: <gap>" not in tree, tree


def test_each_eviction_line_names_its_pod():
    """A workload's pods evicted together printed as identical 'evicted <time> <reason>' lines."""
    from sinks.read.tree import render_tree, tree_text

    at = "2026-11-30T13:00:00.000Z"
    evictions = [{"occurred_at": at, "event_type": "scheduler.evicted", "namespace": "risk", "pod": f"p-{i}",
                  "reason": "EvictionByEvictionAPI", "correlation_id": f"c{i}"} for i in range(2)]
    result = {"entry": {"kind": "workload", "value": "risk/w", "root": {"kind": "workload", "id": "risk/w"}},
              "workloads": [{"workload_id": "risk/w", "admitted_at": None, "admissions": [], "preemptions": [], "evictions": evictions,
                             "pods": []}]}
    lines = [line for line in tree_text(render_tree(result), width=200).splitlines() if "evicted" in line]
    assert [line.split("evicted", 1)[1].strip() for line in lines] == [f"risk/p-{i} {at}  EvictionByEvictionAPI" for i in range(2)], lines


def test_a_replaced_release_says_so_and_a_restored_one_too(clickhouse_client):
    """From an exploratory review (a responder at 3 a.m.): v6, replaced in prod by v7's promotion,
    traced as `state=release.promoted` with nothing saying v7 had replaced it — or, after the
    rollback, that v6 served again. Its own rows say neither; v7's name it (superseded_release_id)."""
    from sinks.read.tree import render_tree, tree_text

    db = inc.load_store(clickhouse_client)
    reader = DirectReader(clickhouse_client)
    during = trace(reader, db, "release", inc.R6, at=AT)  # v7 in prod, v6 replaced
    rel = during["release"]
    assert rel["lifecycle_state"] == "release.promoted" and rel["replaced_by"] == {
        "occurred_at": "2026-11-30T12:15:00.000Z", "event": "replaced", "by": inc.R7, "to_environment": "prod"}, rel
    text = tree_text(render_tree(during), width=250)
    assert f"replaced by {inc.R7} at 2026-11-30T12:15:00.000Z" in text.splitlines()[2] or f"replaced by {inc.R7} at" in text, text
    assert f"2026-11-30T12:15:00.000Z  replaced by {inc.R7} (promoted to prod)" in text, text
    after = trace(reader, db, "release", inc.R6)  # the rollback restored it
    assert "replaced_by" not in after["release"], after["release"]
    assert [(s["event"], s["by"]) for s in after["release"]["succession"]] == [("replaced", inc.R7), ("restored", inc.R7)]
    assert f"2026-11-30T13:30:00.000Z  restored by the rollback of {inc.R7}" in tree_text(render_tree(after), width=250)
    # v7's own line: its rollback's reason, which its summary leaves out.
    v7 = tree_text(render_tree(trace(reader, db, "release", inc.R7)), width=250)
    assert re.search(r"2026-11-30T13:30:00\.000Z  release\.rolled_back .*reason precision regression", v7), v7


def test_an_evaluation_after_the_promotion_does_not_make_the_release_look_unpromoted(clickhouse_client):
    """From the same review: a scheduled re-evaluation of a serving release made its trace read
    `state=release.evaluated` and no lifecycle beside it — as if never promoted."""
    import asyncio

    from sinks.agents import SinkWriters

    db = inc.load_store(clickhouse_client)
    at = inc.T0 + timedelta(minutes=40)  # v7 promoted at +15
    row = inc._ce("release", "release.evaluated", at, {"release_id": inc.R7, **inc.MANIFEST7}, {"actor": "ci"},
                  attribution="release_event", release_state="release.evaluated")
    asyncio.run(SinkWriters(clickhouse_client, db).store_correlated([row]))
    rel = trace(DirectReader(clickhouse_client), db, "release", inc.R7, at=AT)["release"]
    assert (rel["state"], rel["lifecycle_state"], rel["lifecycle_since"]) == ("release.evaluated", "release.promoted", "2026-11-30T12:15:00.000Z"), rel


def test_the_controls_violations_about_the_chain_are_in_the_trace(clickhouse_client):
    """From the same review: a trace showed no gap and `state=release.approved` for a workload
    whose release was never promoted to prod — control 2's open violation was only in `audit`.
    The trace lists the violations about its release, workloads and pods as they stood at --at
    (open then even if closed later), withdrawn ones left out, other releases' not at all."""
    import asyncio

    from schemas import Violation
    from schemas.envelope import Identity
    from sinks.agents import SinkWriters
    from sinks.read.tree import render_tree, tree_text

    db = inc.load_store(clickhouse_client)
    m = lambda minutes: inc.T0 + timedelta(minutes=minutes)  # noqa: E731
    violations = [
        Violation(violation_id="v-open", version=0, control_id=2, title="Runs where not promoted", severity="critical",
                  identity=Identity(release_id=inc.R7, workload_id=inc.W7), evidence=("e1",), opened_at=m(20), detail="runs in prod unpromoted"),
        Violation(violation_id="v-closed", version=1, control_id=8, title="Retired release holds capacity", severity="warning",
                  identity=Identity(namespace="risk", pod=inc.P2), evidence=("e2",), opened_at=m(30), closed_at=m(80), detail="held after retirement"),
        Violation(violation_id="v-withdrawn", version=1, control_id=1, title="Admitted without approval", severity="critical",
                  identity=Identity(release_id=inc.R7), evidence=("e3",), opened_at=m(25), closed_at=m(25), detail="withdrawn: approval predates it"),
        Violation(violation_id="v-other", version=0, control_id=2, title="Runs where not promoted", severity="critical",
                  identity=Identity(release_id="someone-else"), evidence=("e4",), opened_at=m(20), detail="not ours"),
        Violation(violation_id="v-later", version=0, control_id=3, title="Image mismatch", severity="warning",
                  identity=Identity(release_id=inc.R7), evidence=("e5",), opened_at=m(75), detail="opened after --at"),
    ]
    asyncio.run(SinkWriters(clickhouse_client, db).store_violations(violations))
    result = trace(DirectReader(clickhouse_client), db, "release", inc.R7, at=AT)
    got = [(v["violation_id"], v["open"], v["closed_at"]) for v in result["violations"]]
    assert got == [("v-open", True, None), ("v-closed", True, None)], result["violations"]  # v-closed closed at +80, after --at (+70)
    now = trace(DirectReader(clickhouse_client), db, "release", inc.R7)
    assert [(v["violation_id"], v["open"]) for v in now["violations"]] == [("v-open", True), ("v-closed", False), ("v-later", True)]
    text = tree_text(render_tree(result), width=250)
    assert "violations of the controls about this chain as of" in text, text
    assert ("control 2 Runs where not promoted (critical): opened 2026-11-30T12:20:00.000Z, open — runs in prod unpromoted") in text, text
    assert "withdrawn" not in text and "not ours" not in text


def test_a_gpu_idle_now_says_its_chain_is_its_last_holders(clickhouse_client):
    """From the same review: `trace --gpu` of a GPU nobody holds now traced to its last holder's
    release with no word of it (the note was only given with --at)."""
    import asyncio

    from schemas import GpuAllocation
    from schemas.envelope import Identity
    from sinks.agents import SinkWriters

    db = inc.load_store(clickhouse_client)
    ended = GpuAllocation(allocation_id="al-p2", version=2, node="node-b", gpu_id=inc.GPU_B, gpu=inc.GPU_B, namespace="risk",
                          pod=inc.P2, container="main", attribution="workload_release", started_at=inc.T0 + timedelta(minutes=62.5),
                          ended_at=inc.T0 + timedelta(minutes=91), end_reason="released", start_event_id="assign-al-p2",
                          end_event_id="release-al-p2", identity=Identity(release_id=inc.R7, workload_id=inc.W7, namespace="risk", pod=inc.P2,
                                                                           node="node-b", gpu_id=inc.GPU_B, pod_uid=f"uid-{inc.P2}"))
    asyncio.run(SinkWriters(clickhouse_client, db).store_allocations([ended]))
    result = trace(DirectReader(clickhouse_client), db, "gpu", f"node-b/{inc.GPU_B}")
    assert result["release"]["release_id"] == inc.R7
    assert f"no allocation holds node-b/{inc.GPU_B} now; the last one ended at 2026-11-30T13:31:00.000Z (the chain is its holder's)" in result["gaps"], result["gaps"]
    held = trace(DirectReader(clickhouse_client), db, "gpu", f"node-b/{inc.GPU_B}", at=AT)  # held then: no such note
    assert not [g for g in held["gaps"] if "no allocation hold" in g], held["gaps"]


def test_an_optional_manifest_field_missing_is_not_drawn_as_a_gap():
    """From the same review: `dataset_ref: <gap>` in red, though the gaps list (rightly) does not
    name it — a manifest may lack it. A required field missing stays a gap."""
    from sinks.read.tree import render_tree, tree_text

    result = {"entry": {"kind": "release", "value": "r1"}, "release": {"release_id": "r1", "state": "release.registered",
              "model_name": "m", "model_version": "1", "artifact_digest": "sha256:a", "image_digest": "sha256:b", "config_digest": None,
              "dataset_ref": None, "owner": "team", "environment": None, "lifecycle": []}, "workloads": [], "pods": [], "gpus": [],
              "scheduler_events": [], "alerts": [], "violations": [], "gaps": []}
    text = tree_text(render_tree(result), width=200)
    assert "dataset_ref: -" in text and "environment: -" in text, text
    assert "config_digest: <gap>" in text, text


def test_a_decision_within_the_second_of_a_whole_second_admission_reads_before_it_as_in_the_audit():
    """From the same review: the enforced exercise's decision at 11:22:44.608 sat above "admitted
    11:22:44.000" with no "before" — the audit's table (Kubernetes times have whole seconds: the
    API server stamps before it asks the webhook) called it before. One rule for both."""
    from sinks.read.tree import render_tree, tree_text

    wl = {"workload_id": "ns/job-a", "admitted_at": "2026-12-06T11:22:44.000Z", "admissions": ["2026-12-06T11:22:44.000Z"],
          "admission_decisions": [{"decision": "allow", "occurred_at": "2026-12-06T11:22:44.608Z", "rule": "approved"}]}
    result = {"entry": {"kind": "workload", "value": "ns/job-a"}, "release": None, "workloads": [wl], "pods": [], "gpus": [],
              "scheduler_events": [], "alerts": [], "violations": [], "gaps": []}
    text = tree_text(render_tree(result), width=200)
    assert "decision allow at 2026-12-06T11:22:44.608Z by rule approved, before admission at 2026-12-06T11:22:44.000Z" in text, text
    late = {**wl, "admission_decisions": [{"decision": "allow", "occurred_at": "2026-12-06T11:22:45.001Z", "rule": "approved"}]}
    assert "before admission" not in tree_text(render_tree({**result, "workloads": [late]}), width=200)


def test_a_denied_workload_is_not_drawn_as_a_missing_admission_and_a_zero_window_says_so():
    """From the same review: a workload gpuledger admit denied showed `admission: <gap>` in red —
    a denial is the outcome expected; and `--window 0`'s header still described a window."""
    from sinks.read.tree import render_tree, tree_text

    denied = {"workload_id": "ns/job-a", "admissions": [],
              "admission_decisions": [{"decision": "deny", "occurred_at": "2026-12-06T11:22:44.608Z", "rule": "unapproved"}]}
    result = {"entry": {"kind": "workload", "value": "ns/job-a"}, "release": None, "workloads": [denied], "pods": [], "gpus": [],
              "scheduler_events": [], "alerts": [], "violations": [], "gaps": [],
              "window": {"from": "2026-12-06T11:22:44.608Z", "to": "2026-12-06T11:22:44.608Z", "anchor": "--at"}}
    text = tree_text(render_tree(result), width=200)
    assert "not admitted: denied by gpuledger admit at 2026-12-06T11:22:44.608Z (rule unapproved)" in text and "admission: <gap>" not in text, text
    # Nor its queue, cluster queue and priority, which nothing can know of a workload the scheduler never saw.
    assert "workload ns/job-a  queue=- cluster_queue=- priority=-" in text, text
    assert "no window (--window 0): only the chain's own rows" in text and "other workloads, alerts" not in text, text
    never = {**denied, "admission_decisions": []}
    never_text = tree_text(render_tree({**result, "workloads": [never]}), width=200)
    assert "admission: <gap>" in never_text and "queue=<gap>" in never_text, never_text


def test_a_workloads_events_within_one_second_keep_the_order_they_were_seen_in(clickhouse_client):
    """Kubernetes times are whole seconds: a submission, quota reservation and admission in one
    second were ordered by correlation id (a hash), and the workload read 'submitted'."""
    import asyncio
    import uuid

    from schemas import CorrelatedEvent, Identity
    from sinks.agents import SinkWriters
    from sinks.migrations import migrate

    db = f"t_{uuid.uuid4().hex[:12]}"
    migrate(clickhouse_client, db)
    at = inc.T0 + timedelta(hours=3)
    wl = "risk/same-second"
    seen = ["scheduler.submitted", "scheduler.quota_reserved", "scheduler.admitted"]
    rows = [CorrelatedEvent(correlation_id=f"c-{3 - i}", version=0, event_type=etype, occurred_at=at, attribution="unattributed",
                            identity=Identity(workload_id=wl, namespace="risk"), summary=etype, source_topic="test.scheduler.v1",
                            source_partition=2, source_offset=100 + i,
                            payload_json='{"object_kind": "Workload", "queue": "' + ("early" if i == 0 else "prod") + '"}')
            for i, etype in enumerate(seen)]
    asyncio.run(SinkWriters(clickhouse_client, db).store_correlated(list(reversed(rows))))
    [section] = trace(DirectReader(clickhouse_client), db, "workload", wl, at=at + timedelta(minutes=1))["workloads"]
    assert [e["event_type"] for e in section["events"]] == seen, section["events"]
    assert (section["state"], section["queue"], section["admitted_at"]) == ("scheduler.admitted", "prod", section["admissions"][0])


def test_a_gpu_by_its_dcgm_index_is_the_gpu_a_dcgm_alert_maps_it_to(clickhouse_client):
    """A responder reads `node-b/1` off a DCGM dashboard; the allocations name GPUs by UUID only
    (`n3/0` matched nothing). A DCGM alert's labels map the index to the UUID."""
    import asyncio

    from sinks.agents import SinkWriters

    db = inc.load_store(clickhouse_client)
    at = inc.T0 + timedelta(minutes=64)
    labels = {"alertname": "GpuXidError", "Hostname": "node-b", "gpu": "1", "UUID": inc.GPU_B, "xid": "79"}
    xid = inc._ce("alert", "alert.firing", at, {"alert_fingerprint": "fp-dcgm", "node": "node-b", "gpu_id": inc.GPU_B},
                  {"alertname": "GpuXidError", "severity": "warning", "labels": labels, "annotations": {}, "starts_at": at.isoformat()},
                  attribution="unattributed", summary="GpuXidError (warning) firing", key="fp-dcgm")
    asyncio.run(SinkWriters(clickhouse_client, db).store_correlated([xid]))
    reader = DirectReader(clickhouse_client)
    by_index = trace(reader, db, "gpu", "node-b/1", at=AT)
    by_uuid = trace(reader, db, "gpu", f"node-b/{inc.GPU_B}", at=AT)
    assert by_index["entry"]["root"] == by_uuid["entry"]["root"] == {"kind": "release", "id": inc.R7}, by_index["entry"]
    assert {k: v for k, v in chain_of(by_index).items() if k != "gaps"} == {k: v for k, v in chain_of(by_uuid).items() if k != "gaps"}
    assert f"node-b/1 is the DCGM index of {inc.GPU_B} (labels of alert fp-dcgm at {at.isoformat().replace('+00:00', '.000Z')})" in by_index["gaps"]
    unknown = trace(reader, db, "gpu", "node-b/7", at=AT)
    assert unknown["entry"]["root"] is None
    assert any("no DCGM alert in the store maps index 7 of node-b" in g for g in unknown["gaps"]), unknown["gaps"]


@pytest.mark.parametrize(("flag", "value", "form"), [("--gpu", "n3", "NODE/GPU_ID"), ("--pod", "just-a-name", "NAMESPACE/NAME")])
def test_a_malformed_entry_point_is_named_before_the_store_is_opened(flag, value, form, tmp_path):
    """From an exploratory review: `trace --gpu n3` against a store that does not answer said
    the store was down (exit 1) — the flag's form is the person's to fix either way."""
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"GPULEDGER_CLICKHOUSE_DSN": f"http://127.0.0.1:{port}", "GPULEDGER_DATA_DIR": str(tmp_path), "COLUMNS": "200"}
    out = CliRunner().invoke(cli_app, ["trace", flag, value], env=env)
    assert out.exit_code == 2, out.output
    assert f"expected {form}" in out.output and "cannot connect" not in out.output, out.output
    if flag == "--gpu":  # a node alone: how to name one of its GPUs
        assert "n3/<GPU UUID> or n3/<DCGM index>" in out.output and "WHERE node = 'n3'" in out.output, out.output


def test_a_gpu_no_allocation_held_but_alerts_name_is_its_latest_alerts_chain(clickhouse_client):
    """From an exploratory review: `trace --gpu n0/GPU-0003` said "matches nothing in the store"
    (exit 4) with 83 alerts naming that GPU — an idle GPU failing looked unknown."""
    import asyncio

    from sinks.agents import SinkWriters

    db = inc.load_store(clickhouse_client)
    reader = DirectReader(clickhouse_client)
    assert trace(reader, db, "gpu", "node-z/GPU-idle-1", at=AT)["entry"]["root"] is None
    at = inc.T0 + timedelta(minutes=50)
    labels = {"alertname": "GpuXidError", "Hostname": "node-z", "gpu": "3", "UUID": "GPU-idle-1"}
    xid = inc._ce("alert", "alert.firing", at, {"alert_fingerprint": "fp-idle", "node": "node-z", "gpu_id": "GPU-idle-1"},
                  {"alertname": "GpuXidError", "severity": "warning", "labels": labels, "annotations": {}, "starts_at": at.isoformat()},
                  attribution="unattributed", summary="GpuXidError (warning) firing", key="fp-idle")
    asyncio.run(SinkWriters(clickhouse_client, db).store_correlated([xid]))
    result = trace(reader, db, "gpu", "node-z/GPU-idle-1", at=AT)
    assert result["entry"]["root"] == {"kind": "alert", "id": "fp-idle"}, result["entry"]
    assert any(g.startswith("no allocation held node-z/GPU-idle-1 by ") and "1 alert(s) name it" in g and "GpuXidError fp-idle" in g
               for g in result["gaps"]), result["gaps"]
    assert [a["alert_fingerprint"] for a in result["alerts"] if a["in_chain"]] == ["fp-idle"]
    # The alert's own chain is unchanged by it (an alert entry does not look for other alerts of its GPU).
    assert trace(reader, db, "alert", "fp-idle", at=AT)["entry"]["root"] == {"kind": "alert", "id": "fp-idle"}


def test_a_release_traced_in_another_spelling_of_its_id_is_found(clickhouse_client, clickhouse_dsn, tmp_path):
    """`release approve --release-id "$(printf 'cafe\\u0301:1')"` then `trace --release
    "$(printf 'caf\\u00e9:1')"` matched nothing (exploratory review): identifiers are stored in
    NFC and the trace's entry point is read in NFC, so either spelling finds the release."""
    import asyncio

    from sinks.agents import SinkWriters

    nfd, nfc = "cafe\u0301:1", "caf\u00e9:1"
    db = inc.load_store(clickhouse_client)
    row = inc._ce("release", "release.approved", inc.T0, {"release_id": nfd, "model_name": "cafe\u0301", "model_version": "1"},
                  {"actor": "alice", "approval_id": "CHG-7"}, attribution="release_event", release_state="release.approved")
    asyncio.run(SinkWriters(clickhouse_client, db).store_correlated([row]))
    env = {"GPULEDGER_CLICKHOUSE_DSN": clickhouse_dsn, "GPULEDGER_CLICKHOUSE_DATABASE": db, "GPULEDGER_DATA_DIR": str(tmp_path),
           "COLUMNS": "200"}
    for spelling in (nfc, nfd):
        out = CliRunner().invoke(cli_app, ["trace", "--release", spelling, "--format", "json"], env=env)
        assert out.exit_code == 0, (ascii(spelling), out.output)
        got = json.loads(out.stdout)
        assert got["entry"]["root"] == {"kind": "release", "id": nfc} and got["release"]["state"] == "release.approved", got["release"]


def test_an_alerts_earlier_episode_is_listed_without_pulling_its_pod_into_the_chain(clickhouse_client):
    """An exploratory review: an alert that fired, resolved and fired again on another pod — the
    trace of its latest firing took the earlier firing's pod into the chain after the chain's
    allocations were read, and said "no GPU allocation seen" of a pod that held the GPU. The
    earlier episode is listed (not in the chain); its pod is not in the chain."""
    import asyncio

    from sinks.agents import SinkWriters

    db = inc.load_store(clickhouse_client)
    starts, ends = inc.T0 + timedelta(minutes=61), inc.T0 + timedelta(minutes=63)
    ident = {"alert_fingerprint": inc.FP, "namespace": "training", "pod": inc.PT, "workload_id": inc.WT, "node": "node-a",
             "gpu_id": inc.GPU_A}
    payload = {"alertname": "ModelQualityDegraded", "severity": "critical", "labels": {"namespace": "training", "pod": inc.PT},
               "starts_at": starts.isoformat()}
    earlier = [inc._ce("alert", "alert.firing", starts, ident, payload, attribution="gpu_assignment", key="earlier-firing"),
               inc._ce("alert", "alert.resolved", ends, ident, {**payload, "ends_at": ends.isoformat()}, attribution="gpu_assignment",
                       key="earlier-resolved")]
    asyncio.run(SinkWriters(clickhouse_client, db).store_correlated(earlier))
    result = trace(DirectReader(clickhouse_client), db, "alert", inc.FP, window=timedelta(0))
    assert result["release"]["release_id"] == inc.R7
    assert {(p["namespace"], p["pod"]) for p in result["pods"]} == {("risk", inc.P1), ("risk", inc.P2)}, result["pods"]
    assert not [g for g in result["gaps"] if inc.PT in g], result["gaps"]
    listed = {(a["starts_at"][:16], a["status"], a["in_chain"]) for a in result["alerts"] if a["alert_fingerprint"] == inc.FP}
    assert ("2026-11-30T13:01", "firing", False) in listed and ("2026-11-30T13:01", "resolved", False) in listed, listed
    assert ("2026-11-30T13:05", "firing", True) in listed, listed
