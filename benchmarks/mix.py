"""The benchmark's event mix: a realistic, deterministic stream of contract events.

50 releases first, then per pod four events in turn: a scheduler transition (two in
three name a release), a GPU assignment, an alert on the pod and an XID alert on its
node/GPU (64 nodes, 512 GPUs, 8 pods per workload). Event ids are deterministic, so
the same mix published twice is the same set of facts.

``events(n)`` is the historical form (event times from 2026-11-01 on, one pod per
second). ``events(n, clock=...)`` stamps every event's ``occurred_at`` and
``observed_at`` with ``clock()`` as it is generated (the latency run's load stamps a
placeholder, replaced by the time of sending: ``benchmarks/bench.py``, ``LiveLoad``);
``events(n, start=s)`` is events ``s`` to ``s + n`` of the same stream.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from itertools import count, islice

from schemas import AlertEvent, GpuEvent, Identity, ReleaseEvent, SchedulerEvent, Source, make_event_id
from schemas.alert import AlertPayload
from schemas.gpu import GpuPayload
from schemas.release import ReleasePayload
from schemas.scheduler import SchedulerPayload

SRC = Source(collector="bench")
RELEASES = 50
T0 = datetime(2026, 11, 1, tzinfo=timezone.utc)


def _mix(clock: Callable[[], datetime] | None, start: int = 0) -> Iterator:
    def at_(historical: datetime) -> datetime:
        return clock() if clock else historical

    for r in range(min(start, RELEASES), RELEASES):
        at = at_(T0 + timedelta(seconds=r))
        yield ReleaseEvent(event_id=make_event_id("b", (r, "reg")), event_type="release.registered", occurred_at=at, observed_at=at,
                           source=SRC, identity=Identity(release_id=f"rel-{r}", model_name=f"m{r % 10}", model_version=str(r),
                                                         image_digest=f"sha256:{r:064x}", owner=f"team-{r % 5}", environment="prod"),
                           payload=ReleasePayload(actor="ci"))
    for i in count(max(0, start - RELEASES)):
        p = i // 4
        ns, pod, node, gpu = "ml", f"pod-{p}", f"n{p % 64}", f"GPU-{p % 512:08d}"
        kind = i % 4
        if kind == 0:
            at = at_(T0 + timedelta(seconds=100 + p))
            yield SchedulerEvent(event_id=make_event_id("b", (p, "sched")), event_type="scheduler.scheduled", occurred_at=at, observed_at=at,
                                 source=SRC, identity=Identity(namespace=ns, pod=pod, workload_id=f"ml/Job/j{p // 8}", node=node,
                                                               release_id=f"rel-{p % RELEASES}" if p % 3 else None),
                                 payload=SchedulerPayload(object_kind="Pod", image_digests=(f"sha256:{p % RELEASES:064x}",)))
        elif kind == 1:
            at = at_(T0 + timedelta(seconds=100 + p))
            yield GpuEvent(event_id=make_event_id("b", (p, "gpu")), event_type="gpu.assigned", occurred_at=at, observed_at=at, source=SRC,
                           identity=Identity(namespace=ns, pod=pod, node=node, gpu_id=gpu),
                           payload=GpuPayload(node=node, namespace=ns, pod=pod, container="main", device_id=gpu, gpu=gpu))
        elif kind == 2:
            at = at_(T0 + timedelta(seconds=100 + p))
            yield AlertEvent(event_id=make_event_id("b", (p, "alert")), event_type="alert.firing", occurred_at=at, observed_at=at, source=SRC,
                             identity=Identity(alert_fingerprint=f"fp{p}", namespace=ns, pod=pod),
                             payload=AlertPayload(alertname="Quality", starts_at=at))
        else:
            # The XID fires a second after the assignment (the as-of GPU join needs it later).
            at = at_(T0 + timedelta(seconds=101 + p))
            observed = at if clock else T0 + timedelta(seconds=100 + p)
            yield AlertEvent(event_id=make_event_id("b", (p, "xid")), event_type="alert.firing", occurred_at=at,
                             observed_at=observed, source=SRC, identity=Identity(alert_fingerprint=f"x{p}", node=node, gpu_id=gpu),
                             payload=AlertPayload(alertname="XID", starts_at=at))


def events(n: int | None = None, clock: Callable[[], datetime] | None = None, start: int = 0) -> Iterator:
    """``n`` events of the mix from its ``start``-th (0: the first; all of it, endlessly,
    when ``n`` is None). The events before ``start`` are not built."""
    stream = _mix(clock, start)
    return stream if n is None else islice(stream, n)
