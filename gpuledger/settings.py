"""The one settings loader: pydantic-settings models, one per area.

Every field reads ``GPULEDGER_<AREA>_<FIELD>`` from the environment (e.g.
``GPULEDGER_KAFKA_BOOTSTRAP``, ``GPULEDGER_CLICKHOUSE_DSN``) and can be overridden by
CLI flags. ``Settings.load()`` validates everything before any I/O and reports every
problem at once.
"""

from __future__ import annotations

import os
from datetime import datetime, timezone
from pathlib import Path

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.topics import TopicCatalogue


def default_data_dir() -> Path:
    return Path(os.environ.get("GPULEDGER_DATA_DIR", Path.home() / ".local" / "share" / "gpuledger"))


def default_cache_dir() -> Path:
    return Path(os.environ.get("GPULEDGER_CACHE_DIR", Path.home() / ".cache" / "gpuledger"))


class SettingsError(ValueError):
    """Settings that cannot work together; the message lists every problem."""


class KafkaSettings(BaseSettings):
    """Where Kafka is and how gpuledger's topics are laid out."""

    model_config = SettingsConfigDict(env_prefix="GPULEDGER_KAFKA_", extra="ignore")

    bootstrap: str | None = Field(default=None, description="Bootstrap servers, host:port[,host:port]. Unset: the local broker started by `gpuledger kafka up`.")
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

    dsn: str | None = Field(default=None, description="chdb:///path (embedded, default under the data dir) or http(s)://user:pass@host:8123/db.")
    database: str = Field(default="gpuledger", description="Database holding gpuledger's tables.")
    batch_rows: int = Field(default=10_000, ge=1, description="Sink flushes a batch at this many rows...")
    batch_seconds: float = Field(default=0.3, gt=0, description="...or after this many seconds, whichever comes first.")
    cluster: str | None = Field(default=None, description="ClickHouse cluster name for ON CLUSTER / Replicated tables.")
    ttl_days: int | None = Field(default=None, ge=1, description="Retention of the event tables (raw_events, correlated_events, workload_timeline, enriched_alerts, dead_letters) in days of event time; unset keeps rows forever. Applied by `db migrate` and at worker start.")

    @field_validator("dsn")
    @classmethod
    def _scheme(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("chdb://", "http://", "https://")):
            raise ValueError(f"dsn must start with chdb://, http:// or https://, got {value.split(':', 1)[0]!r}")
        return value

    def resolved_dsn(self, data_dir: Path) -> str:
        return self.dsn or f"chdb://{data_dir / 'clickhouse'}"


