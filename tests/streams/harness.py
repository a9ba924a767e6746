"""An in-memory driver of the entity join, for tests: the same pure functions the
Faust agents call (routing, fold, refresh, forwards, expiry), with Kafka replaced
by an ordered queue. Used to check join rules and order-independence quickly; the
real-broker tests in test_app.py check the same rules through the worker."""

from __future__ import annotations

import random
from datetime import datetime, timedelta, timezone


from schemas import AlertEvent, CorrelatedEvent, GpuAllocation, GpuEvent, Identity, ReleaseEvent, SchedulerEvent, Source, encode_event, make_event_id
from schemas.alert import AlertPayload
from schemas.gpu import GpuPayload
from schemas.release import ReleasePayload
from schemas.scheduler import SchedulerPayload
import streams.correlate.entities
from producers.podresources.snapshot import parse_device_id
from streams.correlate.directory import ReleaseDirectory
from streams.correlate.entities import GpuMemo, event_row, expire, fold_link, fold_row, for_controls, new_entity, refresh
from streams.correlate.routing import entity_key, routed_event
from streams.packing import kind_of

streams.correlate.entities.VERIFY_UNCHANGED = True  # the tests catch a content change without a version change
T0 = datetime(2026, 11, 1, 8, tzinfo=timezone.utc)
SRC = Source(collector="test")


def at(minutes: float) -> datetime:
    return T0 + timedelta(minutes=minutes)


def release(etype, minutes, rid="r1", model="m", version="7", env="prod", digest="sha256:" + "b" * 64, **payload):
    ident = Identity(release_id=rid, model_name=model, model_version=version, environment=env, image_digest=digest,
                     artifact_digest="sha256:" + "a" * 64, owner="team-" + model)
    return ReleaseEvent(event_id=make_event_id("t", (rid, etype), at(minutes).isoformat()), event_type=etype,
                        occurred_at=at(minutes), observed_at=at(minutes), source=SRC, identity=ident, payload=ReleasePayload(**payload))


def pod_event(etype, minutes, ns="ml", pod="p1", workload="ml/Job/train", node="n1", release_id=None, digest=None, **ident):
    return SchedulerEvent(event_id=make_event_id("t", (ns, pod, etype), at(minutes).isoformat()), event_type=etype,
                          occurred_at=at(minutes), observed_at=at(minutes), source=SRC,
                          identity=Identity(namespace=ns, pod=pod, workload_id=workload, node=node, release_id=release_id, **ident),
                          payload=SchedulerPayload(object_kind="Pod", image_digests=(digest,) if digest else ()))


def gpu_event(etype, minutes, ns="ml", pod="p1", node="n1", device="GPU-1111", container="main", resource="nvidia.com/gpu"):
    """A pod-resources event, its device id parsed as the collector parses it."""
    ref = parse_device_id(device)
    return GpuEvent(event_id=make_event_id("t", (node, ns, pod, device, etype), at(minutes).isoformat()), event_type=etype,
                    occurred_at=at(minutes), observed_at=at(minutes), source=SRC, identity=Identity(namespace=ns, pod=pod, node=node, gpu_id=device),
                    payload=GpuPayload(node=node, namespace=ns, pod=pod, container=container, device_id=device, resource_name=resource,
                                       gpu=ref.gpu, mig_instance=ref.mig_instance, share=ref.share))


def dra_device(minutes, node="n1", driver="gpu.nvidia.com", pool="n1", device="gpu-0", uuid="GPU-1111", parent=None, profile=None):
    """A ``gpu.device`` as the scheduler collector publishes it from a ResourceSlice."""
    device_id = f"{driver}/{pool}/{device}"
    mig = uuid if parent else None
    return GpuEvent(event_id=make_event_id("t", (node, device_id, uuid), at(minutes).isoformat()), event_type="gpu.device",
                    occurred_at=at(minutes), observed_at=at(minutes), source=SRC, identity=Identity(node=node, gpu_id=device_id),
                    payload=GpuPayload(node=node, resource_name=driver, device_id=device_id, gpu=parent or uuid, mig_instance=mig,
                                       driver=driver, pool=pool, profile=profile))


def claim_event(etype, minutes, ns="ml", pod="p1", pod_uid="uid-p1", node="n1", driver="gpu.nvidia.com", pool="n1", device="gpu-0",
                claim="p1-gpu-x7k2q", reason=None):
    """A ``gpu.claim_reserved`` / ``gpu.claim_released`` as the scheduler collector publishes it from a ResourceClaim."""
    device_id = f"{driver}/{pool}/{device}"
    return GpuEvent(event_id=make_event_id("t", (claim, etype, pod_uid, device_id), at(minutes).isoformat()), event_type=etype,
                    occurred_at=at(minutes), observed_at=at(minutes), source=SRC,
                    identity=Identity(namespace=ns, pod=pod, pod_uid=pod_uid, node=node, gpu_id=device_id),
                    payload=GpuPayload(node=node, namespace=ns, pod=pod, resource_name=driver, device_id=device_id, driver=driver, pool=pool,
                                       claim=claim, claim_uid=f"uid-{claim}", request="gpu", reason=reason))


