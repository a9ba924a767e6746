"""The one settings root: every component's pydantic-settings model under one ``Settings``.

Input: the environment (``GPULEDGER_<AREA>_<FIELD>``, e.g. ``GPULEDGER_KAFKA_BOOTSTRAP``,
``GPULEDGER_SCHEDULER_NAMESPACE``) and CLI flags (overrides). Output: one validated
``Settings`` with a section per component — ``kafka``, ``clickhouse``, ``streams``,
``telemetry``, ``receiver``, ``collectors.scheduler``, ``collectors.podresources``,
``policy``. Each section's model lives with its component (``producers/*/config.py``,
``streams/controls/policy.py``); the ones without a component of their own live here.
Guarantees: ``Settings.load()`` validates everything before any I/O and reports every
problem at once, each named by its environment variable; a ``GPULEDGER_*`` variable that
is no setting (a typo, a setting that was renamed) stops start-up with the list of valid
ones (``GPULEDGER_TEST_*`` is left to the test suite). ``env_vars()`` lists every variable
with its description: docs/operations.md is generated from it (``gpuledger.dev.settings_doc``).
Limits: the local Kafka broker of ``gpuledger kafka up`` is not looked up here but by the
CLI (``gpuledger.cli._common.load_settings``), the only place that may start dev tooling.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gpuledger.timefmt import parse_time, within
from producers.kubernetes.config import SchedulerCollectorSettings
from producers.podresources.config import PodResourcesSettings
from producers.admission.config import AdmitSettings
from producers.receiver.config import ReceiverSettings
from producers.release_sender import ReleaseSenderSettings
from schemas.topics import TopicCatalogue
from streams.controls.policy import PolicySettings


def default_data_dir() -> Path:
    return Path(os.environ.get("GPULEDGER_DATA_DIR", Path.home() / ".local" / "share" / "gpuledger"))


def default_cache_dir() -> Path:
    return Path(os.environ.get("GPULEDGER_CACHE_DIR", Path.home() / ".cache" / "gpuledger"))


class SettingsError(ValueError):
    """Settings that cannot work together; the message lists every problem."""


class KafkaSettings(BaseSettings):
    """Where Kafka is and how gpuledger's topics are laid out (every component)."""

    model_config = SettingsConfigDict(env_prefix="GPULEDGER_KAFKA_", extra="ignore")

    bootstrap: str | None = Field(default=None, description="Bootstrap servers, host:port[,host:port]. Unset: the local broker started by `gpuledger kafka up`.",
                                  json_schema_extra={"doc_default": "the local broker of `kafka up`"})
    topic_prefix: str = Field(default="gpuledger", description="Prefix of every topic name.")
    raw_partitions: int = Field(default=4, ge=1, description="Partitions of each raw topic (all co-partitioned).")
    replication_factor: int = Field(default=1, ge=1, description="Replication factor of created topics.")
    security_protocol: str = Field(default="PLAINTEXT", description="PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL.")
    sasl_mechanism: str | None = Field(default=None, description="SASL mechanism, e.g. SCRAM-SHA-512.")
    sasl_username: str | None = Field(default=None, description="SASL user name.")
    sasl_password: SecretStr | None = Field(default=None, description="SASL password.")
    delivery_timeout_s: float = Field(default=30.0, gt=0, description="How long a producer waits for acks=all before giving up on a record.")

    def catalogue(self) -> TopicCatalogue:
        return TopicCatalogue(prefix=self.topic_prefix, raw_partitions=self.raw_partitions, replication_factor=self.replication_factor)

    def client_config(self) -> dict[str, str]:
        """librdkafka connection settings (security included), without the bootstrap."""
        conf: dict[str, str] = {"security.protocol": self.security_protocol}
        if self.sasl_mechanism:
            conf["sasl.mechanism"] = self.sasl_mechanism
        if self.sasl_username:
            conf["sasl.username"] = self.sasl_username
        if self.sasl_password:
            conf["sasl.password"] = self.sasl_password.get_secret_value()
        return conf

    def aiokafka_config(self) -> dict:
        """The same security settings for aiokafka clients (Faust's transport)."""
        conf: dict = {"security_protocol": self.security_protocol}
        if self.security_protocol in ("SSL", "SASL_SSL"):
            import ssl

            conf["ssl_context"] = ssl.create_default_context()
        if self.security_protocol.startswith("SASL"):
            conf.update(sasl_mechanism=self.sasl_mechanism, sasl_plain_username=self.sasl_username,
                        sasl_plain_password=self.sasl_password.get_secret_value() if self.sasl_password else None)
        return conf

    def faust_credentials(self):
        """Faust's broker_credentials for these settings (None for PLAINTEXT)."""
        import faust

        conf = self.aiokafka_config()
        if self.security_protocol.startswith("SASL"):
            return faust.SASLCredentials(username=self.sasl_username, password=conf["sasl_plain_password"],
                                         mechanism=self.sasl_mechanism, ssl_context=conf.get("ssl_context"))
        if self.security_protocol == "SSL":
            return faust.SSLCredentials(conf["ssl_context"])
        return None

    @model_validator(mode="after")
    def _sasl_complete(self) -> KafkaSettings:
        if self.security_protocol.startswith("SASL") and not (self.sasl_mechanism and self.sasl_username and self.sasl_password):
            raise ValueError("security_protocol SASL_* needs sasl_mechanism, sasl_username and sasl_password")
        return self


