"""Settings of the scheduler collector (``gpuledger collect scheduler``): env ``GPULEDGER_SCHEDULER_<FIELD>``.

Input: the environment and the command's flags. Output: a validated, frozen view of how
the collector reaches the API server, what it watches and how it backs off; every
problem is reported at once by the root loader (``gpuledger.settings.Settings.load``).
Limits: no I/O here — whether the kubeconfig works is found out when the collector starts.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Optional

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from producers._config import GPU_DRA_DRIVERS, GPU_RESOURCES, NameList, check_resource_patterns
from producers.kubernetes.mapping import DEFAULT_EVENT_REASONS
from schemas.scheduler import SchedulerEventType

_SCHEDULER_TYPES = frozenset(SchedulerEventType.__args__)


class SchedulerCollectorSettings(BaseSettings):
    """The scheduler collector (one replica per cluster)."""

    model_config = SettingsConfigDict(env_prefix="GPULEDGER_SCHEDULER_", extra="ignore")

    kubeconfig: Optional[Path] = Field(default=None, description="kubeconfig file; unset: in-cluster config when running in a pod, else ~/.kube/config (KUBECONFIG).")
    context: Optional[str] = Field(default=None, description="kubeconfig context to use (default: the current context).")
    in_cluster: bool = Field(default=False, description="Use the pod's service account (in-cluster config) and fail if it is not available.")
    namespace: Optional[str] = Field(default=None, description="Watch one namespace only; unset: all namespaces (needs the ClusterRole).")
    state_dir: Optional[Path] = Field(default=None, description="Directory of scheduler-state.json (what was published per object); unset: <data dir>/scheduler-collector. Must survive restarts.")
    gpu_resources: NameList = Field(default=GPU_RESOURCES, description="Extended resources that make a pod a GPU pod, comma-separated in the environment; a trailing '*' makes an entry a prefix (the same default as GPULEDGER_PODRESOURCES_RESOURCES).")
    dra: bool = Field(default=True, description="Watch DRA (resource.k8s.io, when served): ResourceSlices, to learn what each DRA GPU device is (its uuid / parentUUID; cluster-scoped, so skipped with namespace set), and ResourceClaims, to learn which pod holds which device (in the namespace when set). With it on, Pods and Kueue Workloads whose pod spec (a Workload: a pod set's template) names a ResourceClaim are collected like those requesting a GPU resource.")
    dra_drivers: NameList = Field(default=GPU_DRA_DRIVERS, description="DRA drivers whose devices are GPUs, comma-separated in the environment; a trailing '*' makes an entry a prefix (the same default as GPULEDGER_PODRESOURCES_DRA_DRIVERS).")
    label_prefix: str = Field(default="gpuledger.io/", description="Prefix of the labels/annotations naming release-id, model, model-version, environment, owner, data-class.")
    event_reasons: dict[str, str] = Field(default_factory=lambda: dict(DEFAULT_EVENT_REASONS), description="Event reason -> scheduler event type (JSON object in the environment); reasons not listed are ignored.")
    kueue: bool = Field(default=True, description="Watch Kueue Workloads when the cluster serves kueue.x-k8s.io.")
    watch_timeout_s: int = Field(default=300, ge=1, description="Server-side timeout of one watch request; the watch is then resumed from its resourceVersion.")
    request_timeout_s: float = Field(default=30.0, gt=0, description="Connect/read timeout of list and get requests (watches get watch_timeout_s on top).")
    page_size: int = Field(default=500, ge=1, description="Items per list page (limit/continue).")
    backoff_initial_s: float = Field(default=0.5, gt=0, description="First retry delay after an API or Kafka error; doubles per failure, with jitter.")
    backoff_max_s: float = Field(default=30.0, gt=0, description="Cap of the retry delay.")
    discovery_interval_s: float = Field(default=300.0, gt=0, description="How often to look again for Kueue while it is not installed.")
    state_flush_interval_s: float = Field(default=1.0, ge=0, description="Minimum seconds between two state-file writes (0: after every published batch); always written on stop.")
    tombstone_ttl_s: float = Field(default=3600.0, ge=0, description="How long a deleted object's entry is kept so late Events still link to it, and a deleted Kueue Workload so its pods' last events (finished, deleted) still carry it.")
    host: str = Field(default_factory=lambda: os.environ.get("POD_NAME") or socket.gethostname(), description="Source host recorded in every event (default: POD_NAME, else the hostname).")

    @field_validator("gpu_resources")
    @classmethod
    def _some_resources(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return check_resource_patterns(value)

    @field_validator("event_reasons")
    @classmethod
    def _known_types(cls, value: dict[str, str]) -> dict[str, str]:
        bad = sorted(f"{k}={v}" for k, v in value.items() if v not in _SCHEDULER_TYPES)
        if bad:
            raise ValueError(f"unknown scheduler event type(s): {', '.join(bad)}; known: {', '.join(sorted(_SCHEDULER_TYPES))}")
        return value

    @field_validator("label_prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        if not value.endswith("/"):
            raise ValueError(f"label_prefix must end with '/', got {value!r}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> SchedulerCollectorSettings:
        problems = []
        if self.in_cluster and self.kubeconfig:
            problems.append("in_cluster and kubeconfig exclude each other")
        if self.backoff_initial_s > self.backoff_max_s:
            problems.append(f"backoff_initial_s ({self.backoff_initial_s}) must not exceed backoff_max_s ({self.backoff_max_s})")
        if problems:
            raise ValueError("; ".join(problems))
        return self
