"""MLflow Model Registry webhooks → release events: signature check, de-dup, mapping.

Input: one delivery of an MLflow (OSS, 3.3+) registry webhook — the raw body
``{"entity", "action", "timestamp", "data"}`` (plus ``workspace`` when MLflow runs with
workspaces) and its headers ``X-MLflow-Delivery-Id``, ``X-MLflow-Timestamp`` (unix
seconds) and, when the webhook has a secret, ``X-MLflow-Signature: v1,<base64>`` =
HMAC-SHA256(secret, ``"{delivery_id}.{timestamp}.{body}"``).
Output: zero or one ``ReleaseEvent`` per delivery, derived through
``MlflowReleaseMapping`` (MLflow has no approve/promote/retire events; stages are
deprecated, so lifecycle facts are read from aliases and tags):

============================================  =============================================
MLflow delivery                               gpuledger release event (defaults)
============================================  =============================================
``model_version.created``                     ``release.registered`` (identity from tags)
``model_version_alias.created`` alias→env     ``release.promoted`` to that environment
``model_version_tag.set`` approved=true       ``release.approved``
``model_version_tag.set`` evaluated=true      ``release.evaluated``
``model_version_tag.set`` retired=true        ``release.retired``
``model_version_tag.set`` revoked=true        ``release.revoked``
``registered_model.created``                  nothing (no version, so no release)
``model_version_alias.deleted``               nothing (MLflow does not say which version)
``model_version_tag.deleted``                 nothing
"Test webhook" (``TEST_PAYLOADS``)            nothing (answered ``test_delivery: true``)
alias not in ``alias_environments``           nothing
============================================  =============================================

Guarantees: ``release_id`` = ``release_id_template`` (default ``{model}:{version}``);
``event_id = make_event_id("mlflow", (entity, action, release_id, alias|tag key, tag
value), X-MLflow-Delivery-Id)``: every distinct delivery is a distinct fact (an alias
moved back to a version it held before is a new event, never collapsed into the first
move), and MLflow's retries of one delivery keep its id and headers, so they get the
same id; the receiver also drops a delivery id it already published (``DeliveryLog``,
bounded LRU). Without the header (an unsigned sender that omits it) the body's
timestamp stands in for it.
Alias moves: ``AliasHolders`` knows which version held each (model, alias) when, loaded
from the release topic at start and kept by the receiver — proven moves only (a signed
delivery, or one whose bearer token proved its caller where no secret is set). A move records the previous
holder as ``superseded_release_id``; a move to an *earlier* version (lower version
number) is a rollback: ``release.rolled_back`` of the version that held the alias, then
``release.promoted`` of the earlier one, both at the delivery's time.
Limits: the MLflow user who acted is not in the payload, so ``actor`` is empty; the
alias holders live in each receiver process (several replicas each learn the topic at
start, but not each other's moves afterwards) — run one receiver for MLflow; MLflow delivers
from a pool of threads, so the server judges an alias move ``ALIAS_SETTLE_S`` after its own time
(``producers.receiver.server``): a move delivered later than that behind one it precedes is
still judged without it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import threading
import time
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gpuledger.timefmt import parse_timestamp
from producers._errors import PayloadError
from schemas.envelope import Identity, Source, TraceContext, identity_text_problem, make_event_id
from schemas.release import ReleaseEvent, ReleaseEventType, ReleasePayload

COLLECTOR = "mlflow"
SIGNATURE_HEADER = "X-MLflow-Signature"
TIMESTAMP_HEADER = "X-MLflow-Timestamp"
DELIVERY_ID_HEADER = "X-MLflow-Delivery-Id"

#: Every (entity, action) MLflow's model registry sends, with the data fields each needs.
REGISTRY_EVENTS: dict[tuple[str, str], tuple[str, ...]] = {
    ("registered_model", "created"): ("name",),
    ("model_version", "created"): ("name", "version"),
    ("model_version_tag", "set"): ("name", "version", "key", "value"),
    ("model_version_tag", "deleted"): ("name", "version", "key"),
    ("model_version_alias", "created"): ("name", "alias", "version"),
    ("model_version_alias", "deleted"): ("name", "alias"),
}


#: What MLflow sends for "Test webhook" (its UI's button, ``MlflowClient.test_webhook``): the
#: ``example()`` payload of the event type (``mlflow/webhooks/types.py``, MLflow 3.17), signed like
#: any delivery and marked by nothing else. No registry change produces them (MLflow refuses a
#: ``models:/`` source for a new version), so a body equal to one is a test, never a release.
TEST_PAYLOADS: dict[tuple[str, str], dict[str, Any]] = {
    ("registered_model", "created"): {"name": "example_model", "tags": {"example_key": "example_value"},
                                      "description": "An example registered model"},
    ("model_version", "created"): {"name": "example_model", "version": "1", "source": "models:/123", "run_id": "abcd1234abcd5678",
                                   "tags": {"example_key": "example_value"}, "description": "An example model version"},
    ("model_version_tag", "set"): {"name": "example_model", "version": "1", "key": "example_key", "value": "example_value"},
    ("model_version_tag", "deleted"): {"name": "example_model", "version": "1", "key": "example_key"},
    ("model_version_alias", "created"): {"name": "example_model", "alias": "example_alias", "version": "1"},
    ("model_version_alias", "deleted"): {"name": "example_model", "alias": "example_alias"},
}


def is_test_delivery(body: Any) -> bool:
    """Whether ``body`` is MLflow's "Test webhook" delivery (``TEST_PAYLOADS``)."""
    if not isinstance(body, dict):
        return False
    example = TEST_PAYLOADS.get((body.get("entity"), body.get("action")))
    return example is not None and body.get("data") == example