def alert(minutes, fp="fp1", labels=None, **ident):
    return AlertEvent(event_id=make_event_id("am", (fp, "firing", at(minutes).isoformat())), event_type="alert.firing",
                      occurred_at=at(minutes), observed_at=at(minutes), source=SRC, identity=Identity(alert_fingerprint=fp, **ident),
                      payload=AlertPayload(alertname="A", starts_at=at(minutes), labels=dict(labels or {})))


def kafka_orders(events, seeds):
    """Shuffled orders of ``events`` (one per seed) that keep each release's own events in their order
    (one key, one partition: Kafka keeps it); every fourth delivers a third of them again."""
    for seed in seeds:
        order = list(events)
        random.Random(seed).shuffle(order)
        queue: dict[str, list] = {}
        for e in events:
            if e.event_type.startswith("release."):
                queue.setdefault(e.identity.release_id, []).append(e)
        order = [queue[e.identity.release_id].pop(0) if e.event_type.startswith("release.") else e for e in order]
        if seed % 4 == 0:
            order += order[: len(order) // 3]
        yield seed, order


class Driver:
    """Processes events like the worker: releases feed the directory; every event is
    routed to its entity; forwards and refreshes are queued like route messages."""

    def __init__(self, seed: int | None = None, park: bool = True, memos: bool = True, interleave: bool = False) -> None:
        self.directory = ReleaseDirectory()
        self.entities: dict[str, dict] = {}
        self.rows: dict[str, object] = {}
        self.allocations: dict[str, object] = {}
        self.controls: dict[str, object] = {}  # the rows sent to the controls stage (Outcome.controls), highest version
        self.queue: list[tuple[str, dict]] = []
        self.rng = random.Random(seed) if seed is not None else None
        self.park = park
        self.offset = 0
        self.conflicts = 0
        self.memos: dict | None = {} if memos else None  # as the Correlator keeps them (streams.correlate.entities.GpuMemo)
        # With a seed: a release event reaches the directory when its own queue turn comes, among the entities'
        # messages (as the worker reads the release partitions between others), not as it is fed.
        self.interleave = interleave

    def _state(self, key):
        return self.entities.setdefault(key, new_entity(key))

    def _apply(self, key: str, msg: dict) -> None:
        if msg["k"] == "directory":
            self._release(msg["event"])
            return
        state = self._state(key)
        if msg["k"] == "event":
            fold_row(state, event_row(routed_event(msg["event"]), kind_of(key), ("raw", 0, msg["offset"])))
        elif msg["k"] == "link":
            fold_link(state, msg["from"], msg["link"])
        elif msg["k"] == "expire":
            expire(state, msg["rows"])
        memo = self.memos.setdefault(key, GpuMemo()) if key.startswith("gpu:") and self.memos is not None else None
        out = refresh(state, self.directory, park=self.park, memo=memo)
        self.conflicts += out.conflicts
        for content in out.correlated:
            row = CorrelatedEvent.model_validate(content)
            prev = self.rows.get(row.correlation_id)
            assert prev is None or row.version > prev.version
            self.rows[row.correlation_id] = row
        for content in for_controls(state, self.directory, out.correlated):  # as the Correlator does after each batch
            row = CorrelatedEvent.model_validate(content)
            prev = self.controls.get(row.correlation_id)
            if prev is None or row.version >= prev.version:
                self.controls[row.correlation_id] = row
        for content in out.allocations:
            alloc = GpuAllocation.model_validate(content)
            prev = self.allocations.get(alloc.allocation_id)
            assert prev is None or alloc.version > prev.version
            self.allocations[alloc.allocation_id] = alloc
        for target, link in out.forwards:
            self.queue.append((target, {"k": "link", "from": key, "link": link}))

    def _drain(self) -> None:
        # Kafka keeps order per key (one partition) but not across keys: pick a random
        # key, then its oldest message.
        while self.queue:
            if self.rng:
                key = self.rng.choice(sorted({k for k, _ in self.queue}))
                i = next(n for n, (k, _) in enumerate(self.queue) if k == key)
            else:
                i = 0
            key, msg = self.queue.pop(i)
            self._apply(key, msg)

    def _release(self, ev) -> None:
        changed = self.directory.apply(ev)
        for key, state in list(self.entities.items()):
            if set(state["interests"]) & set(changed):
                self.queue.append((key, {"k": "refresh"}))

    def feed(self, events) -> Driver:
        for ev in events:
            self.offset += 1
            if ev.event_type.startswith("release."):
                if self.interleave and self.rng:
                    self.queue.append((f"directory:{ev.identity.release_id}", {"k": "directory", "event": ev}))
                else:
                    self._release(ev)
            self.queue.append((entity_key(ev), {"k": "event", "event": ev, "offset": self.offset}))
            if self.rng is None:
                self._drain()
        self._drain()
        return self

    def flush_parked(self) -> Driver:
        for key, state in list(self.entities.items()):
            ids = [r["id"] for r in state["rows"].values() if r["parked"]]
            if ids:
                self.queue.append((key, {"k": "expire", "rows": ids}))
        self._drain()
        return self

    def latest(self, versions: bool = False) -> dict[str, dict]:
        return {cid: r.model_dump(exclude={"source_offset"} if versions else {"version", "source_offset"}) for cid, r in self.rows.items()}

    def latest_allocations(self, versions: bool = False) -> dict[str, dict]:
        return {aid: a.model_dump(exclude=set() if versions else {"version"}) for aid, a in self.allocations.items()}
