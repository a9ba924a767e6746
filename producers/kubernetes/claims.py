"""Pure mapping of DRA ResourceClaims (``resource.k8s.io``) to who holds which GPU device.

Input: a ResourceClaim exactly as the API server serves it (v1 / v1beta2 / v1beta1: the
status fields used here have one shape in all three): ``status.allocation.devices.results[]``
(``request``, ``driver``, ``pool``, ``device``), ``status.allocation.nodeSelector`` (for a
node-local device the scheduler writes ``matchFields: [{key: metadata.name, operator: In,
values: [<node>]}]``) and ``status.reservedFor[]`` (the consumers: ``resource: pods``,
``name``, ``uid``).
Output: ``Holding``s — one per (reserved pod, allocated device of a GPU driver) — and, by
comparing them with what was published before, ``gpu.claim_reserved`` /
``gpu.claim_released`` events (``claim_events``).
Guarantees: no I/O, no clock reads (the caller passes ``observed_at``, the event time:
the API server records no time for a reservation). Event ids are
``make_event_id("kubernetes", (claim uid, "claim_reserved" | "claim_released", holding key),
<claim resourceVersion at which the reservation was first seen>)``: a re-list of the same
reservation, or a second notice of its end, gives the same id; a reservation made again
after the scheduler undid one (a failed binding) gets a new one.
Limits: devices of other drivers (NICs, …) and consumers other than pods are skipped; a
device with no node (a network-attached pool: no ``metadata.name`` node selector) names
nothing gpuledger can join on and is skipped; a reservation first seen by a list (collector
start) is stamped with the list's time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any

from producers._config import ResourceMatcher, dra_device_id
from producers.kubernetes.mapping import SOURCE, MalformedObject, Meta, meta_of
from schemas.envelope import Identity, Source, make_event_id
from schemas.gpu import GpuEvent, GpuPayload


@dataclass(frozen=True)
class Holding:
    """One pod holding one device of a claim (what ``gpu.claim_reserved`` says)."""

    pod: str
    pod_uid: str
    node: str
    driver: str
    pool: str
    device: str
    request: str
    rv: str = ""  # the claim's resourceVersion when the reservation was first seen (set by claim_events)

    @property
    def device_id(self) -> str:
        return dra_device_id(self.driver, self.pool, self.device)

    @property
    def key(self) -> str:
        """Stable per reservation of one device for one pod: what the collector remembers."""
        return f"{self.pod_uid}|{self.device_id}|{self.request}"

    def record(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True)
class ClaimView:
    meta: Meta
    holdings: tuple[Holding, ...]
    allocated: frozenset[str]  # device ids the allocation names (GPU drivers), reserved or not


def _text(obj: Mapping, name: str, where: str) -> str:
    value = obj.get(name)
    if not isinstance(value, str) or not value:
        raise MalformedObject(f"{where}.{name}: missing or not a string")
    return value


def allocated_node(allocation: Mapping, where: str) -> str | None:
    """The one node a node-local allocation is bound to (``metadata.name In [node]``), or None."""
    selector = allocation.get("nodeSelector")
    if selector is None:
        return None
    if not isinstance(selector, Mapping):
        raise MalformedObject(f"{where}.nodeSelector: not an object")
    nodes = set()
    for term in selector.get("nodeSelectorTerms") or []:
        for field in (term.get("matchFields") or []) if isinstance(term, Mapping) else []:
            if isinstance(field, Mapping) and field.get("key") == "metadata.name" and field.get("operator") == "In":
                nodes.update(v for v in field.get("values") or [] if isinstance(v, str) and v)
    return nodes.pop() if len(nodes) == 1 else None


def claim_view(obj: Any, drivers: ResourceMatcher) -> ClaimView:
    """Who holds which GPU device of one ResourceClaim; ``MalformedObject`` names what is wrong."""
    meta = meta_of(obj, "ResourceClaim")
    where = f"ResourceClaim {meta.namespace}/{meta.name} status"
    status = obj.get("status") or {}
    if not isinstance(status, Mapping):
        raise MalformedObject(f"{where}: not an object")
    allocation = status.get("allocation")
    reserved = status.get("reservedFor") or []
    if not isinstance(reserved, list):
        raise MalformedObject(f"{where}.reservedFor: not a list")
    if not allocation:
        return ClaimView(meta, (), frozenset())
    if not isinstance(allocation, Mapping):
        raise MalformedObject(f"{where}.allocation: not an object")
    results = (allocation.get("devices") or {}).get("results") if isinstance(allocation.get("devices") or {}, Mapping) else None
    if not isinstance(results, list):
        raise MalformedObject(f"{where}.allocation.devices.results: missing or not a list")
    node = allocated_node(allocation, f"{where}.allocation")
    devices = []
    for i, res in enumerate(results):
        at = f"{where}.allocation.devices.results[{i}]"
        if not isinstance(res, Mapping):
            raise MalformedObject(f"{at}: not an object")
        driver, pool, device, request = (_text(res, n, at) for n in ("driver", "pool", "device", "request"))
        # adminAccess: a monitoring/maintenance claim that reaches a device without taking it from its holder.
        if drivers(driver) and res.get("adminAccess") is not True:
            devices.append((driver, pool, device, request))
    pods = []
    for i, ref in enumerate(reserved):
        at = f"{where}.reservedFor[{i}]"
        if not isinstance(ref, Mapping):
            raise MalformedObject(f"{at}: not an object")
        if ref.get("resource") != "pods" or ref.get("apiGroup") not in (None, ""):
            continue  # another kind of consumer: not a pod that could hold a GPU
        pods.append((_text(ref, "name", at), _text(ref, "uid", at)))
    allocated = frozenset(dra_device_id(d, p, n) for d, p, n, _r in devices)
    if node is None:
        return ClaimView(meta, (), allocated)
    holdings = tuple(Holding(pod, uid, node, d, p, n, r) for pod, uid in sorted(pods) for d, p, n, r in sorted(devices))
    return ClaimView(meta, holdings, allocated)


def gone_claim(uid: str, namespace: str, name: str) -> ClaimView:
    """A claim known only from what was remembered of it (a re-list no longer shows it): it holds nothing."""
    return ClaimView(Meta(uid, namespace, name, datetime.fromtimestamp(0, timezone.utc), {}, {}, (), "", None), (), frozenset())


def claim_events(view: ClaimView, previous: Mapping[str, Mapping[str, str]], source: Source, observed_at: datetime,
                 deleted: bool = False) -> tuple[list[GpuEvent], dict[str, dict[str, str]]]:
    """The events that move ``previous`` (holding key -> ``Holding.record()``, what was
    published) to the claim's current holdings, and the holdings to remember.

    A holding that is new is reserved (at ``observed_at``); one that is gone is released, with
    the reason: ``claim_deleted`` (``deleted``), ``deallocated`` (the allocation no longer
    names the device), else ``unreserved`` (the pod left ``reservedFor``).
    """
    meta = view.meta
    now = {} if deleted else {h.key: h for h in view.holdings}
    events, held = [], {}
    for key, h in sorted(now.items()):
        if key in previous:
            held[key] = dict(previous[key])
            continue
        h = Holding(**{**h.record(), "rv": meta.resource_version})
        held[key] = h.record()
        events.append(_event(meta, h, "gpu.claim_reserved", source, observed_at))
    for key, rec in sorted(previous.items()):
        if key in now:
            continue
        h = Holding(**rec)
        reason = "claim_deleted" if deleted else ("unreserved" if h.device_id in view.allocated else "deallocated")
        events.append(_event(meta, h, "gpu.claim_released", source, observed_at, reason))
    return events, held


def _event(meta: Meta, h: Holding, event_type: str, source: Source, at: datetime, reason: str | None = None) -> GpuEvent:
    return GpuEvent(
        event_id=make_event_id(SOURCE, (meta.uid, event_type.split(".", 1)[1], h.key), h.rv),
        event_type=event_type, occurred_at=at, observed_at=at, source=source,
        identity=Identity(node=h.node, namespace=meta.namespace, pod=h.pod, pod_uid=h.pod_uid, gpu_id=h.device_id),
        payload=GpuPayload(node=h.node, namespace=meta.namespace, pod=h.pod, resource_name=h.driver, device_id=h.device_id,
                           driver=h.driver, pool=h.pool, claim=meta.name, claim_uid=meta.uid, request=h.request, reason=reason),
    )
