"""Sending a release event through the receiver, so that who sent it is proven.

Input: one ``ReleaseEvent`` built by ``producers.releases.build_event`` (the flags of
``gpuledger release …``) and ``ReleaseSenderSettings`` (env ``GPULEDGER_RELEASE_<FIELD>``).
Output: a POST of the event to ``<receiver_url>/v1/releases`` with ``Authorization: Bearer
<token>``; the receiver authenticates the token (credentials file or OIDC), sets ``actor``,
``authenticated_by`` and ``actor_groups``, computes the event id and answers only after Kafka
acknowledged it. Returns the event id the receiver stored.

Why the receiver and not a signature the worker checks: the receiver already is the one
place that turns credentials into identities (hashed per-caller tokens re-read on change,
OIDC, groups, ``delegate``), so a pipeline's token is revoked by editing one file and no
key has to reach every worker. The cost is that events written straight to Kafka stay
unproven — which is the point: only what passed the receiver carries ``authenticated_by``
(protect the raw topics with Kafka ACLs so nothing else can claim it; docs/receiver.md).

Errors: ``ReceiverRefused`` (4xx: the credential, the actor or the event was refused —
retrying will not help) and ``ReceiverUnavailable`` (no answer, 5xx: retry the step). The
token is never logged nor put in a message.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from producers._errors import ProducerError


class ReleaseSenderSettings(BaseSettings):
    """How ``gpuledger release`` proves who runs it; env ``GPULEDGER_RELEASE_<FIELD>``."""

    model_config = SettingsConfigDict(env_prefix="GPULEDGER_RELEASE_", extra="ignore")

    receiver_url: str | None = Field(default=None, description="Base URL of `gpuledger receive` (e.g. https://gpuledger-receiver:9095): events go to its /v1/releases with the token and are stored as the token's identity. Unset: straight to Kafka, unauthenticated.")
    token: SecretStr | None = Field(default=None, description="Bearer token of the caller (a credentials-file token or an OIDC JWT); prefer token_file.")
    token_file: Path | None = Field(default=None, description="File holding the bearer token (read at each run, surrounding whitespace ignored): e.g. a mounted Secret or a CI job's OIDC token file.")
    ca_file: Path | None = Field(default=None, description="PEM CA bundle that signed the receiver's TLS certificate (default: the system's).")
    timeout_s: float = Field(default=45.0, gt=0, description="How long to wait for the receiver's answer (it answers after Kafka's acknowledgement).")

    @model_validator(mode="after")
    def _consistent(self) -> ReleaseSenderSettings:
        problems = []
        if self.token is not None and self.token_file is not None:
            problems.append("GPULEDGER_RELEASE_TOKEN and GPULEDGER_RELEASE_TOKEN_FILE: give one of them")
        if self.receiver_url is None and (self.token is not None or self.token_file is not None):
            problems.append("GPULEDGER_RELEASE_TOKEN(_FILE) needs GPULEDGER_RELEASE_RECEIVER_URL: a token proves nothing to Kafka")
        if self.receiver_url is not None:
            if not self.receiver_url.startswith(("http://", "https://")):
                problems.append(f"GPULEDGER_RELEASE_RECEIVER_URL: expected http(s)://host:port, got {self.receiver_url!r}")
            if self.token is None and self.token_file is None:
                problems.append("GPULEDGER_RELEASE_RECEIVER_URL needs GPULEDGER_RELEASE_TOKEN_FILE (or _TOKEN): without a credential "
                                "the receiver cannot prove who ran the command")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def through_receiver(self) -> bool:
        return self.receiver_url is not None

    def bearer(self) -> str:
        """The token, read now (a rotated token file is picked up by the next run)."""
        if self.token is not None:
            return self.token.get_secret_value()
        try:
            token = self.token_file.read_text().strip()
        except OSError as exc:
            raise ReceiverRefused(f"cannot read the token file {self.token_file}: {exc.strerror or exc} (GPULEDGER_RELEASE_TOKEN_FILE)") from exc
        if not token:
            raise ReceiverRefused(f"the token file {self.token_file} is empty (GPULEDGER_RELEASE_TOKEN_FILE)")
        return token


class ReceiverRefused(ProducerError):
    """The receiver refused the event (4xx) or no credential could be read: retrying will not help."""


class ReceiverUnavailable(ProducerError):
    """The receiver did not answer, or answered 5xx (e.g. Kafka down): retry the step."""


def send_through_receiver(settings: ReleaseSenderSettings, event) -> str:
    """POST ``event`` to the receiver's /v1/releases with the caller's token; the stored event id."""
    import requests

    url = settings.receiver_url.rstrip("/") + "/v1/releases"
    headers = {"Authorization": f"Bearer {settings.bearer()}", "Content-Type": "application/json"}
    body = event.model_dump_json(exclude={"event_id"})
    try:
        answer = requests.post(url, data=body, headers=headers, timeout=settings.timeout_s,
                               verify=str(settings.ca_file) if settings.ca_file else True)
    except requests.RequestException as exc:
        raise ReceiverUnavailable(f"{url}: {type(exc).__name__}: {exc}") from exc
    try:
        data = answer.json()
    except ValueError:
        data = {}
    error = data.get("error") if isinstance(data, dict) else None
    if answer.status_code >= 500:
        raise ReceiverUnavailable(f"{url} answered {answer.status_code}: {error or answer.reason}")
    if answer.status_code != 200:
        raise ReceiverRefused(f"{url} refused the event ({answer.status_code}): {error or answer.reason}")
    ids = data.get("event_ids") if isinstance(data, dict) else None
    if not ids:
        raise ReceiverUnavailable(f"{url} answered 200 without an event id: {data!r}")
    return ids[0]
