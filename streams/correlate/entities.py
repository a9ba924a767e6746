"""Entity state and the join rules, as pure functions (no Faust, no Kafka).

Every routed message is processed against the state of one entity (see
``streams.correlate.routing``): a pod, a workload, a node/GPU, a release, a model, an alert
fingerprint. An entity keeps

- ``facts``: identity it learned from its own events (pod uid, workload, node, image
  digest, release/model labels, ...). Each fact remembers the (event time, event id)
  that set it and the latest wins, so facts do not depend on processing order;
- ``gpu``: a pod's gpu.assigned / gpu.released events per (node, device, container),
  from which allocation intervals are *derived* (never mutated in place);
- ``links``: identity forwarded by related entities (a pod's intervals to its
  node/GPU, a pod's release to its workload, a workload's release to its pods);
- ``rows``: the input events attached to it, each with the version and content
  digest last emitted, and whether it is parked.

Processing re-derives everything from that state and emits only rows whose content
changed, with version + 1. So the latest version of every output row is a function
of the topic history, whatever order the messages were processed in.

Parking: a row whose release cannot be resolved is *parked* (not emitted) until its
identity arrives, or until the event-time watermark passes its time + TTL; then it
is emitted ``unattributed``. Late identity still re-attributes it afterwards.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import orjson

from schemas import Identity
from schemas.outputs import CorrelatedEvent, GpuAllocation
from streams.correlate.release import summarize

MAX_ROWS = 2000
FACT_FIELDS = ("pod_uid", "workload_id", "namespace", "pod", "node", "image_digest", "release_id", "model_name", "model_version",
               "environment", "owner", "data_class")
# Fields an event's own identity sets on the entity it belongs to.
ENTITY_FACTS = {"pod": FACT_FIELDS, "wl": ("workload_id", "release_id", "model_name", "model_version", "environment", "owner", "data_class", "namespace")}


def digest(obj) -> str:
    return hashlib.blake2b(orjson.dumps(obj, option=orjson.OPT_SORT_KEYS, default=str), digest_size=12).hexdigest()


def new_entity(key: str) -> dict:
    return {"key": key, "facts": {}, "gpu": {}, "deleted_at": None, "links": {}, "rows": {}, "allocs": {}, "fwd": {}, "interests": []}


@dataclass
class Outcome:
    correlated: list[CorrelatedEvent] = field(default_factory=list)
    allocations: list[GpuAllocation] = field(default_factory=list)
    forwards: list[tuple[str, dict]] = field(default_factory=list)
    parked: list[tuple[str, str]] = field(default_factory=list)  # (occurred_at iso, row id) newly parked


def kind_of(key: str) -> str:
    return key.split(":", 1)[0]


# --- folding inputs into state ---------------------------------------------------------

def _set_fact(state: dict, name: str, value, sort_key: str) -> None:
    if value in (None, ""):
        return
    current = state["facts"].get(name)
    if current is None or sort_key >= current[1]:
        state["facts"][name] = [value, sort_key]


def fold_event(state: dict, event, src: tuple[str, int, int]) -> bool:
    """Fold one event into ``state``; False when it was already folded (re-delivery)."""
    if event.event_id in state["rows"]:
        return False
    sort_key = f"{event.occurred_at.isoformat()}|{event.event_id}"
    kind = kind_of(state["key"])
    ident = event.identity
    if kind in ENTITY_FACTS:
        for name in ENTITY_FACTS[kind]:
            _set_fact(state, name, getattr(ident, name), sort_key)
        if event.event_type.startswith("scheduler."):
            digests = getattr(event.payload, "image_digests", ()) or ()
            if digests:
                _set_fact(state, "image_digest", digests[0], sort_key)
            if event.event_type == "scheduler.deleted":
                at = event.occurred_at.isoformat()
                if state["deleted_at"] is None or at > state["deleted_at"]:
                    state["deleted_at"] = at
        if event.event_type in ("gpu.assigned", "gpu.released"):
            p = event.payload
            akey = f"{p.node}|{p.device_id}|{p.container or ''}|{p.resource_name}"
            state["gpu"].setdefault(akey, []).append(
                [sort_key, "a" if event.event_type == "gpu.assigned" else "r", event.event_id, p.gpu, p.mig_instance])
            state["gpu"][akey].sort()
    state["rows"][event.event_id] = {
        "id": event.event_id, "type": event.event_type, "at": event.occurred_at.isoformat(),
        "identity": ident.model_dump(exclude_none=True), "summary": summarize(event),
        "topic": src[0], "partition": src[1], "offset": src[2], "payload": event.payload.model_dump_json(),
        "starts_at": event.payload.starts_at.isoformat() if event.event_type.startswith("alert.") else None,
        "version": -1, "digest": "", "expired": False, "parked": False,
    }
    if len(state["rows"]) > MAX_ROWS:
        oldest = sorted(state["rows"].values(), key=lambda r: (r["at"], r["id"]))[: len(state["rows"]) - MAX_ROWS]
        for rec in oldest:
            del state["rows"][rec["id"]]
    return True


def fold_link(state: dict, source: str, link: dict) -> None:
    state["links"][source] = link


# --- resolution -----------------------------------------------------------------------

def facts(state: dict) -> dict:
    return {k: v[0] for k, v in state["facts"].items()}


def resolve_entity(state: dict, directory) -> tuple[dict, str, str | None, list[str]]:
    """(identity, attribution, release_id, interests) of a pod or workload entity."""
    f = facts(state)
    env = f.get("environment")
    interests = []
    if f.get("image_digest"):
        interests.append(f"digest:{f['image_digest']}")
    if f.get("model_name"):
        interests.append(f"modelname:{f['model_name']}")
        if f.get("model_version"):
            interests.append(f"model:{f['model_name']}:{f['model_version']}")
    rid, how = None, "unattributed"
    if f.get("release_id"):
        rid, how = f["release_id"], "release_label"
    else:
        linked = sorted((src, link["release_id"]) for src, link in state["links"].items() if link.get("release_id"))
        if linked:
            rid, how = linked[0][1], "workload_release"
        elif (match := directory.by_image_digest(f.get("image_digest"), env)):
            rid, how = match, "image_digest_match"
        elif f.get("model_name") and (match := directory.by_model_version(f["model_name"], f.get("model_version"), env)):
            rid, how = match, "model_version_match"
    if rid:
        interests.append(f"rid:{rid}")
    return f, how, rid, interests


def own_release(state: dict, directory) -> tuple[str | None, str]:
    """A pod's release from its own facts only (never from links): what it forwards."""
    f = facts(state)
    if f.get("release_id"):
        return f["release_id"], "release_label"
    if (match := directory.by_image_digest(f.get("image_digest"), f.get("environment"))):
        return match, "image_digest_match"
    if f.get("model_name") and (match := directory.by_model_version(f["model_name"], f.get("model_version"), f.get("environment"))):
        return match, "model_version_match"
    return None, "unattributed"


