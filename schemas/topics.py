"""The topic catalogue: the only place topic names live.

Two scopes:

- the catalogue's own topics — the four raw topics (the system of record) and the
  edge dead-letter topic — are shared by everything;
- a *run* (one worker app id, ``TopicCatalogue.run``) has its own outputs and internal
  topics, ``<prefix>.<app id>.<name>.v<N>``, so a replay under a new app id is its own
  world: it never reads (or sinks) another run's outputs.

Raw topics are co-partitioned (same partition count) and keyed by the shared
correlation key, so a Faust worker owning partition p holds every event and table
entry for the keys in p. Names follow ``<prefix>.<family>.v<N>``; the prefix is
configurable so tests and side-by-side deployments never share topics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


@dataclass(frozen=True)
class TopicSpec:
    """One topic: its name, layout and retention."""

    name: str
    partitions: int
    key: str
    retention_ms: int
    cleanup_policy: Literal["delete", "compact", "compact,delete"] = "delete"
    role: Literal["raw", "output", "deadletter", "internal"] = "raw"
    config: dict[str, str] = field(default_factory=dict)

    def kafka_config(self) -> dict[str, str]:
        return {"retention.ms": str(self.retention_ms), "cleanup.policy": self.cleanup_policy, **self.config}


DAY_MS = 24 * 3600 * 1000

#: The state changelogs are read whole on every (re)start (``streams.store``), so compaction
#: must actually run: Kafka never compacts a partition's active segment, and with the
#: broker's defaults (1 GiB, 7 days) a changelog keeps every version of every state until
#: its segment reaches 1 GiB — a worker whose entities change all day (a GPU's alerts, a
#: release's lifecycle) would read gigabytes of superseded versions at each restart.
#: Segments roll at 16 MiB or 10 minutes and the cleaner takes a partition once 10 % of it
#: is superseded, so a restart reads about the live state plus a segment per partition.
#: ``delete.retention.ms`` (Kafka's default, one day, set so that it is known): how long a
#: tombstone outlives its compaction — the bound on the age of a local snapshot that a
#: recovery completes with the records written after it (``streams.snapshot``).
CHANGELOG_CONFIG = {"segment.bytes": str(16 * 1024 * 1024), "segment.ms": str(10 * 60 * 1000), "min.cleanable.dirty.ratio": "0.1",
                    "delete.retention.ms": str(DAY_MS)}


class TopicCatalogue(BaseModel):
    """Every topic gpuledger reads or writes, derived from a prefix and partition count."""

    model_config = ConfigDict(frozen=True)

    prefix: str = Field(default="gpuledger", pattern=r"^[A-Za-z0-9._-]+$", description="Topic name prefix.")
    raw_partitions: int = Field(default=4, ge=1, description="Partitions of every raw topic (co-partitioned).")
    replication_factor: int = Field(default=1, ge=1, description="Replication factor for created topics.")
    raw_retention_ms: int = Field(default=-1, description="Raw topics are the system of record: keep forever by default.")
    output_retention_ms: int = Field(default=30 * DAY_MS, description="Retention of derived topics (rebuildable).")

    def _name(self, family: str, version: int = 1) -> str:
        return f"{self.prefix}.{family}.v{version}"

    @property
    def scheduler(self) -> str:
        return self._name("scheduler")

    @property
    def gpu(self) -> str:
        return self._name("gpu")

    @property
    def release(self) -> str:
        return self._name("release")

    @property
    def alert(self) -> str:
        return self._name("alert")

    @property
    def deadletter(self) -> str:
        """Dead letters of the edge (collectors, receiver): shared by every run."""
        return self._name("deadletter")

    def run(self, app_id: str) -> RunTopics:
        """The topics of one worker run (app id): its outputs and internal topics."""
        return RunTopics(prefix=self.prefix, app_id=app_id, partitions=self.raw_partitions, retention_ms=self.output_retention_ms)

    @property
    def raw_topics(self) -> tuple[str, ...]:
        return (self.scheduler, self.gpu, self.release, self.alert)

    def for_family(self, event_type: str) -> str:
        """Raw topic for an event type ('alert.firing' -> the alert topic)."""
        family = event_type.split(".", 1)[0]
        if family == "admission":  # decisions belong to the workload's history: the scheduler topic, same key
            family = "scheduler"
        if family not in ("scheduler", "gpu", "release", "alert"):
            raise ValueError(f"event_type {event_type!r} has no raw topic (family {family!r})")
        return self._name(family)

    def specs(self) -> list[TopicSpec]:
        raw = [
            TopicSpec(self.scheduler, self.raw_partitions, "release_id, else workload_id", self.raw_retention_ms),
            TopicSpec(self.gpu, self.raw_partitions, "namespace/pod (re-keyed by streams)", self.raw_retention_ms),
            TopicSpec(self.release, self.raw_partitions, "release_id", self.raw_retention_ms),
            TopicSpec(self.alert, self.raw_partitions, "release_id, else namespace/pod, else fingerprint", self.raw_retention_ms),
        ]
        return raw + [TopicSpec(self.deadletter, 1, "source key", self.raw_retention_ms, role="deadletter")]


class RunTopics(BaseModel):
    """The topics of one worker run (app id): outputs, dead letters and internal topics.

    Internal topics (``route``, ``controls``) carry packed messages addressed to a
    partition; the changelogs hold each partition's entity / control state, written
    only after the outputs it implies were acknowledged (see ``streams/store.py``).
    """

    model_config = ConfigDict(frozen=True)

    prefix: str
    app_id: str = Field(pattern=r"^[A-Za-z0-9._-]+$")
    partitions: int = Field(ge=1)
    retention_ms: int

    def _name(self, name: str, version: int = 1) -> str:
        return f"{self.prefix}.{self.app_id}.{name}.v{version}"

    @property
    def correlated(self) -> str:
        return self._name("correlated")

    @property
    def enriched_alerts(self) -> str:
        return self._name("alerts-enriched")

    @property
    def allocations(self) -> str:
        return self._name("allocations")

    @property
    def violations(self) -> str:
        return self._name("violations")

    @property
    def deadletter(self) -> str:
        """Dead letters of this run's stream and sink stages."""
        return self._name("deadletter")

    @property
    def route(self) -> str:
        return self._name("route")

    @property
    def controls(self) -> str:
        return self._name("controls")

    @property
    def entities_changelog(self) -> str:
        return self._name("entities-changelog")

    @property
    def controls_changelog(self) -> str:
        return self._name("controls-changelog")

    @property
    def outputs(self) -> tuple[str, ...]:
        return (self.correlated, self.enriched_alerts, self.allocations, self.violations, self.deadletter)

    def specs(self) -> list[TopicSpec]:
        n, keep = self.partitions, self.retention_ms
        return [
            TopicSpec(self.correlated, n, "release_id, else correlation_id", keep, role="output"),
            TopicSpec(self.allocations, n, "node/gpu_id", keep, role="output"),
            TopicSpec(self.enriched_alerts, n, "alert fingerprint", keep, role="output"),
            TopicSpec(self.violations, n, "violation_id", keep, role="output"),
            TopicSpec(self.deadletter, 1, "source key", keep, role="deadletter"),
            TopicSpec(self.route, n, "packed messages, addressed by partition", keep, role="internal"),
            TopicSpec(self.controls, n, "packed messages, addressed by partition", keep, role="internal"),
            TopicSpec(self.entities_changelog, n, "entity key", -1, "compact", role="internal", config=CHANGELOG_CONFIG),
            TopicSpec(self.controls_changelog, n, "control key", -1, "compact", role="internal", config=CHANGELOG_CONFIG),
        ]