class SignatureError(PayloadError):
    """A delivery whose HMAC signature is missing, stale or wrong (HTTP 401)."""

    def __init__(self, message: str, field: str = SIGNATURE_HEADER) -> None:
        super().__init__(message, field=field, reason="bad_signature", status=401)


class TagRule(BaseModel):
    """``model_version_tag.set`` with this key and value becomes ``event_type``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str = Field(min_length=1, description="Model version tag key, e.g. 'approved'.")
    value: str = Field(default="true", description="Tag value that triggers the rule (compared case-insensitively).")
    event_type: ReleaseEventType = Field(description="Release event emitted when the tag is set to that value.")


class MlflowReleaseMapping(BaseModel):
    """How MLflow registry deliveries become gpuledger release events."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    release_id_template: str = Field(default="{model}:{version}", description="release_id of an MLflow model version; placeholders {model}, {version}, {workspace}.")
    version_created_event: ReleaseEventType | None = Field(default="release.registered", description="Event for model_version.created; null ignores it.")
    alias_created_event: ReleaseEventType = Field(default="release.promoted", description="Event for an alias (listed in alias_environments) set on a version.")
    alias_environments: dict[str, str] = Field(
        default={"prod": "prod", "production": "prod", "champion": "prod", "staging": "staging", "challenger": "staging", "eval": "eval", "dev": "dev"},
        description="Alias → environment it deploys to; aliases not listed are ignored.")
    tag_rules: list[TagRule] = Field(
        default=[
            TagRule(key="approved", event_type="release.approved"),
            TagRule(key="evaluated", event_type="release.evaluated"),
            TagRule(key="retired", event_type="release.retired"),
            TagRule(key="revoked", event_type="release.revoked"),
        ],
        description="Tag rules for model_version_tag.set; tags matching no rule are ignored.")
    identity_tags: dict[str, str] = Field(
        default={"artifact_digest": "artifact_digest", "image_digest": "image_digest", "config_digest": "config_digest",
                 "dataset_ref": "dataset_ref", "owner": "owner", "data_class": "data_class"},
        description="Identity field → model version tag carrying it (read from model_version.created tags).")

    @field_validator("release_id_template")
    @classmethod
    def _template(cls, value: str) -> str:
        try:
            value.format(model="m", version="1", workspace="w")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"unknown placeholder or bad format ({exc}); use {{model}}, {{version}}, {{workspace}}") from exc
        if "{model}" not in value or "{version}" not in value:
            raise ValueError("must contain {model} and {version}, or two versions would share a release_id")
        return value

    @field_validator("identity_tags")
    @classmethod
    def _identity_fields(cls, value: dict[str, str]) -> dict[str, str]:
        unknown = sorted(set(value) - set(Identity.model_fields))
        if unknown:
            raise ValueError(f"not identity fields: {', '.join(unknown)}")
        return value

    @model_validator(mode="after")
    def _unambiguous_rules(self) -> MlflowReleaseMapping:
        seen: set[tuple[str, str]] = set()
        dupes = []
        for rule in self.tag_rules:
            key = (rule.key, rule.value.lower())
            if key in seen:
                dupes.append(f"{rule.key}={rule.value}")
            seen.add(key)
        if dupes:
            raise ValueError(f"tag_rules: more than one rule for {', '.join(dupes)}")
        return self

    def release_id(self, model: str, version: str, workspace: str | None) -> str:
        return self.release_id_template.format(model=model, version=version, workspace=workspace or "")

    def tag_event(self, key: str, value: str) -> ReleaseEventType | None:
        for rule in self.tag_rules:
            if rule.key == key and rule.value.lower() == value.strip().lower():
                return rule.event_type
        return None