def intervals(state: dict) -> list[dict]:
    """Allocation intervals derived from a pod's gpu events (order-independent)."""
    out = []
    deleted = state["deleted_at"]
    for akey, events in sorted(state["gpu"].items()):
        node, device, container, resource = akey.split("|", 3)
        current = None
        for sort_key, op, event_id, gpu, mig in events:
            at = sort_key.split("|", 1)[0]
            if op == "a" and current is None:
                current = {"node": node, "device": device, "container": container or None, "resource": resource, "gpu": gpu,
                           "mig": mig, "start": at, "start_event": event_id, "end": None, "end_event": None, "end_reason": None}
            elif op == "r" and current is not None:
                current.update(end=at, end_event=event_id, end_reason="released")
                out.append(current)
                current = None
        if current is not None:
            if deleted and deleted >= current["start"]:
                current.update(end=deleted, end_reason="pod_deleted")
            out.append(current)
    return out


def _interval_at(links: dict, at: str) -> dict | None:
    """The allocation that held a node/GPU at time ``at`` (latest start wins)."""
    best = None
    for src, link in sorted(links.items()):
        for iv in link.get("intervals", []):
            if iv["start"] <= at and (iv["end"] is None or at < iv["end"]):
                if best is None or iv["start"] > best["start"]:
                    best = iv
    return best


def resolve_row(state: dict, record: dict, directory, entity_res) -> tuple[dict, str, str | None, list[str]]:
    """(identity, attribution, release_id, interests) for one attached row."""
    kind = kind_of(state["key"])
    own = record["identity"]
    at = record["starts_at"] or record["at"]
    if record["type"].startswith("release."):
        return {}, "release_event", own.get("release_id"), [f"rid:{own.get('release_id')}"]
    if own.get("release_id"):
        return {}, "release_label", own["release_id"], [f"rid:{own['release_id']}"]
    if kind in ("pod", "wl"):
        return entity_res
    if kind == "gpu":
        iv = _interval_at(state["links"], at)
        if iv is None:
            return {}, "unattributed", None, []
        ident = dict(iv["identity"])
        rid = ident.get("release_id")
        return ident, ("gpu_assignment" if rid else "unattributed"), rid, ([f"rid:{rid}"] if rid else [])
    if kind == "model":
        name, version = own.get("model_name"), own.get("model_version")
        rid = directory.by_model_version(name, version, own.get("environment"))
        interests = [f"model:{name}:{version}" if version else f"modelname:{name}"] + ([f"rid:{rid}"] if rid else [])
        return {}, ("model_version_match" if rid else "unattributed"), rid, interests
    return {}, "unattributed", None, []


def render_row(record: dict, directory, resolution) -> dict:
    ident, how, rid, _ = resolution
    manifest = directory.manifest(rid) if rid else {}
    identity = {**manifest, **{k: v for k, v in ident.items() if k in Identity.model_fields}, **record["identity"]}
    if rid:
        identity["release_id"] = rid
    return {
        "correlation_id": record["id"], "event_type": record["type"], "occurred_at": record["at"], "attribution": how,
        "identity": identity, "release_state": directory.state_as_of(rid, record["at"]) if rid else None,
        "summary": record["summary"], "source_topic": record["topic"], "source_partition": record["partition"],
        "source_offset": record["offset"], "payload_json": record["payload"],
    }