class StreamsSettings(BaseSettings):
    """The Faust worker."""

    model_config = SettingsConfigDict(env_prefix="GPULEDGER_STREAMS_", extra="ignore")

    app_id: str = Field(default="gpuledger", description="Faust app id = consumer group; change it to replay into a fresh group.")
    web_port: int = Field(default=0, ge=0, le=65535, description="Worker's loopback web port (health, read-only queries); 0 picks a free port.")
    park_ttl_s: float = Field(default=300.0, gt=0, description="Event-time seconds an event waits for its identity before it is emitted unattributed.")
    park_idle_flush_s: float = Field(default=10.0, gt=0, description="Wall-clock seconds without input after which every parked event is emitted (an idle source must not hold rows back).")
    batch_max: int = Field(default=2000, ge=1, description="Most records an agent takes per batch (a batch closes earlier after 0.1 s without input).")
    pack_max: int = Field(default=1000, ge=1, description="Most messages packed into one record on the internal route and controls topics.")
    packed_batch_messages: int = Field(default=50_000, ge=1, description="About how many packed messages the correlation and controls agents take per batch (packed_batch_messages // pack_max records): larger batches write each touched entity's state once for more input; a batch holds the event loop, and every other agent with it, while it runs.")
    fault: str | None = Field(default=None, pattern=r"^(correlate|controls):(before_outputs|during_outputs|after_outputs|after_changelog):[1-9][0-9]*$",
                              description="Fault injection for the crash tests: 'STAGE:POINT:N' ends the process at once (as kill -9 would) the Nth time STAGE (correlate, controls) reaches POINT in a batch: before_outputs (state folded, nothing produced), during_outputs (produced, not acknowledged), after_outputs (acknowledged, state not written), after_changelog (state written, batch not acked).")
    replay_from: datetime | None = Field(default=None, description="Start of the event-time range (occurred_at, inclusive; no zone means UTC) this run processes: the route stage and the raw sink skip earlier events (`gpuledger replay --from`). The release directory reads every release regardless. Unset: no lower bound.")
    replay_to: datetime | None = Field(default=None, description="End of that range (exclusive): later events are skipped (`gpuledger replay --to`). Unset: no upper bound.")

    @field_validator("replay_from", "replay_to")
    @classmethod
    def _utc(cls, value: datetime | None) -> datetime | None:
        return value.replace(tzinfo=timezone.utc) if value is not None and value.tzinfo is None else value

    @model_validator(mode="after")
    def _range_ordered(self) -> StreamsSettings:
        if self.replay_from and self.replay_to and self.replay_from >= self.replay_to:
            raise ValueError(f"GPULEDGER_STREAMS_REPLAY_FROM {self.replay_from.isoformat()} is not before GPULEDGER_STREAMS_REPLAY_TO {self.replay_to.isoformat()}")
        return self

    def in_range(self, occurred_at: datetime) -> bool:
        """Whether an event time lies in [replay_from, replay_to) (always true without a range)."""
        return (self.replay_from is None or occurred_at >= self.replay_from) and (self.replay_to is None or occurred_at < self.replay_to)


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


class Settings(BaseSettings):
    """Root settings: data locations plus one block per area."""

    model_config = SettingsConfigDict(env_prefix="GPULEDGER_", extra="ignore")

    data_dir: Path = Field(default_factory=default_data_dir, description="Where local state lives (broker data, embedded ClickHouse).")
    cache_dir: Path = Field(default_factory=default_cache_dir, description="Where downloaded Kafka jars are cached.")
    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    clickhouse: ClickHouseSettings = Field(default_factory=ClickHouseSettings)
    streams: StreamsSettings = Field(default_factory=StreamsSettings)
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)

    @classmethod
    def load(cls, **overrides) -> Settings:
        """Build settings from env + overrides; every problem is reported at once."""
        problems: list[str] = []
        blocks = {}
        for name, klass in (("kafka", KafkaSettings), ("clickhouse", ClickHouseSettings), ("streams", StreamsSettings), ("telemetry", TelemetrySettings)):
            try:
                blocks[name] = klass(**{k: v for k, v in overrides.pop(name, {}).items() if v is not None})
            except ValidationError as exc:
                problems.extend(_lines(exc, klass.model_config['env_prefix']))
        if problems:
            raise SettingsError("invalid settings:\n  " + "\n  ".join(problems))
        try:
            return cls(**blocks, **{k: v for k, v in overrides.items() if v is not None})
        except ValidationError as exc:
            raise SettingsError("invalid settings:\n  " + "\n  ".join(_lines(exc, ""))) from exc

    @property
    def clickhouse_dsn(self) -> str:
        return self.clickhouse.resolved_dsn(self.data_dir)


def _lines(exc: ValidationError, env_prefix: str) -> list[str]:
    out = []
    for err in exc.errors(include_url=False):
        loc = ".".join(str(p) for p in err["loc"])
        env = f"{env_prefix}{loc.upper()}" if env_prefix and loc else loc
        out.append(f"{env}: {err['msg']}" if env else err["msg"])  # a cross-field check names its fields itself
    return out


def worker_instance_id(settings) -> str:
    """A stable consumer-group instance id for one worker (static membership): the
    app id, then a hash of host + data dir — the same across restarts of that worker."""
    import hashlib
    import socket

    where = f"{socket.gethostname()}:{Path(settings.data_dir).resolve()}"
    return f"{settings.streams.app_id}-{hashlib.sha256(where.encode()).hexdigest()[:12]}"