class ClickHouseSettings(BaseSettings):
    """The correlation store: one DSN, embedded chDB or a server."""

    model_config = SettingsConfigDict(env_prefix="GPULEDGER_CLICKHOUSE_", extra="ignore")

    dsn: str | None = Field(default=None, description="chdb:///path (embedded, default under the data dir) or http(s)://user:pass@host:8123/db.",
                            json_schema_extra={"doc_default": "chdb://$GPULEDGER_DATA_DIR/clickhouse"})
    database: str = Field(default="gpuledger", description="Database holding gpuledger's tables.")
    # 30,000 rather than 10,000: a batch's inserts cost ~60 ms of CPU however few rows they carry
    # (docs/store.md), and only a backlog (a bulk load, a catch-up after downtime) fills a batch
    # before its window closes: benchmarks/sink_cpu.py, 60,000 events, 0.055-0.056 -> 0.050-0.051
    # ms/event (live batches close on time, well under either).
    batch_rows: int = Field(default=30_000, ge=1, description="Sink flushes a batch at this many rows...")
    batch_seconds: float = Field(default=0.3, gt=0, description="...or, holding correlated records, no sooner than this many seconds after the previous batch closed: then as soon as a fetch of batch_quiet_seconds brings no more of them (the correlation stage's burst has ended) or the first of them has waited this long (sinks.agents.BatchClock).")
    batch_quiet_seconds: float = Field(default=0.05, gt=0, le=1, description="A batch holding correlated records closes when a fetch this long brings no more of them (and batch_seconds have passed since the previous batch closed): the correlation stage emits a batch's rows in one burst, and each insert costs the store a fixed few milliseconds a table, so one insert per burst rather than one per batch_seconds. Also the longest a fetch waits: a correlated record is seen at most this long after it arrives.")
    batch_idle_seconds: float = Field(default=1.0, gt=0, description="A batch holding no correlated records (raw events, allocations, violations, dead letters only) closes this many seconds after the previous batch closed (at least batch_seconds).")
    cluster: str | None = Field(default=None, description="ClickHouse cluster name for ON CLUSTER / Replicated tables.")
    query_timeout_s: float = Field(default=30.0, gt=0, description="Readers' queries (`trace`, `sql`, `audit`, the query endpoint) stop with an error after this many seconds (ClickHouse max_execution_time).")
    query_max_rows: int = Field(default=100_000, ge=1, description="A reader's query whose result has more rows fails with an error naming the limit (never a silently cut result).")
    query_max_bytes: int = Field(default=64 << 20, ge=1, description="...and likewise for more bytes of result.")
    query_max_threads: int = Field(default=1, ge=1, description="Threads one reader's query may use (the sink keeps the rest of the machine).")
    query_concurrency: int = Field(default=2, ge=1, description="Queries the store owner's query endpoint runs at once.")
    query_queue: int = Field(default=8, ge=0, description="Queries that may wait for one of those; more are answered 503 at once.")
    ttl_days: int | None = Field(default=None, ge=1, description="Retention of the event tables (raw_events, correlated_events, workload_timeline, enriched_alerts, dead_letters) in days of event time; unset keeps rows forever. Applied by `db migrate` and at worker start.")

    @field_validator("dsn")
    @classmethod
    def _scheme(cls, value: str | None) -> str | None:
        from sinks.clickhouse import dsn_problem

        if value is not None and (problem := dsn_problem(value)):
            raise ValueError(f"dsn {problem}")
        return value

    def resolved_dsn(self, data_dir: Path) -> str:
        # (absolute: a relative GPULEDGER_DATA_DIR made chdb://data/clickhouse, a host "data": dsn_problem)
        return self.dsn or f"chdb://{Path(data_dir).resolve() / 'clickhouse'}"