# --- the step ---------------------------------------------------------------------------

def refresh(state: dict, directory, park: bool = True, resend: bool = False) -> Outcome:
    """Re-derive every output of an entity and return what changed.

    ``resend=True`` (after a restart) re-emits every current row and link even if
    unchanged: the entity's state may have reached the changelog while the outputs it
    had sent were lost in the crash. Re-sends carry the same version and content, so
    the idempotent tables collapse them.
    """
    out = Outcome()
    if resend:
        state["fwd"] = {}
        for record in state["rows"].values():
            record["digest"] = ""
            record["version"] = max(record["version"] - 1, -1)
        for seen in state["allocs"].values():
            seen["digest"] = ""
            seen["version"] = max(seen["version"] - 1, -1)
    kind = kind_of(state["key"])
    entity_res = resolve_entity(state, directory) if kind in ("pod", "wl") else ({}, "unattributed", None, [])
    interests = set(entity_res[3])
    for record in state["rows"].values():
        res = resolve_row(state, record, directory, entity_res)
        interests.update(res[3])
        # Unresolved = no release, or a release named (label) that no release event has
        # described yet: wait for the manifest rather than emit a half-filled row.
        unresolved = (res[1] == "unattributed" or (res[2] is not None and not directory.known(res[2]))) \
            and not record["type"].startswith(("release.", "gpu.allocatable"))
        if park and unresolved and not record["expired"]:
            if not record["parked"]:
                record["parked"] = True
                out.parked.append((record["starts_at"] or record["at"], record["id"]))
            continue
        record["parked"] = False
        content = render_row(record, directory, res)
        d = digest(content)
        if d == record["digest"]:
            continue
        record["digest"] = d
        record["version"] += 1
        out.correlated.append(CorrelatedEvent(version=record["version"], **{**content, "identity": Identity(**content["identity"])}))
    state["interests"] = sorted(interests)
    if kind == "pod":
        _refresh_pod(state, directory, entity_res, out)
    elif kind == "wl":
        _refresh_workload(state, directory, out)
    return out


def _refresh_pod(state: dict, directory, entity_res, out: Outcome) -> None:
    ident, how, rid, _ = entity_res
    manifest = directory.manifest(rid) if rid else {}
    identity = {**manifest, **{k: v for k, v in ident.items() if k in Identity.model_fields}}
    if rid:
        identity["release_id"] = rid
    ns, _, pod = state["key"][4:].partition("/")
    per_gpu: dict[str, list] = {}
    for iv in intervals(state):
        alloc_id = hashlib.sha256(f"{iv['node']}|{iv['device']}|{ns}/{pod}|{iv['container']}|{iv['start_event']}".encode()).hexdigest()[:32]
        ident_iv = {**identity, "node": iv["node"], "gpu_id": iv["device"], "namespace": ns, "pod": pod}
        row = {"allocation_id": alloc_id, "node": iv["node"], "gpu_id": iv["device"], "gpu": iv["gpu"], "mig_instance": iv["mig"],
               "resource_name": iv["resource"], "namespace": ns, "pod": pod, "container": iv["container"], "identity": ident_iv,
               "attribution": how, "started_at": iv["start"], "ended_at": iv["end"], "end_reason": iv["end_reason"],
               "start_event_id": iv["start_event"], "end_event_id": iv["end_event"]}
        d = digest(row)
        seen = state["allocs"].setdefault(alloc_id, {"version": -1, "digest": ""})
        if seen["digest"] != d:
            seen["digest"] = d
            seen["version"] += 1
            out.allocations.append(GpuAllocation(version=seen["version"], **{**row, "identity": Identity(**ident_iv)}))
        per_gpu.setdefault(f"gpu:{iv['node']}/{iv['device']}", []).append(
            {"id": alloc_id, "start": iv["start"], "end": iv["end"], "identity": ident_iv, "attribution": how})
    for target, ivs in per_gpu.items():
        _forward(state, target, {"intervals": ivs}, out)
    f = facts(state)
    if f.get("workload_id"):
        rel, rel_how = own_release(state, directory)
        _forward(state, f"wl:{f['workload_id']}", {"release_id": rel, "attribution": rel_how, "from": "pod"}, out)


def _refresh_workload(state: dict, directory, out: Outcome) -> None:
    f = facts(state)
    if not f.get("release_id"):
        return
    for src in sorted(state["links"]):
        if src.startswith("pod:"):
            _forward(state, src, {"release_id": f["release_id"], "attribution": "workload_release", "from": "wl"}, out)


def _forward(state: dict, target: str, link: dict, out: Outcome) -> None:
    d = digest(link)
    if state["fwd"].get(target) != d:
        state["fwd"][target] = d
        out.forwards.append((target, link))


def expire(state: dict, row_ids: list[str]) -> bool:
    """Mark parked rows whose TTL passed; True when any was still parked."""
    changed = False
    for rid in row_ids:
        rec = state["rows"].get(rid)
        if rec and rec["parked"] and not rec["expired"]:
            rec["expired"] = True
            changed = True
    return changed
