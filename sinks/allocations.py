"""GPU allocation intervals and control violations: the other versioned outputs.

Input: batches of ``GpuAllocation`` (allocations topic) and ``Violation``
(violations topic). Output: rows of ``gpu_allocations`` / ``violations``, one
columnar insert per batch. Both tables are ReplacingMergeTree(version) keyed by the
row's identity (allocation_id with its node, device and start; violation_id), so a
closed interval supersedes the open one and re-deliveries collapse.
"""

from __future__ import annotations

from collections.abc import Sequence

from schemas.outputs import GpuAllocation, Violation
from sinks.correlated import IDENTITY_FIELDS, identity_values

ALLOCATION_IDENTITY = ("release_id", "model_name", "model_version", "artifact_digest", "image_digest", "config_digest",
                       "dataset_ref", "environment", "workload_id", "pod_uid", "owner", "data_class")
GPU_ALLOCATION_COLUMNS = (
    "allocation_id", "version", "node", "gpu_id", "gpu", "mig_instance", "resource_name", "namespace", "pod", "container",
    *ALLOCATION_IDENTITY, "attribution", "started_at", "ended_at", "end_reason", "start_event_id", "end_event_id",
)
VIOLATION_COLUMNS = (
    "violation_id", "version", "control_id", "title", "severity", *IDENTITY_FIELDS, "evidence", "accountable_owner",
    "opened_at", "closed_at", "detail", "policy_version",
)


def allocation_rows(batch: Sequence[GpuAllocation]) -> list[list]:
    return [[
        a.allocation_id, a.version, a.node, a.gpu_id, a.gpu or "", a.mig_instance or "", a.resource_name, a.namespace, a.pod,
        a.container or "", *identity_values(a.identity, ALLOCATION_IDENTITY), a.attribution, a.started_at,
        a.ended_at, a.end_reason or "", a.start_event_id, a.end_event_id or "",
    ] for a in batch]


def violation_rows(batch: Sequence[Violation]) -> list[list]:
    return [[
        v.violation_id, v.version, v.control_id, v.title, v.severity, *identity_values(v.identity, IDENTITY_FIELDS),
        list(v.evidence), v.owner or "", v.opened_at, v.closed_at, v.detail, v.policy_version,
    ] for v in batch]