class StreamsSettings(BaseSettings):
    """The Faust worker."""

    model_config = SettingsConfigDict(env_prefix="GPULEDGER_STREAMS_", extra="ignore")

    app_id: str = Field(default="gpuledger", description="Faust app id = consumer group of the internal route hop (the route stage reads the raw topics as `<app id>.route`, the controls stage the controls hop as `<app id>.controls`, the sink as `<app id>.sinks`), and the run's topic namespace (`<prefix>.<app id>.*`); a new one is a replay.")
    web_port: int = Field(default=0, ge=0, le=65535, description="Worker's loopback web port (health, read-only queries); 0 picks a free port.")
    park_ttl_s: float = Field(default=300.0, gt=0, description="Event-time seconds an event waits for its identity before it is emitted unattributed.")
    park_idle_flush_s: float = Field(default=10.0, gt=0, description="Wall-clock seconds without input after which every parked event is emitted (an idle source must not hold rows back).")
    batch_max: int = Field(default=2000, ge=1, description="Most records the route and controls stages take per batch (a batch closes earlier, with what arrived, 0.25 s after the stage asked for it: streams.intake.WITHIN_S).")
    pack_max: int = Field(default=1000, ge=1, description="Most messages packed into one record on the internal route and controls topics.")
    state_chunk: int = Field(default=8, ge=1, le=64, description="Rows (or links) of an entity — links or violations of a control key — per sealed changelog chunk (streams.store.Chunks): a node/GPU's history, a large workload's control key, is written in chunks, each again only when one of its items changed; the newer items (fewer than this) are re-encoded in the entity's head record at every touch. Items can be 32 KiB, so a chunk stays under the broker's 1 MB record limit up to 16-24.")
    snapshots: bool = Field(default=True, description="At a clean stop, each stateful stage writes its partitions' state to local files under `<data_dir>/streams/snapshots/`, with the changelog offset they reflect; a restart reads them and only the changelog records written after them instead of the whole changelog (streams.snapshot; one not usable is said in the log and health, and the changelog read whole). False: every start reads the changelogs whole.")
    state_chunk_from: int = Field(default=16, ge=1, le=1024, description="An entity's rows (or links; a control key's links or violations) are written in chunks only once it holds this many (at least state_chunk): a small entity (a pod's few rows) stays one record.")
    correlate_within_s: float = Field(default=0.25, gt=0, le=1, description="The correlation stage's batches start at most this often (streams.runner.run_batches' cadence): a batch that took less waits out the rest after itself while input queues, one that took longer is followed at once, and a batch closes early once packed_batch_messages arrived — so a live stream's event waits at most this long more, and a loaded stage never idles between batches. Larger: fewer, larger batches, which cost less per event (a busy entity refreshed and written once for more of its events), and an idle stage wakes less often. Measured (make bench's latency run at 8,000 events/s on 2 cores, two runs each): a fixed wait of 0.25 s after every batch (Faust's take_events, before) gave the correlation hop p50 0.76-0.88 s, p99 1.52-1.54 s; this cadence 0.41-0.51 s, 1.23-1.30 s. Earlier, as a fixed wait: 0.01 s made batches so small that they took the cores the rest of the pipeline needed (p99 3.8-8.8 s against 2.3-4.6 s at 0.25 s).")
    packed_batch_messages: int = Field(default=50_000, ge=1, description="About how many packed messages the correlation and controls stages take per batch (packed_batch_messages // pack_max records): larger batches write each touched entity's state once for more input; a batch holds the event loop, and every other agent with it, while it runs.")
    sink_nice: int = Field(default=5, ge=0, le=19, description="Niceness the sink process (and the store engine's threads in it) takes at start, above the worker's own: when the machine's cores are all busy, the correlation process — one interpreter, the slowest stage — keeps running, and the sink catches up in larger batches, which cost it less per row. 0: the same priority as the worker (measured: the correlation stage then fell behind by seconds). The route stage keeps the worker's; the controls process has its own, lower still (controls_nice). Measured with controls_nice (make bench's latency run at 8,000 events/s on 2 cores): sink 10 and controls 10, five runs, event → queryable p99 2.65-3.36 s, of it after the worker's hop ~1.0-1.4 s; sink 5 and controls 19, three runs, 1.65-2.48 s, ~0.3-0.5 s.")
    controls_nice: int = Field(default=19, ge=0, le=19, description="Niceness the controls process takes at start, above the worker's and the sink's (sink_nice): the controls read the correlated rows and nothing on the way to the tables waits for them, so when the machine's cores are all busy the correlation stage and the sink go first and the controls catch up in larger batches (streams.controls.service; their lag is on the health page). 0: the same priority as the worker.")
    commit_interval_s: float = Field(default=1.0, gt=0, le=60, description="Seconds between an agent's epoch commits: outputs acknowledged, then the changed states' changelog, then the input offsets (`streams/runner.py`). A key's state is written once per commit however many batches touched it, and a control violation produced once (its latest version); a crash re-processes at most this much input.")
    commit_max_records: int = Field(default=200_000, ge=1, description="...or as soon as this many input records are waiting for one (an epoch commit after the batch that reached it): bounds what a commit writes and a crash re-processes when batches are large (catching up), and makes a stage's commits a function of its input rather than of the clock (the fault tests).")
    fault: str | None = Field(default=None, pattern=r"^(route|correlate|controls):(before_outputs|during_outputs|after_outputs|after_changelog):[1-9][0-9]*$",
                              description="Fault injection for the crash tests: 'STAGE:POINT:N' ends the process at once (as kill -9 would) the Nth time STAGE (route, correlate, controls) reaches POINT in a batch or an epoch commit: before_outputs (state folded, nothing produced), during_outputs (produced, not acknowledged), after_outputs (the commit's outputs acknowledged, state not written; the route stage's: offsets not committed), after_changelog (state written, input not acked). A route fault ends the route process alone (the worker restarts it, without the fault).")
    verify_journal: bool = Field(default=False, description="For gpuledger's own tests: the entity store looks at every sealed chunk of a state at every write as well, and fails a write whose chunk changed without its journal noting it (`streams.store.VERIFY_JOURNAL`). Costs what the journal saves.")
    replay_from: datetime | None = Field(default=None, description="Start of the event-time range (occurred_at, inclusive, compared to the millisecond as the store keeps times; no zone means UTC) this run processes: the route stage and the raw sink skip earlier events (`gpuledger replay --from`). The release directory reads every release regardless. Unset: no lower bound.")
    replay_to: datetime | None = Field(default=None, description="End of that range (inclusive and to the millisecond, as `gpuledger audit --to` and `trace --at` read the store: an event at the bound + 400 µs is stored at the bound and kept): later events are skipped (`gpuledger replay --to`), by the release directory too (a release event after the range does not judge the range's workloads). Unset: no upper bound.")

    @field_validator("replay_from", "replay_to", mode="before")
    @classmethod
    def _time(cls, value: Any) -> datetime | None:
        """Read as ``gpuledger.timefmt.parse_time`` reads people's times (no zone means UTC)."""
        return None if value in (None, "") else parse_time(value)

    @model_validator(mode="after")
    def _range_ordered(self) -> StreamsSettings:
        if self.replay_from and self.replay_to and self.replay_from > self.replay_to:  # (equal: one instant, the range is closed)
            raise ValueError(f"GPULEDGER_STREAMS_REPLAY_FROM {self.replay_from.isoformat()} is after GPULEDGER_STREAMS_REPLAY_TO {self.replay_to.isoformat()}")
        return self

    def in_range(self, occurred_at: datetime) -> bool:
        """Whether an event time lies in [replay_from, replay_to] (always true without a range). Closed, as the
        audit's range and ``trace --at`` are: a replay of [A, B) then an audit of [A, B] (the same bounds)
        judged the events at B — Kubernetes times are whole seconds, many sit on a round bound — without them.
        At the store's precision, milliseconds (``gpuledger.timefmt.within``): an event at B + 400 us is stored,
        and read by the audit, at B."""
        return within(occurred_at, self.replay_from, self.replay_to)


