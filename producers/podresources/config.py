"""Settings of the pod-resources collector (``gpuledger collect podresources``): env ``GPULEDGER_PODRESOURCES_<FIELD>``.

Input: the environment and the command's flags. Output: a validated view of where the
kubelet's socket is, how often to poll it, which resources to publish and where the
snapshot lives; every problem is reported at once by the root loader
(``gpuledger.settings.Settings.load``), ``node`` only when the collector is run.
Limits: no I/O here — the socket and the state dir are checked when the collector starts.
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from producers._config import GPU_DRA_DRIVERS, GPU_RESOURCES, NameList, check_resource_patterns

DEFAULT_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
_NODE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


class PodResourcesSettings(BaseSettings):
    """The pod-resources collector (one per node, usually a DaemonSet)."""

    model_config = SettingsConfigDict(env_prefix="GPULEDGER_PODRESOURCES_", extra="ignore")

    node: str | None = Field(default=None, description="Name of the node this collector runs on (downward API spec.nodeName); required to run.")
    socket: Path = Field(default=DEFAULT_SOCKET, description="The kubelet's pod-resources unix socket.")
    interval_s: float = Field(default=10.0, gt=0, description="Seconds between two polls of the kubelet.")
    state_dir: Path = Field(default=Path("/var/lib/gpuledger"), description="Directory of the last published snapshot, podresources-<node>.json; must survive restarts (hostPath).")
    resources: NameList = Field(
        default=GPU_RESOURCES,
        description="Resource names to publish, comma-separated in the environment; a trailing '*' makes an entry a prefix (the same default as GPULEDGER_SCHEDULER_GPU_RESOURCES).",
    )
    dra_drivers: NameList = Field(default=GPU_DRA_DRIVERS, description="DRA drivers whose allocations (dynamic_resources) are published as GPU assignments, device id '<driver>/<pool>/<device>'; comma-separated, a trailing '*' makes an entry a prefix; empty: none.")
    rpc_timeout_s: float = Field(default=10.0, gt=0, description="Deadline of one gRPC call to the kubelet.")
    backoff_initial_s: float = Field(default=1.0, gt=0, description="First retry delay after a failed poll; doubles per failure, with jitter.")
    backoff_max_s: float = Field(default=60.0, gt=0, description="Cap of the retry delay.")
    max_message_mb: int = Field(default=16, ge=4, description="Largest List response accepted, in MiB (the kubelet sends up to 16).")
    confirm_releases_with_get: bool = Field(default=True, description="Ask Get whether a pod missing from List is really gone before releasing its devices (skipped when the kubelet does not serve Get).")
    restart_grace_s: float = Field(default=60.0, ge=0, description="After the collector (re)connects to the kubelet's socket (at start, or when the kubelet re-created it), a List that lacks at least half of the pods holding GPUs, and shows no GPU pod not held before, releases nothing until it has stayed so this long: a restarted kubelet lists no pods until the API server sent them. Likewise an allocatable set of a resource smaller than the published one is not published until it has stayed so this long: a restarted kubelet lists a resource's devices only once its device plugin registered again. Pods and devices really gone are then published, observed this much late; 0 turns the wait off.")
    max_gets_per_poll: int = Field(default=5, ge=1, description="Most Get calls in one poll; pods missing from List beyond it (or after the kubelet's rate limit refused a Get) stay held until a later poll asks about them. The kubelet allows all clients of this API together a burst of 10 calls at 100/s; a poll also spends one List and one GetAllocatableResources.")

    @field_validator("node")
    @classmethod
    def _node_name(cls, value: str | None) -> str | None:
        if value is not None and not _NODE_NAME.match(value):
            raise ValueError(f"not a Kubernetes node name (lower-case DNS subdomain): {value!r}")
        return value

    @field_validator("resources")
    @classmethod
    def _patterns(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return check_resource_patterns(value)

    @model_validator(mode="after")
    def _backoff_order(self) -> PodResourcesSettings:
        if self.backoff_initial_s > self.backoff_max_s:
            raise ValueError(f"backoff_initial_s ({self.backoff_initial_s}) must not exceed backoff_max_s ({self.backoff_max_s})")
        return self

    @property
    def state_file(self) -> Path:
        return self.state_dir / f"podresources-{self.node}.json"

    @classmethod
    def to_run(cls) -> type[PodResourcesSettings]:
        """The same settings with what the collector needs to run required (``node``)."""
        return RunnablePodResourcesSettings


class RunnablePodResourcesSettings(PodResourcesSettings):
    """``PodResourcesSettings`` as the running collector needs them: the node is known."""

    node: str = Field(description="Name of the node this collector runs on (downward API spec.nodeName); required to run.")
