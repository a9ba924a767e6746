"""What gpuledger itself produces: correlated events, violations, dead letters."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from schemas.envelope import Frozen, Identity, UtcDatetime

Attribution = Literal[
    "release_label",
    "workload_release",
    "image_digest_match",
    "model_version_match",
    "image_digest_fallback",
    "model_version_fallback",
    "gpu_assignment",
    "gpu_shared",
    "release_event",
    "unattributed",
]


class CorrelatedEvent(Frozen):
    """One input event with its identity resolved as far as it can be.

    ``correlation_id`` is the row key (the input's event_id); a later, better
    attribution of the same input is emitted with the same key and a higher
    ``version`` and supersedes the earlier row.
    """

    correlation_id: str = Field(description="Row key: the input event's event_id.")
    version: int = Field(ge=0, description="Row version; the highest wins.")
    event_type: str = Field(description="Input event type.")
    occurred_at: UtcDatetime = Field(description="Input event time.")
    attribution: Attribution = Field(description="How the release was resolved.")
    identity: Identity = Field(description="Resolved identity block.")
    release_state: str | None = Field(default=None, description="The release's latest event type of any kind (lifecycle, reservation or admin action) as of the row's event.")
    summary: str = Field(default="", description="One-line human summary of the input event.")
    source_topic: str = Field(description="Kafka topic the input came from.")
    source_partition: int = Field(ge=0, description="Kafka partition of the input.")
    source_offset: int = Field(ge=0, description="Kafka offset of the input.")
    payload_json: str = Field(default="{}", description="The input event's payload, as JSON.")
    named_release_id: str | None = Field(default=None, description="With a *_fallback attribution: the release id the input (or its pod) named, which no release event describes. Control 3 reports it as a mismatch; stored in correlated_events ('' when none).")
    environment_labelled: bool | None = Field(
        default=None,
        description="Whether identity.environment is the input's own or its entity's (a pod's or workload's "
                    "gpuledger.io/environment label or annotation): false when it is its release's (the manifest's), or "
                    "there is none; null in a record of a worker before it was recorded. Control 1 judges a workload whose "
                    "environment is not its own in the strictest environment needing an approval that its release's events "
                    "named by its admission, as the admission webhook does. Read by the controls from the topic, and by "
                    "gpuledger audit --reevaluate from correlated_events (NULL in rows stored before it kept it).")
    release_known: bool | None = Field(
        default=None,
        description="Whether a release event describes identity.release_id (the worker had read one when it wrote the "
                    "row): false when the row names a release no release event describes — an alert or pod labelled with "
                    "a mistyped or never-registered release id, emitted once it waited park_ttl_s for one — which is not "
                    "joined to a release (control 6 counts such an alert episode as unjoined); null when the row names no "
                    "release, or in a record of a worker before it was recorded. A row whose release is described later is "
                    "written again with true at a higher version. Not a column of correlated_events.")


def joined(attribution: str, release_id: str | None, release_known: bool | None) -> bool:
    """Whether a row is joined to a release, for control 6 (``streams.controls.rules._telemetry``)
    and for what the controls stage is sent (``streams.correlate.entities.for_controls``): attributed, or naming a release —
    one a release event describes (``release_known`` false: a label naming a mistyped or
    never-registered release, emitted past its park TTL, joined nothing; an exploratory review
    found such an alert counted as joined, control 6 silent and the audit passing). None: a record
    of an older worker, which did not say — taken as described, as it was."""
    return (attribution != "unattributed" or bool(release_id)) and release_known is not False


#: ``GpuAllocation.end_reason`` of a withdrawn allocation: a tombstone (closed at its start) that
#: readers skip — the engine found its holding started earlier, under another allocation id.
ALLOCATION_WITHDRAWN = "withdrawn"


class GpuAllocation(Frozen):
    """One interval during which a device was assigned to a pod's container.

    Opened by ``gpu.assigned``, closed by ``gpu.released``, pod deletion or node
    loss. ``allocation_id`` is the row key; the closed interval supersedes the open
    one with a higher ``version``, as does a later, better attribution.
    """

    allocation_id: str = Field(description="Row key: hash of node, device, pod, container and the assigning event.")
    version: int = Field(ge=0, description="Row version; the highest wins.")
    node: str = Field(description="Node name.")
    gpu_id: str = Field(description="Device id verbatim (GPU UUID, MIG UUID, index name, with any ::N share suffix).")
    gpu: str | None = Field(default=None, description="Physical GPU parsed from the device id.")
    mig_instance: str | None = Field(default=None, description="MIG instance when the device is a MIG slice.")
    resource_name: str = Field(default="nvidia.com/gpu", description="Extended resource name.")
    namespace: str = Field(description="Pod namespace.")
    pod: str = Field(description="Pod name.")
    container: str | None = Field(default=None, description="Container name.")
    identity: Identity = Field(description="Resolved identity: pod uid, workload, release, model, owner, environment.")
    attribution: str = Field(description="How the release was resolved (see CorrelatedEvent.attribution).")
    started_at: UtcDatetime = Field(description="When the assignment was observed (event time).")
    ended_at: UtcDatetime | None = Field(default=None, description="When it ended; null while held.")
    end_reason: str | None = Field(default=None, description=(
        "released, pod_deleted, node_lost; withdrawn: a tombstone, closed at its start — the engine found the holding "
        "started earlier (an earlier assignment read later) and under another allocation_id. Readers skip it."))
    start_event_id: str = Field(description="event_id of the gpu.assigned event.")
    end_event_id: str | None = Field(default=None, description="event_id of the event that closed it.")


class Violation(Frozen):
    """One ownership-gap control violation, open or closed."""

    violation_id: str = Field(description="Deterministic id of this violation.")
    version: int = Field(ge=0, description="Row version; the highest wins.")
    control_id: int = Field(ge=1, le=8, description="Control number (DESIGN.md, Controls).")
    title: str = Field(description="Control title.")
    severity: Literal["info", "warning", "critical"] = Field(description="Severity.")
    identity: Identity = Field(description="Identifiers involved.")
    evidence: tuple[str, ...] = Field(description="Event ids that prove it.")
    owner: str | None = Field(default=None, description="Accountable owner from the policy.")
    opened_at: UtcDatetime = Field(description="When the violation began (event time).")
    closed_at: UtcDatetime | None = Field(default=None, description="When it ended, if it did.")
    detail: str = Field(default="", description="Human explanation.")
    policy_version: str = Field(default="", description="Fingerprint of the policy the violation was judged under "
                                "(`sha256:` + 16 hex digits, `Policy.fingerprint`); empty in records written before it was recorded.")


#: How much of a rejected record's value a dead letter keeps.
DEAD_LETTER_VALUE_BYTES = 64 * 1024


class DeadLetter(Frozen):
    """A record that was accepted somewhere but could not be processed, with why."""

    reason: str = Field(description="Short machine-readable reason, e.g. 'not_json', 'validation'.")
    error: str = Field(description="The error message, naming the field where there is one.")
    stage: str = Field(description="Which component rejected it (e.g. 'streams.correlate').")
    source_topic: str | None = Field(default=None, description="Topic the record came from.")
    source_partition: int | None = Field(default=None, description="Its partition.")
    source_offset: int | None = Field(default=None, description="Its offset.")
    key: str | None = Field(default=None, description="Record key, decoded as UTF-8 with replacement (an output record refused by Kafka: its first 1 KiB).")
    value: str = Field(description="Record value, decoded as UTF-8 with replacement (truncated to 64 KiB).")
    failed_at: UtcDatetime = Field(description="When it was rejected.")


MAX_DEAD_VALUE = 64 * 1024


def dead_letter(reason: str, error: str, stage: str, topic: str | None, partition: int | None, offset: int | None,
                key: bytes | str | None, value: bytes | str | None) -> DeadLetter:
    """A DeadLetter for a record at topic/partition/offset (value truncated to 64 KiB)."""
    from datetime import datetime, timezone

    def text(raw) -> str | None:
        if raw is None:
            return None
        return bytes(raw[:MAX_DEAD_VALUE]).decode("utf-8", "replace") if isinstance(raw, (bytes, bytearray)) else str(raw)[:MAX_DEAD_VALUE]

    return DeadLetter(reason=reason, error=error[:2000], stage=stage, source_topic=topic, source_partition=partition,
                      source_offset=offset, key=text(key), value=text(value) or "", failed_at=datetime.now(timezone.utc))