class TelemetrySettings(BaseSettings):
    """OpenTelemetry traces and metrics."""

    model_config = SettingsConfigDict(env_prefix="GPULEDGER_OTEL_", extra="ignore")

    exporter: str = Field(default="none", description="none, console or otlp.")
    endpoint: str | None = Field(default=None, description="OTLP/HTTP endpoint, e.g. http://127.0.0.1:4318 (implies exporter=otlp).")
    service_name: str = Field(default="gpuledger", description="service.name resource attribute.")

    @field_validator("exporter")
    @classmethod
    def _known(cls, value: str) -> str:
        if value not in ("none", "console", "otlp"):
            raise ValueError(f"exporter must be none, console or otlp, got {value!r}")
        return value


class CollectorsSettings(BaseModel):
    """The collectors that read an external system (each with its own environment prefix)."""

    model_config = ConfigDict(extra="forbid")

    scheduler: SchedulerCollectorSettings = Field(default_factory=SchedulerCollectorSettings, description="`gpuledger collect scheduler`.")
    podresources: PodResourcesSettings = Field(default_factory=PodResourcesSettings, description="`gpuledger collect podresources`.")


class Settings(BaseSettings):
    """Root settings: data locations plus one section per component."""

    model_config = SettingsConfigDict(env_prefix="GPULEDGER_", extra="ignore")

    data_dir: Path = Field(default_factory=default_data_dir, description="Where local state lives (broker data, embedded ClickHouse).",
                           json_schema_extra={"doc_default": "~/.local/share/gpuledger"})
    cache_dir: Path = Field(default_factory=default_cache_dir, description="Where downloaded Kafka jars and the real cluster's built binaries (docs/real-cluster.md) are cached.",
                            json_schema_extra={"doc_default": "~/.cache/gpuledger"})
    profile: Path | None = Field(default=None, description="Write a cProfile of the worker to this file when it stops (`benchmarks/bench.py --profile`).")
    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    clickhouse: ClickHouseSettings = Field(default_factory=ClickHouseSettings)
    streams: StreamsSettings = Field(default_factory=StreamsSettings)
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)
    receiver: ReceiverSettings = Field(default_factory=ReceiverSettings)
    release: ReleaseSenderSettings = Field(default_factory=ReleaseSenderSettings, description="`gpuledger release`: how it proves who ran it.")
    admit: AdmitSettings = Field(default_factory=AdmitSettings)
    collectors: CollectorsSettings = Field(default_factory=CollectorsSettings)
    policy: PolicySettings = Field(default_factory=PolicySettings)

    @classmethod
    def load(cls, run: str | None = None, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Build settings from the environment + overrides (None means "not given"); every problem at once.

        ``overrides`` take one mapping per section (``kafka={"bootstrap": ...}``,
        ``collectors={"scheduler": {...}}``) and the root fields; ``environ`` is where
        unknown ``GPULEDGER_*`` variables are looked for (default ``os.environ``). ``run``
        names the section of the component about to run (``"collectors.podresources"``):
        it is validated as its model's ``to_run()`` says, so what the component needs and
        was not given is one more problem. Raises ``SettingsError``.
        """
        problems = unknown_env_problems(os.environ if environ is None else environ)
        built: dict[str, Any] = {}
        for path, klass in sections():
            group, _, name = path.rpartition(".")
            given = overrides.get(group, {}).get(name, {}) if group else overrides.get(name, {})
            if path == run and hasattr(klass, "to_run"):
                klass = klass.to_run()
            try:
                built[path] = klass(**_given(given))
            except ValidationError as exc:
                problems.extend(error_lines(exc, klass))
        if problems:
            raise SettingsError("invalid settings:\n  " + "\n  ".join(problems))
        collectors = CollectorsSettings(**{p.split(".", 1)[1]: v for p, v in built.items() if p.startswith("collectors.")})
        root = {k: v for k, v in overrides.items() if not _is_section(k)}
        try:
            return cls(**{p: v for p, v in built.items() if "." not in p}, collectors=collectors, **_given(root))
        except ValidationError as exc:
            raise SettingsError("invalid settings:\n  " + "\n  ".join(error_lines(exc, cls))) from exc

    @property
    def clickhouse_dsn(self) -> str:
        return self.clickhouse.resolved_dsn(self.data_dir)


_SECTIONS: tuple[tuple[str, type[BaseSettings]], ...] = (
    ("kafka", KafkaSettings), ("clickhouse", ClickHouseSettings), ("streams", StreamsSettings), ("telemetry", TelemetrySettings),
    ("receiver", ReceiverSettings), ("release", ReleaseSenderSettings), ("admit", AdmitSettings), ("collectors.scheduler", SchedulerCollectorSettings),
    ("collectors.podresources", PodResourcesSettings), ("policy", PolicySettings),
)

#: Variables under the GPULEDGER_ prefix that are no settings: the test suite's own switches.
NOT_SETTINGS_PREFIXES = ("GPULEDGER_TEST_",)


def sections() -> tuple[tuple[str, type[BaseSettings]], ...]:
    """(path in ``Settings``, model) of every section with its own environment prefix."""
    return _SECTIONS


def _is_section(name: str) -> bool:
    return any(path.split(".", 1)[0] == name for path, _ in _SECTIONS)


def _given(values: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


def _env_fields(klass: type[BaseModel], prefix: str, delimiter: str | None) -> Iterator[tuple[str, Any]]:
    for name, info in klass.model_fields.items():
        var = f"{prefix}{name.upper()}"
        yield var, info
        nested = info.annotation
        if delimiter and isinstance(nested, type) and issubclass(nested, BaseModel):
            for sub, sub_info in nested.model_fields.items():
                yield f"{var}{delimiter}{sub.upper()}", sub_info


def env_vars() -> dict[str, tuple[str, Any, Any]]:
    """Every variable the settings read: name -> (section path, model class, field info), in section order."""
    out: dict[str, tuple[str, Any, Any]] = {}
    for name, info in Settings.model_fields.items():
        if not _is_section(name):
            out[f"GPULEDGER_{name.upper()}"] = ("", Settings, info)
    for path, klass in _SECTIONS:
        config = klass.model_config
        for var, info in _env_fields(klass, config["env_prefix"], config.get("env_nested_delimiter")):
            out[var] = (path, klass, info)
    return out


def unknown_env_problems(environ: Mapping[str, str]) -> list[str]:
    """One problem per ``GPULEDGER_*`` variable that no setting reads, with a guess and the list of valid ones."""
    known = env_vars()
    unknown = sorted(k for k in environ if k.upper().startswith("GPULEDGER_") and k.upper() not in known
                     and not k.upper().startswith(NOT_SETTINGS_PREFIXES))
    if not unknown:
        return []
    problems = []
    for name in unknown:
        guess = difflib.get_close_matches(name.upper(), known, n=1)
        problems.append(f"{name}: not a setting" + (f" (did you mean {guess[0]}?)" if guess else ""))
    by_section: dict[str, list[str]] = {}
    for var, (path, _, _) in known.items():
        by_section.setdefault(path or "root", []).append(var)
    problems.append("valid variables:" + "".join(f"\n    {path}: {', '.join(names)}" for path, names in by_section.items()))
    return problems


def error_lines(exc: ValidationError, klass: type[BaseModel]) -> list[str]:
    """A pydantic error as one line per problem, each named by its environment variable."""
    config = getattr(klass, "model_config", {})
    prefix = config.get("env_prefix", "")
    delimiter = config.get("env_nested_delimiter") or "."
    out = []
    for err in exc.errors(include_url=False):
        loc = delimiter.join(str(p) for p in err["loc"]).upper()
        msg = err["msg"].removeprefix("Value error, ")
        out.append(f"{prefix}{loc}: {msg}" if loc else msg)  # a cross-field check names its variables itself
    return out


def worker_instance_id(settings) -> str:
    """A stable consumer-group instance id for one worker (static membership): the
    app id, then a hash of host + data dir — the same across restarts of that worker."""
    import hashlib
    import socket

    where = f"{socket.gethostname()}:{Path(settings.data_dir).resolve()}"
    return f"{settings.streams.app_id}-{hashlib.sha256(where.encode()).hexdigest()[:12]}"