def sign(secret: str, delivery_id: str, timestamp: str, body: bytes) -> str:
    """The ``X-MLflow-Signature`` value MLflow sends (used by tests and by verify)."""
    content = delivery_id.encode() + b"." + timestamp.encode() + b"." + body
    digest = hmac.new(secret.encode(), content, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def verify_signature(secret: str, headers: Any, body: bytes, tolerance_s: float = 300.0, now: float | None = None) -> None:
    """Raise ``SignatureError`` unless the delivery is signed with ``secret``.

    ``headers`` is any case-insensitive mapping. The timestamp check rejects replays
    older (or newer) than ``tolerance_s`` seconds; 0 turns it off. MLflow retries a
    failed delivery with the original headers and backs off up to a minute, so keep the
    tolerance above its retry window.
    """
    signature = headers.get(SIGNATURE_HEADER)
    delivery_id = headers.get(DELIVERY_ID_HEADER)
    timestamp = headers.get(TIMESTAMP_HEADER)
    if not signature:
        raise SignatureError(f"{SIGNATURE_HEADER}: header required (this endpoint has a webhook secret)")
    if not delivery_id:
        raise SignatureError(f"{DELIVERY_ID_HEADER}: header required for a signed delivery", field=DELIVERY_ID_HEADER)
    if not timestamp:
        raise SignatureError(f"{TIMESTAMP_HEADER}: header required for a signed delivery", field=TIMESTAMP_HEADER)
    if tolerance_s:
        try:
            age = (time.time() if now is None else now) - int(timestamp)
        except ValueError as exc:
            raise SignatureError(f"{TIMESTAMP_HEADER}: not unix seconds: {timestamp!r}", field=TIMESTAMP_HEADER) from exc
        if abs(age) > tolerance_s:
            raise SignatureError(f"{TIMESTAMP_HEADER}: delivery is {age:.0f}s old, outside the {tolerance_s:.0f}s window", field=TIMESTAMP_HEADER)
    expected = sign(secret, delivery_id, timestamp, body)
    # Accept a space-separated list ("v1,a v1,b"), as Standard Webhooks senders do while
    # rotating secrets; compare in constant time.
    if not any(hmac.compare_digest(candidate.strip(), expected) for candidate in signature.split(" ") if candidate.strip()):
        raise SignatureError(f"{SIGNATURE_HEADER}: signature does not match the body")


class DeliveryLog:
    """Bounded LRU of MLflow delivery ids already published (thread-safe).

    Only remembered after Kafka acknowledged the events, so a delivery that failed
    with 503 is processed again when MLflow retries it.
    """

    def __init__(self, size: int = 10_000) -> None:
        self.size = size
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def seen(self, delivery_id: str | None) -> bool:
        if not delivery_id:
            return False
        with self._lock:
            if delivery_id in self._ids:
                self._ids.move_to_end(delivery_id)
                return True
            return False

    def remember(self, delivery_id: str | None) -> None:
        if not delivery_id or self.size <= 0:
            return
        with self._lock:
            self._ids[delivery_id] = None
            self._ids.move_to_end(delivery_id)
            while len(self._ids) > self.size:
                self._ids.popitem(last=False)


@dataclass(frozen=True)
class AliasHolder:
    """The model version that holds an alias, since when."""

    version: str
    release_id: str
    since: datetime


def _earlier(version: str, than: str) -> bool:
    """MLflow numbers versions 1, 2, 3…; anything else is not ordered (never a rollback)."""
    return version.isdigit() and than.isdigit() and int(version) < int(than)


class AliasHolders:
    """Which version held each (workspace, model, alias) when: the memory MLflow's payload lacks.

    Fed by ``observe`` with every release event an MLflow alias move produced — read back
    from the release topic at start (``ready`` is set once it was read to its end), then
    each move this receiver published. ``before`` answers from the moves strictly earlier
    than a delivery's own time, so the answer for one delivery is the same whatever the
    order the topic was read in, and a re-delivery (even to a restarted receiver) maps to
    the very same events. Thread-safe.
    """

    def __init__(self, proven_by: Collection[str] | None = None) -> None:
        # Only a proven event is a move: ``authenticated_by`` set, and one of ``proven_by`` (the
        # proofs /v1/mlflow takes) when given. A body POSTed to /v1/releases that only said it came
        # from MLflow (its ``source.collector`` and an ``mlflow.alias`` tag are the caller's to
        # write) was taken for a move, and the next genuine delivery was published as a rollback of
        # it — with the proven actor of that delivery. So an unproven delivery (no secret, no token)
        # becomes no holder: where none is proven, moves supersede nothing and roll nothing back.
        self.proven_by = frozenset(proven_by) if proven_by is not None else None
        self._moves: dict[tuple[str, str, str], list[tuple[datetime, str, str]]] = {}
        self._lock = threading.Lock()
        self.ready = threading.Event()

    def before(self, workspace: str | None, model: str, alias: str, at: datetime) -> AliasHolder | None:
        """The holder of the alias just before ``at`` (None if it had none)."""
        with self._lock:
            earlier = [move for move in self._moves.get((workspace or "", model, alias), ()) if move[0] < at]
        if not earlier:
            return None
        since, version, release_id = max(earlier)
        return AliasHolder(version, release_id, since)

    def observe(self, event: ReleaseEvent) -> None:
        tags = event.payload.tags
        alias = tags.get("mlflow.alias")
        if event.source.collector != COLLECTOR or not alias or event.event_type == "release.rolled_back" \
                or not event.identity.model_name or not event.identity.model_version:
            return
        proof = event.payload.authenticated_by
        if proof is None or (self.proven_by is not None and proof not in self.proven_by):
            return
        key = (tags.get("mlflow.workspace") or "", event.identity.model_name, alias)
        move = (event.occurred_at, event.identity.model_version, event.identity.release_id)
        with self._lock:
            moves = self._moves.setdefault(key, [])
            if move not in moves:
                moves.append(move)


def _envelope(body: Any) -> tuple[str, str, datetime, dict, str | None]:
    if not isinstance(body, dict):
        raise PayloadError(f"<body>: must be a JSON object, got {type(body).__name__}")
    problems: list[tuple[str, str]] = []
    for name in ("entity", "action", "timestamp"):
        if not isinstance(body.get(name), str) or not body[name]:
            problems.append((name, "field required (a non-empty string)"))
    if not isinstance(body.get("data"), dict):
        problems.append(("data", "field required (an object)"))
    if problems:
        raise PayloadError("; ".join(f"{f}: {m}" for f, m in problems), field=problems[0][0])
    entity, action = body["entity"], body["action"]
    if (entity, action) not in REGISTRY_EVENTS:
        supported = ", ".join(f"{e}.{a}" for e, a in REGISTRY_EVENTS)
        raise PayloadError(f"action: {entity}.{action} is not an MLflow model registry event gpuledger knows (supported: {supported})",
                           field="action", reason="unknown_event_type")
    try:
        occurred = parse_timestamp(body["timestamp"])
    except ValueError as exc:
        raise PayloadError(f"timestamp: {exc}", field="timestamp") from exc
    data = body["data"]
    missing = []
    for name in REGISTRY_EVENTS[(entity, action)]:
        value = data.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and name == "version":
            data = {**data, name: str(value)}
        elif not isinstance(value, str) or not value.strip():
            missing.append(f"data.{name}")
    if missing:
        raise PayloadError("; ".join(f"{m}: field required (a non-empty string)" for m in missing), field=missing[0])
    workspace = body.get("workspace") if isinstance(body.get("workspace"), str) else None
    # What becomes an identifier (names, versions, aliases, tag keys and the tags read as
    # identity) must be free of control and bidi characters; tag values in general are free text.
    named = {f"data.{name}": data[name] for name in REGISTRY_EVENTS[(entity, action)] if name != "value"}
    named.update({"workspace": workspace} if workspace else {})
    if isinstance(data.get("tags"), dict):
        named.update({f"data.tags[{k!r}]": str(k) for k in data["tags"]})  # every tag name (values are free text)
    bad = [(where, problem) for where, value in named.items() if (problem := identity_text_problem(str(value)))]
    if bad:
        raise PayloadError("; ".join(f"{where}: {problem}" for where, problem in bad), field=bad[0][0], reason="control_character")
    return entity, action, occurred, data, workspace


@dataclass
class _Mapped:
    """What one delivery means: the event type and payload of its release, the parts of
    the natural key beyond (entity, action, release), identity fields it adds, and the
    events that come before it (the rollback of an alias's previous holder)."""

    event_type: str
    payload: ReleasePayload
    discriminator: tuple[str, ...] = ()
    identity: dict[str, str] = field(default_factory=dict)
    before: list[ReleaseEvent] = field(default_factory=list)


def release_events(
    body: Any,
    mapping: MlflowReleaseMapping | None = None,
    observed_at: datetime | None = None,
    host: str = "",
    trace: TraceContext | None = None,
    delivery_id: str | None = None,
    holders: AliasHolders | None = None,
) -> list[ReleaseEvent]:
    """Map one MLflow delivery body to release events (possibly none), or raise ``PayloadError``.

    ``delivery_id`` (``X-MLflow-Delivery-Id``) makes each delivery its own fact;
    ``holders`` says who held an alias before this move (see ``AliasHolders``).
    """
    mapping = mapping or MlflowReleaseMapping()
    entity, action, occurred, data, workspace = _envelope(body)
    if is_test_delivery(body):
        return []
    if (entity, action) not in {("model_version", "created"), ("model_version_alias", "created"), ("model_version_tag", "set")}:
        return []
    ctx = _Delivery(entity, action, occurred, delivery_id or occurred.isoformat(), Source(collector=COLLECTOR, host=host),
                    observed_at or datetime.now(timezone.utc), trace or TraceContext(), data["name"].strip(), str(data["version"]).strip(),
                    workspace)
    release_id = mapping.release_id(ctx.model, ctx.version, workspace)
    tags: dict[str, str] = {"mlflow.workspace": workspace} if workspace else {}
    if entity == "model_version":
        mapped = _version_created(data, mapping, tags)
    elif entity == "model_version_alias":
        mapped = _alias_set(data, mapping, tags, ctx, release_id, holders)
    else:
        mapped = _tag_set(data, mapping, tags, ctx.version)
    if mapped is None:
        return []
    identity = {"release_id": release_id, "model_name": ctx.model, "model_version": ctx.version, **mapped.identity}
    return [*mapped.before, ctx.event(mapped.event_type, (release_id, *mapped.discriminator), Identity(**identity), mapped.payload)]


@dataclass
class _Delivery:
    """One delivery's envelope facts, shared by the events it becomes."""

    entity: str
    action: str
    occurred: datetime
    delivery: str
    source: Source
    observed: datetime
    trace: TraceContext
    model: str
    version: str
    workspace: str | None

    def event(self, event_type: str, key: tuple[str, ...], identity: Identity, payload: ReleasePayload) -> ReleaseEvent:
        return ReleaseEvent(event_id=make_event_id(COLLECTOR, (self.entity, self.action, *key), self.delivery), event_type=event_type,
                            occurred_at=self.occurred, observed_at=self.observed, source=self.source, identity=identity,
                            trace=self.trace, payload=payload)


def _version_created(data: dict, mapping: MlflowReleaseMapping, tags: dict[str, str]) -> _Mapped | None:
    """model_version.created: a registration; identity tags (e.g. digests) read from the version's tags."""
    event_type = mapping.version_created_event
    if event_type is None:
        return None
    version_tags = data.get("tags") if isinstance(data.get("tags"), dict) else {}
    version_tags = {str(k): str(v) for k, v in version_tags.items() if v is not None}
    identity: dict[str, str] = {}
    for name, tag in mapping.identity_tags.items():
        if version_tags.get(tag):
            problem = identity_text_problem(version_tags[tag])
            if problem:
                raise PayloadError(f"data.tags.{tag}: {problem}", field=f"data.tags.{tag}", reason="control_character")
            identity[name] = version_tags[tag]
    tags = {**tags, **version_tags}
    for name in ("source", "run_id"):
        if isinstance(data.get(name), str) and data[name]:
            tags[f"mlflow.{name}"] = data[name]
    description = data.get("description")
    return _Mapped(event_type, ReleasePayload(reason=description if isinstance(description, str) and description else None, tags=tags),
                   identity=identity)


def _alias_set(data: dict, mapping: MlflowReleaseMapping, tags: dict[str, str], ctx: _Delivery, release_id: str,
               holders: AliasHolders | None) -> _Mapped | None:
    """model_version_alias.created on an environment alias: a promotion — and, when the
    alias moves back to an earlier version, first the rollback of the version it leaves."""
    alias = data["alias"].strip()
    environment = mapping.alias_environments.get(alias)
    if environment is None:
        return None
    previous = holders.before(ctx.workspace, ctx.model, alias, ctx.occurred) if holders is not None else None
    superseded, before = None, []
    reason = f"MLflow alias '{alias}' set on version {ctx.version}"
    if previous is not None and previous.version != ctx.version:
        superseded = previous.release_id
        reason += f" (was on version {previous.version})"
        if _earlier(ctx.version, previous.version):
            moved = f"MLflow alias '{alias}' moved back from version {previous.version} to {ctx.version}"
            reason = f"{moved}: re-promoted"
            before.append(ctx.event("release.rolled_back", ("release.rolled_back", previous.release_id, alias),
                                    Identity(release_id=previous.release_id, model_name=ctx.model, model_version=previous.version,
                                             environment=environment),
                                    ReleasePayload(to_environment=environment, superseded_release_id=release_id,
                                                   reason=f"{moved}: rolled back", tags={**tags, "mlflow.alias": alias})))
    payload = ReleasePayload(to_environment=environment, reason=reason, superseded_release_id=superseded, tags={**tags, "mlflow.alias": alias})
    return _Mapped(mapping.alias_created_event, payload, (alias,), {"environment": environment}, before)


def _tag_set(data: dict, mapping: MlflowReleaseMapping, tags: dict[str, str], version: str) -> _Mapped | None:
    """model_version_tag.set: the lifecycle event the mapping gives that tag value, if any."""
    key, value = data["key"], data["value"]
    event_type = mapping.tag_event(key, value)
    if event_type is None:
        return None
    return _Mapped(event_type, ReleasePayload(reason=f"MLflow tag {key}={value} set on version {version}", tags={**tags, key: value}),
                   (key, value))
