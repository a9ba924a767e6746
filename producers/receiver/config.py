"""Settings of the HTTP receiver (``gpuledger receive``): env ``GPULEDGER_RECEIVER_<FIELD>``.

Input: the environment and the command's flags; nested blocks as JSON or one field at a
time with ``__``. Output: where to listen, the body limit, the auth of each endpoint and
how alert labels and MLflow registry events map to gpuledger's identifiers; every
problem is reported at once by the root loader (``gpuledger.settings.Settings.load``).
Secrets are ``SecretStr`` and never printed.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from producers.receiver.alertmanager import AlertIdentityLabels
from producers.receiver.auth import OidcSettings
from producers.receiver.mlflow import MlflowReleaseMapping


class ReceiverSettings(BaseSettings):
    """The receiver service (``gpuledger receive``); env ``GPULEDGER_RECEIVER_<FIELD>``.

    Nested blocks take JSON (``GPULEDGER_RECEIVER_MLFLOW='{"alias_environments": {...}}'``)
    or one field at a time with ``__`` (``GPULEDGER_RECEIVER_ALERT_LABELS__NODE='["node"]'``).
    """

    model_config = SettingsConfigDict(env_prefix="GPULEDGER_RECEIVER_", env_nested_delimiter="__", extra="ignore")

    host: str = Field(default="127.0.0.1", description="Address to listen on; 0.0.0.0 to accept from other hosts.")
    port: int = Field(default=9095, ge=0, le=65535, description="TCP port to listen on; 0 picks a free one (printed at start).")
    max_body_bytes: int = Field(default=1024 * 1024, ge=1024, description="Largest request body accepted; larger ones get 413.")
    alertmanager_bearer_token: SecretStr | None = Field(default=None, description="If set, /v1/alertmanager requires 'Authorization: Bearer <token>'.")
    releases_bearer_token: SecretStr | None = Field(default=None, description="If set, /v1/releases requires 'Authorization: Bearer <token>'.")
    mlflow_secret: SecretStr | None = Field(default=None, description="If set, /v1/mlflow requires a valid X-MLflow-Signature made with this webhook secret; a signed delivery's events are by service:mlflow/<mlflow_webhook_name>.")
    mlflow_webhook_name: str = Field(default="gpuledger", pattern=r"^[A-Za-z0-9._-]+$", description="Name of the MLflow webhook (as created with create_webhook): the identity of signed deliveries is service:mlflow/<name>.")
    credentials_file: Path | None = Field(default=None, description="YAML file of callers (identity, groups, token_sha256, endpoints): bearer tokens that prove who a caller is; re-read when it changes.")
    oidc: OidcSettings | None = Field(default=None, description="OIDC/JWT bearer tokens: issuer, audience, jwks_file or jwks_url, claims (JSON, or GPULEDGER_RECEIVER_OIDC__ISSUER=…).")
    header_timeout_s: float = Field(default=10.0, gt=0, description="A connection must deliver a request's headers within this long (after connecting, or after its previous answer), else it is closed: slow clients cannot hold connections.")
    body_timeout_s: float = Field(default=30.0, gt=0, description="A request's body must arrive within this long after its headers, else 408.")
    max_connections: int = Field(default=1024, ge=1, description="Open connections beyond this get 503 and are closed at once.")
    tls_cert_file: Path | None = Field(default=None, description="PEM certificate (chain) to serve HTTPS; re-read when the file changes. Needs tls_key_file.")
    tls_key_file: Path | None = Field(default=None, description="PEM private key of tls_cert_file.")
    allow_unauthenticated: bool = Field(default=False, description="Serve on a non-loopback address with no credential configured (refused otherwise); a warning is logged every minute while it runs.")
    mlflow_signature_tolerance_s: float = Field(default=300.0, ge=0, description="Reject signed MLflow deliveries whose X-MLflow-Timestamp is further than this from now (0 = no check).")
    mlflow_dedup_size: int = Field(default=10_000, ge=0, description="How many published MLflow delivery ids are remembered to drop re-deliveries (0 = off).")
    linger_ms: float = Field(default=20.0, ge=0, le=1000, description="librdkafka linger.ms of the receiver's producer: how long an accepted event waits to share a produce request with other requests' events. Every produce request costs the broker and librdkafka about the same whatever it holds, so batching one-event requests is most of what the receiver's throughput costs (docs/receiver.md, Throughput); each answer waits up to this long more.")
    publish_timeout_s: float | None = Field(default=None, gt=0, description="How long a request waits for Kafka acks before answering 503; default: the Kafka delivery timeout + 5 s.")
    alert_labels: AlertIdentityLabels = Field(default_factory=AlertIdentityLabels, description="Alert labels that carry the shared identifiers.")
    mlflow: MlflowReleaseMapping = Field(default_factory=MlflowReleaseMapping, description="How MLflow registry deliveries map to release events.")

    @model_validator(mode="after")
    def _tls_pair(self) -> ReceiverSettings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together (give both, or neither for plain HTTP)")
        return self

    @field_validator("alertmanager_bearer_token", "releases_bearer_token", "mlflow_secret")
    @classmethod
    def _not_blank(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not value.get_secret_value().strip():
            raise ValueError("must not be blank (unset it to turn auth off)")
        return value
