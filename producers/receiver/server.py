"""The lifecycle-plane HTTP receiver: Alertmanager, MLflow and release events → Kafka.

Input: HTTP POSTs — ``/v1/alertmanager`` (Alertmanager webhook v4), ``/v1/releases``
(gpuledger ``ReleaseEvent`` JSON, one object or a list) and ``/v1/mlflow`` (MLflow
Model Registry webhooks); ``GET /healthz`` (process up) and ``GET /readyz`` (Kafka
reachable).
Output: alert events on the alert topic, release events on the release topic, keyed
by the shared correlation key, through the one ``EventPublisher``.
Guarantees:
- A 2xx answer is sent only after ``publish_batch`` returned, i.e. every event of the
  request is acknowledged by Kafka (acks=all, idempotent producer). Broker trouble →
  503 with a JSON error; the sender retries, and because event ids are deterministic a
  partly written batch re-sent is collapsed downstream.
- Bad input never reaches a topic: 400 (not JSON), 401 (a credential presented and not
  valid, or required and missing), 403 (valid but not allowed: another actor, an
  ``on_behalf_of`` without the delegate right), 413 (body over ``max_body_bytes``), 415 (not
  ``application/json``), 422 (fails validation; ``field`` names the culprit). A request is
  all-or-nothing.
- Who did it is proven (``producers.receiver.auth``): a release event's ``actor`` is the
  authenticated caller, ``authenticated_by`` says how (null = unauthenticated, whatever the
  body claimed), and its ``event_id`` is computed here from the caller, the natural key and
  the event time — a caller-supplied id is ignored. A non-loopback bind with no credential
  configured is refused unless ``allow_unauthenticated``.
- Nothing that cannot travel is accepted. The body is bounded by ``max_body_bytes``
  (413, ``limit_bytes`` in the answer). Each event must encode within the publisher's
  ``max_event_bytes`` (a quarter of the raw topics' ``max.message.bytes``, at most
  256 KiB: the stream worker re-encodes events into bigger records); an event over it
  gets 422 with ``field`` (``alerts[3]``, ``[2]`` for a list of release events),
  ``limit_bytes``, ``size_bytes`` and ``event_id``. Alertmanager free text (annotation
  values, ``generatorURL``) is cut to 8 KiB per field with a ``…[truncated N bytes]``
  marker — the answer's ``truncated_fields`` names each cut field, and they are counted
  (``gpuledger.fields.truncated``); labels and fingerprints are identity and are never
  cut: a value over 4 KiB gets 422 naming it. Release and MLflow events are not cut
  (their sender chose every byte), only refused when over the event limit.
- The event loop never blocks on Kafka: records are produced on the loop and their acks
  awaited (``EventPublisher.publish_batch_async``, acks served on the loop), so requests
  in flight hold no thread; readiness checks run in a thread. Nor on the identity provider:
  a JWT whose key is not in PyJWT's cache is verified on the JWKS thread pool (``_principal``).
- Slow clients cannot hold the service: a connection must send its headers within
  ``header_timeout_s`` (``ConnectionGuard``), a body within ``body_timeout_s`` (408), and
  connections over ``max_connections`` get 503 at once.
Limits: MLflow delivery de-duplication is in memory (per process, bounded LRU); a
restarted or second replica relies on the deterministic event ids instead. One INFO
log line per accepted request (a request is a batch); bodies are never logged.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import orjson
import uvloop
from aiohttp import web

from gpuledger import gctune
from gpuledger.telemetry import ComponentCounters
from producers._errors import EventTooLarge, PayloadError, ProducerError, PublishError
from producers._kafka import EventPublisher, read_to_end
from producers._limits import TextTrimmer
from producers.receiver.alertmanager import alert_events, truncated_alerts
from producers.receiver.auth import Authenticator, AuthError, CredentialsFile, KeyFetchNeeded, OidcVerifier, Principal
from producers.receiver.config import ReceiverSettings
from producers.receiver.mlflow import DELIVERY_ID_HEADER, AliasHolders, DeliveryLog, is_test_delivery, release_events, verify_signature
from producers.releases import deciders, release_natural_key
from schemas.envelope import SCHEMA_VERSION, TraceContext, make_event_id
from schemas.events import EVENT_TYPES, EventDecodeError, decode_event, encode_event
from schemas.outputs import dead_letter
from schemas.release import ReleaseEvent, ReleasePayload
from streams.controls.policy import Policy

log = logging.getLogger(__name__)

SOURCES = ("alertmanager", "releases", "mlflow")
#: ``event_id`` source of release events the receiver identifies (``_proven``).
EVENT_ID_SOURCE = "receiver"
_ID_PLACEHOLDER = "assigned-by-the-receiver"


def _error(status: int, message: str, field: str | None = None, **extra: Any) -> web.Response:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return web.json_response({"error": message, "field": field, **extra}, status=status, headers=headers)


def _decode_error_field(exc: EventDecodeError) -> str | None:
    """The field an ``EventDecodeError`` names first ("occurred_at: ..." → occurred_at)."""
    if exc.reason in ("not_json", "not_object"):
        return None
    first = str(exc).split(";")[0]
    field = first.split(":", 1)[0].strip() if ":" in first else None
    if field in (None, "<root>"):
        # Model-level checks ("identity.release_id is required ...") carry the field in the text.
        match = re.search(r"([a-z_]+(?:\.[a-z_]+)+) is required", first)
        return match.group(1) if match else None
    return field


def _trace(request: web.Request) -> TraceContext | None:
    parent = request.headers.get("traceparent")
    return TraceContext(traceparent=parent, tracestate=request.headers.get("tracestate")) if parent else None

#: How a signed MLflow delivery's events are proven (``authenticated_by``).
MLFLOW_PROOF = "mlflow-webhook"
#: The proofs of an MLflow alias move where no secret is set: a bearer token on /v1/mlflow (the
#: credentials file's or an OIDC JWT; shared tokens are per other endpoint), or an earlier signature.
MLFLOW_TOKEN_PROOFS = ("token", "oidc", MLFLOW_PROOF)
#: Seconds after an MLflow alias move's own time (its payload's ``timestamp``) before the receiver
#: judges it: MLflow delivers webhooks from a pool of threads (``MLFLOW_WEBHOOK_DELIVERY_MAX_WORKERS``,
#: 10), so moves made back to back arrive in any order, and a move judged before the earlier one
#: it follows arrived recorded no previous holder (a rollback read as a first promotion). Held
#: this long, the moves of one burst are judged one at a time in the order they were made (the
#: holders answer from moves strictly before a delivery's time; the waits end in that order). A
#: delivery later than this behind the one after it is still judged without it (docs/receiver.md).
ALIAS_SETTLE_S = 1.0


def _settle_wait(data: dict) -> float:
    """How long an alias move still waits: until ``ALIAS_SETTLE_S`` after its own time, at most
    that long (another machine's clock ahead or behind bounds nothing else)."""
    from gpuledger.timefmt import parse_timestamp

    try:
        occurred = parse_timestamp(data["timestamp"])
    except Exception:  # noqa: BLE001 - an unreadable timestamp is release_events' to refuse, with its field
        return 0.0
    left = (occurred - datetime.now(timezone.utc)).total_seconds() + ALIAS_SETTLE_S
    return min(max(left, 0.0), ALIAS_SETTLE_S)


def _stamped(event: ReleaseEvent, **update: Any) -> ReleaseEvent:
    """``event`` with its payload's ``update`` (who proved it), validated again. ``model_copy(update=…)``
    validates nothing: a token's identity the schema refuses was stamped on, answered 200, and the
    worker dead-lettered the event — accepted, never recorded. The edge checks credentials
    (``producers.receiver.auth``); this keeps anything unvalidated off the topic all the same."""
    return event.model_copy(update={"payload": ReleasePayload.model_validate({**event.payload.model_dump(), **update})})


def _proof(principal: Principal | None) -> dict[str, Any]:
    """The payload fields that say who proved an event, as this receiver vouches for them: the
    authenticated caller's, or none (whatever the body claimed)."""
    if principal is None:
        return {"authenticated_by": None, "actor_groups": ()}
    return {"actor": principal.identity, "authenticated_by": principal.method, "actor_groups": principal.groups}


class LifecycleReceiver:
    """The aiohttp application behind ``gpuledger receive``.

    ``publisher`` is owned by the caller (closed by whoever created it).
    """

    def __init__(self, config: ReceiverSettings, publisher: EventPublisher, publish_timeout_s: float = 35.0, host: str | None = None,
                 policy: Policy | None = None) -> None:
        self.config = config
        self.policy = policy or Policy()
        self.auth = authenticator_for(config)
        self.publisher = publisher
        self.publish_timeout_s = config.publish_timeout_s or publish_timeout_s
        self.host = host if host is not None else socket.gethostname()
        self.counters = {source: ComponentCounters(f"receiver.{source}") for source in SOURCES}
        self.deliveries = DeliveryLog(config.mlflow_dedup_size)
        # Holders are the moves /v1/mlflow proved: by the signature when a secret is set (it takes
        # nothing else then), else by a caller's token (and moves signed while a secret was set).
        self.alias_holders = AliasHolders(proven_by=(MLFLOW_PROOF,) if self.config.mlflow_secret is not None else MLFLOW_TOKEN_PROOFS)
        self._alias_moves: asyncio.Lock | None = None  # one alias move at a time: read holder, publish, update
        self._stopping = threading.Event()
        self.guard: ConnectionGuard | None = None  # set by ``serve``
        self._jwks: ThreadPoolExecutor | None = None  # JWKS fetches, off the event loop (``_principal``)

    def _jwks_pool(self) -> ThreadPoolExecutor:
        # Its own small pool: a slow identity provider must not take the default executor's
        # threads (readiness checks, dead letters) with it. PyJWT serialises fetches anyway.
        if self._jwks is None:
            self._jwks = ThreadPoolExecutor(max_workers=2, thread_name_prefix="jwks")
        return self._jwks

    async def _prefetch_jwks(self, app: web.Application) -> None:
        if self.auth.oidc is not None and self.auth.oidc.fetches:
            self._jwks_pool().submit(self.auth.oidc.prefetch)

    async def _stop_jwks(self, app: web.Application) -> None:
        if self._jwks is not None:
            self._jwks.shutdown(wait=False, cancel_futures=True)

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[self._hold, self._errors])
        app.on_startup.append(self._start_loading_alias_holders)
        app.on_startup.append(self._prefetch_jwks)
        app.on_cleanup.append(self._stop_loading)
        app.on_cleanup.append(self._stop_jwks)
        app.add_routes([
            web.post("/v1/alertmanager", self.alertmanager, name="alertmanager"),
            web.post("/v1/releases", self.releases, name="releases"),
            web.post("/v1/mlflow", self.mlflow, name="mlflow"),
            web.get("/healthz", self.healthz, name="healthz"),
            web.get("/readyz", self.readyz, name="readyz"),
        ])
        return app

    # --- MLflow alias holders, from the release topic -----------------------------

    async def _start_loading_alias_holders(self, app: web.Application) -> None:
        self._alias_moves = asyncio.Lock()
        threading.Thread(target=self._load_alias_holders, name="alias-holders", daemon=True).start()

    async def _stop_loading(self, app: web.Application) -> None:
        self._stopping.set()

    def _load_alias_holders(self) -> None:
        """Read the release topic once to its end into ``alias_holders``; retried while Kafka is down."""
        topic = self.publisher.catalogue.release

        def observe(value: bytes) -> None:
            try:
                event = decode_event(value)
            except EventDecodeError:
                return  # the worker dead-letters it; it cannot be an alias move we know
            if isinstance(event, ReleaseEvent):
                self.alias_holders.observe(event)

        wait = 1.0
        while not self._stopping.is_set():
            try:
                n = read_to_end(self.publisher.client_config, topic, observe, timeout=max(self.publish_timeout_s, 10))
            except PublishError as exc:
                log.warning("mlflow: cannot read MLflow alias holders from %s yet (retrying in %.0fs): %s", topic, wait, exc)
                self._stopping.wait(wait)
                wait = min(wait * 2, 30)
                continue
            self.alias_holders.ready.set()
            log.info("mlflow: alias holders loaded from %s (%d record(s) read)", topic, n)
            return

    # --- plumbing -----------------------------------------------------------------

    @web.middleware
    async def _hold(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        """The headers are in: lift the connection's header deadline while the request is handled."""
        guard, transport = self.guard, request.transport
        if guard is None or transport is None:
            return await handler(request)
        guard.disarm(transport)
        try:
            return await handler(request)
        finally:
            guard.arm(transport)  # the next request's headers are due within the timeout again

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        """Every failure becomes a JSON answer, counted as rejected with its reason."""
        route = request.match_info.route.name if request.match_info.route else None
        counters = self.counters.get(route or "")
        try:
            return await handler(request)
        except PayloadError as exc:
            if counters:
                counters.add_rejected(exc.reason)
            # A WARNING, not DEBUG: a sender does not retry a 4xx (Alertmanager drops the whole group), so
            # this line is where an operator learns what was refused and why (repeats: once a minute, counted).
            # (route, status and reason in the template, not as arguments: the repeat filter folds a template's repeats
            # for a minute, and one template for every refusal showed only the first of a minute's)
            log.warning(f"{route}: answering {exc.status}, refused ({exc.reason}), to %s: %s", request.remote, exc)
            return _error(exc.status, str(exc), exc.field, **exc.details)
        except PublishError as exc:
            # ``_publish`` has counted the events as rejected(kafka_unavailable).
            log.warning("%s: answering 503, Kafka did not acknowledge: %s", route, exc)
            return _error(503, f"Kafka unavailable, retry later: {exc}", None, retriable=True)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return _error(exc.status, exc.reason, None)
        except Exception as exc:  # noqa: BLE001 - a bug must still answer JSON, and be logged
            log.exception("%s: internal error", route)
            return _error(500, f"internal error: {type(exc).__name__}", None)

    async def _principal(self, request: web.Request, endpoint: str) -> Principal | None:
        """The proven caller of ``endpoint``; 401 when a credential is required and missing or wrong.

        Verified on the loop when no I/O is needed; a JWT whose key must first be fetched from
        the JWKS URL is verified on the JWKS thread, so a slow identity provider holds only the
        requests that need it."""
        header = request.headers.get("Authorization")
        try:
            principal = self.auth.authenticate(endpoint, header, fetch=False)
        except KeyFetchNeeded:
            principal = await asyncio.get_running_loop().run_in_executor(self._jwks_pool(), self.auth.authenticate, endpoint, header)
        if principal is None and (self.auth.requires_credential(endpoint) or endpoint in self.policy.authentication.required_on):
            raise AuthError(f"Authorization: /v1/{endpoint} requires a credential (a bearer token)")
        return principal

    def _proven(self, event: ReleaseEvent, principal: Principal | None, where: str) -> ReleaseEvent:
        """The event as the receiver vouches for it: its actor is the authenticated caller and
        its id is computed here (source, caller, natural key, event time), never the caller's."""
        p = event.payload
        if principal is not None:
            bare = principal.identity.split(":", 1)[1]
            if p.actor and p.actor not in (principal.identity, bare):
                raise PayloadError(f"{where}payload.actor: {principal.identity} may not publish as {p.actor!r}: the actor is the "
                                   "authenticated caller (a service acting for a person names them in on_behalf_of)",
                                   field=f"{where}payload.actor", reason="forbidden", status=403)
            if p.on_behalf_of and not self.policy.may_delegate(principal.identity, principal.groups):
                raise PayloadError(f"{where}payload.on_behalf_of: {principal.identity} may not act on behalf of {p.on_behalf_of!r}: "
                                   "no role of the policy gives it the delegate right", field=f"{where}payload.on_behalf_of",
                                   reason="forbidden", status=403)
        elif p.on_behalf_of:
            # Only a proven service's delegate right makes a relay mean anything (docs/controls.md, "Who an
            # actor is"): anonymously it was answered 200 and stored as "someone for user:alice".
            raise PayloadError(f"{where}payload.on_behalf_of: acting on behalf of {p.on_behalf_of!r} needs a credential: only an "
                               "authenticated service holding the policy's delegate right may relay a person's decision "
                               "(send its bearer token; without one, name yourself in payload.actor)",
                               field=f"{where}payload.on_behalf_of", reason="forbidden", status=403)
        natural_key = release_natural_key(event.identity.release_id, event.event_type, p.approval_id, event.identity.environment,
                                          p.target, p.reservation.reservation_id if p.reservation else None)
        # An unauthenticated caller's id names the actor it claims: with one 'unauthenticated' for
        # everyone, mallory's approval and alice's (same release, approval id, time) had one id, and
        # whichever came first was the one kept.
        # A decision relayed for another person is another fact than the same one relayed for someone
        # else (the key names on_behalf_of only when given: an undelegated event's id is what it was).
        caller = principal.identity if principal is not None else f"unauthenticated:{p.actor or ''}"
        relayed = deciders(None, p.on_behalf_of)
        return _stamped(event, **_proof(principal)).model_copy(update={
            "event_id": make_event_id(EVENT_ID_SOURCE, (caller, *natural_key, *relayed), event.occurred_at.isoformat()),  # (a hash: valid)
        })

    async def _read_body(self, request: web.Request) -> bytes:
        if request.content_type != "application/json":
            raise PayloadError(f"Content-Type: must be application/json, got {request.content_type!r}",
                               field="Content-Type", reason="unsupported_media_type", status=415)
        limit = self.config.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise PayloadError(f"<body>: {request.content_length} bytes is over the {limit}-byte limit (max_body_bytes)", reason="too_large",
                               status=413, details={"limit_bytes": limit, "size_bytes": request.content_length})
        try:
            if request.content.is_eof():  # the whole body came with the headers (small bodies): nothing to wait for
                return await request.read()
            async with asyncio.timeout(self.config.body_timeout_s):
                return await request.read()
        except TimeoutError as exc:
            raise PayloadError(f"<body>: not received within {self.config.body_timeout_s:g}s (body_timeout_s)", reason="body_timeout",
                               status=408) from exc
        except web.HTTPRequestEntityTooLarge as exc:
            raise PayloadError(f"<body>: over the {limit}-byte limit (max_body_bytes)", reason="too_large", status=413,
                               details={"limit_bytes": limit}) from exc

    @staticmethod
    def _parse_json(body: bytes) -> Any:
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise PayloadError(f"<body>: not JSON: {exc}", reason="not_json", status=400) from exc

    async def _publish(self, source: str, events: list, field_of: Callable[[int], str | None] = lambda i: None) -> None:
        """Publish the request's events; one over the event limit → 422 naming it (``field_of(index)``).

        The source's counters follow what Kafka acknowledged: ``sent`` (and ``bytes_sent``)
        only after every ack, ``rejected.kafka_unavailable`` when the acks did not come.
        """
        if not events:
            return
        counters = self.counters[source]
        try:
            nbytes = await self.publisher.publish_batch_async(events, self.publish_timeout_s)
        except EventTooLarge as exc:
            field = field_of(exc.index)
            raise PayloadError(f"{field}: {exc}" if field else str(exc), field=field, reason="event_too_large",
                               details={"limit_bytes": exc.limit_bytes, "size_bytes": exc.size_bytes, "event_id": exc.event_id}) from exc
        except PublishError:
            counters.add_rejected("kafka_unavailable", len(events))
            raise
        counters.add_sent(len(events), nbytes)

    async def _dead_letter_future(self, future: list[tuple[dict, EventDecodeError]], stage: str, principal: Principal | None) -> dict:
        """Keep events from a newer schema version on the dead-letter topic (a newer gpuledger can
        replay them), and say so in the 422 answer: ``dead_lettered``, ``schema_version_seen``.

        What the caller claimed about proof is replaced by what this receiver proved, as
        ``_proven`` does for the events it publishes: a body with ``authenticated_by: token`` and
        another person's ``actor`` was kept verbatim, and nothing named the authenticated sender."""
        topic = self.publisher.catalogue.deadletter
        letters = []
        for item, exc in future:
            identity = item.get("identity") if isinstance(item.get("identity"), dict) else {}
            key = identity.get("release_id") if isinstance(identity.get("release_id"), str) else None
            vouched, claimed = dict(item), {}
            if isinstance(item.get("payload"), dict):
                claimed = {k: item["payload"][k] for k in ("actor", "authenticated_by", "actor_groups") if k in item["payload"]}
                vouched["payload"] = {**item["payload"], **_proof(principal)}
                if vouched["payload"].get("on_behalf_of") and not (principal is not None
                                                                   and self.policy.may_delegate(principal.identity, principal.groups)):
                    vouched["payload"].pop("on_behalf_of")  # (unchecked here: _proven would refuse it, 403)
            sender = f"{principal.identity} ({principal.method})" if principal is not None else "an unauthenticated caller"
            error = f"{exc} [received from {sender}" + (f"; the body claimed {claimed}" if claimed and principal is None else "") + "]"
            letters.append((key.encode() if key else None,
                            encode_event(dead_letter(exc.reason, error, stage, None, None, None, key, orjson.dumps(vouched)))))
        await asyncio.to_thread(lambda: [self.publisher.publish_raw(topic, key, value) for key, value in letters])
        return {"dead_lettered": len(letters), "schema_version_seen": sorted({item.get("schema_version") for item, _ in future}),
                "supported_schema_version": SCHEMA_VERSION}

    @staticmethod
    def _accepted(events: list, **extra: Any) -> web.Response:
        # orjson: the answer of every accepted request (aiohttp's json_response uses the stdlib encoder).
        return web.Response(body=orjson.dumps({"accepted": len(events), "event_ids": [e.event_id for e in events], **extra}),
                            content_type="application/json")

    # --- endpoints ----------------------------------------------------------------

    async def alertmanager(self, request: web.Request) -> web.Response:
        await self._principal(request, "alertmanager")
        data = self._parse_json(await self._read_body(request))
        trimmer = TextTrimmer()
        events = alert_events(data, self.config.alert_labels, datetime.now(timezone.utc), self.host, _trace(request), trimmer)
        counters = self.counters["alertmanager"]
        counters.add_received(len(events))
        await self._publish("alertmanager", events, lambda i: f"alerts[{i}]")
        if trimmer.cut:
            counters.add_truncated(len(trimmer.cut))
        truncated = truncated_alerts(data)
        log.info("alertmanager: accepted %d alert event(s) from receiver %r%s%s", len(events), data.get("receiver"),
                 f", {truncated} more truncated by Alertmanager (max_alerts)" if truncated else "",
                 f", {len(trimmer.cut)} free-text field(s) cut to {trimmer.cap_bytes} bytes" if trimmer.cut else "")
        return self._accepted(events, truncated_alerts=truncated, truncated_fields=trimmer.cut)

    async def releases(self, request: web.Request) -> web.Response:
        principal = await self._principal(request, "releases")
        data = self._parse_json(await self._read_body(request))
        items, prefix = (data, "[{}].") if isinstance(data, list) else ([data], "")
        events: list[ReleaseEvent] = []
        problems: list[tuple[str, str, str]] = []
        future: list[tuple[dict, EventDecodeError]] = []  # events from a newer schema version
        for i, item in enumerate(items):
            where = prefix.format(i)
            if not isinstance(item, dict):
                problems.append((where.rstrip(".") or None, f"{where.rstrip('.') or '<body>'}: must be a JSON object (a release event), got {type(item).__name__}", "not_object"))
                continue
            event_type = item.get("event_type")
            if isinstance(event_type, str) and event_type in EVENT_TYPES and not event_type.startswith("release."):
                problems.append((f"{where}event_type", f"{where}event_type: {event_type!r} is not a release event (this endpoint takes release.* only)",
                                 "unknown_event_type"))
                continue
            try:
                # The receiver computes the id (see _proven): whatever the caller sent is ignored.
                events.append(self._proven(decode_event({**item, "event_id": _ID_PLACEHOLDER}), principal, where))
            except EventDecodeError as exc:
                if exc.reason == "unsupported_schema_version":
                    future.append((item, exc))
                field = _decode_error_field(exc)
                text = str(exc)
                if field and text.startswith("<root>: "):
                    text = f"{field}: " + text.removeprefix("<root>: ").removeprefix("Value error, ")
                message = text if not where else "; ".join(f"{where}{part.strip()}" for part in text.split(";"))
                problems.append((f"{where}{field}" if field else (where.rstrip(".") or None), message, exc.reason))
        if problems:
            details = await self._dead_letter_future(future, "receiver.releases", principal) if future else None
            raise PayloadError("; ".join(m for _, m, _ in problems), field=problems[0][0], reason=problems[0][2], details=details)
        self.counters["releases"].add_received(len(events))
        await self._publish("releases", events, (lambda i: f"[{i}]") if isinstance(data, list) else (lambda i: None))
        log.info("releases: accepted %d release event(s)", len(events))
        return self._accepted(events)

    async def mlflow(self, request: web.Request) -> web.Response:
        body = await self._read_body(request)
        principal = None
        if "Authorization" in request.headers:
            # Presented and wrong is 401 here too ('Bearer wrong' was taken as no credential: 200,
            # unauthenticated). MLflow itself signs instead: a right bearer token proves its caller
            # where no secret is set.
            principal = await self._principal(request, "mlflow")
        if self.config.mlflow_secret is not None:
            verify_signature(self.config.mlflow_secret.get_secret_value(), request.headers, body, self.config.mlflow_signature_tolerance_s)
            principal = Principal(f"service:mlflow/{self.config.mlflow_webhook_name}", (), MLFLOW_PROOF)
        elif "mlflow" in self.policy.authentication.required_on:
            raise AuthError("X-MLflow-Signature: /v1/mlflow requires signed deliveries (set GPULEDGER_RECEIVER_MLFLOW_SECRET)",
                            field="X-MLflow-Signature")
        delivery_id = request.headers.get(DELIVERY_ID_HEADER)
        if self.deliveries.seen(delivery_id):
            return self._accepted([], duplicate_delivery=True)
        data = self._parse_json(body)
        if is_test_delivery(data):
            # MLflow's "Test webhook": answer it (MLflow shows the answer), publish nothing.
            log.info("mlflow: delivery %s is MLflow's test delivery (%s.%s): nothing published", delivery_id,
                     data.get("entity"), data.get("action"))
            return self._accepted([], test_delivery=True)
        if isinstance(data, dict) and data.get("entity") == "model_version_alias":
            # Who held the alias before decides promotion vs rollback: one move at a time,
            # and only once the holders were read from the release topic.
            if not await asyncio.to_thread(self.alias_holders.ready.wait, self.publish_timeout_s):
                raise PublishError("MLflow alias holders are still being read from the release topic")
            await asyncio.sleep(_settle_wait(data))
            async with self._alias_moves:
                events = await self._mlflow_publish(request, data, delivery_id, principal)
                for event in events:
                    self.alias_holders.observe(event)
        else:
            events = await self._mlflow_publish(request, data, delivery_id, principal)
        what = f"{data.get('entity')}.{data.get('action')}"
        log.info("mlflow: delivery %s (%s) → %d release event(s)", delivery_id, what, len(events))
        if not events:
            return self._accepted(events, ignored=f"{what} maps to no release event (see docs/receiver.md)")
        return self._accepted(events)

    async def _mlflow_publish(self, request: web.Request, data: Any, delivery_id: str | None,
                              principal: Principal | None) -> list[ReleaseEvent]:
        events = release_events(data, self.config.mlflow, datetime.now(timezone.utc), self.host, _trace(request),
                                delivery_id=delivery_id, holders=self.alias_holders)
        if principal is not None:  # the signature proves the webhook: its events are by it
            events = [_stamped(e, actor=principal.identity, authenticated_by=principal.method) for e in events]
        self.counters["mlflow"].add_received(len(events))
        await self._publish("mlflow", events)
        self.deliveries.remember(delivery_id)
        return events

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "counters": {s: c.totals for s, c in self.counters.items()}, "gc": gctune.stats()})

    async def readyz(self, request: web.Request) -> web.Response:
        if await asyncio.to_thread(self.publisher.connected):
            return web.json_response({"ready": True})
        return web.json_response({"ready": False, "error": "Kafka is not reachable"}, status=503)


class ConnectionGuard:
    """Wraps aiohttp's protocol factory: a connection limit and a header timeout.

    aiohttp's server has neither (only a keep-alive timeout, which a client trickling
    bytes keeps resetting), so this is the small piece written here: each connection gets
    a deadline ``header_timeout_s`` after it opens or after its previous answer; the
    middleware ``_hold`` lifts it while a request is being handled. A connection over
    ``max_connections`` gets a 503 and is closed before aiohttp reads anything.
    """

    _BUSY_BODY = b'{"error": "too many connections, retry later", "field": null, "retriable": true}'
    BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY))

    def __init__(self, factory: Callable[[], asyncio.Protocol], header_timeout_s: float, max_connections: int) -> None:
        self.factory = factory
        self.header_timeout_s = header_timeout_s
        self.max_connections = max_connections
        self.open: dict[Any, asyncio.TimerHandle | None] = {}
        self.refused = 0
        self.timed_out = 0

    def _expire(self, transport) -> None:
        self.timed_out += 1
        transport.close()

    def arm(self, transport) -> None:
        if transport in self.open and not transport.is_closing():
            self.disarm(transport)
            self.open[transport] = asyncio.get_running_loop().call_later(self.header_timeout_s, self._expire, transport)

    def disarm(self, transport) -> None:
        handle = self.open.get(transport)
        if handle is not None:
            handle.cancel()
            self.open[transport] = None

    def __call__(self) -> asyncio.Protocol:
        return _GuardedProtocol(self, self.factory())


class _GuardedProtocol(asyncio.Protocol):
    """aiohttp's protocol (slotted, so wrapped rather than patched) with the guard's accounting."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self.guard, self.inner, self.transport = guard, inner, None

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.inner.connection_made(transport)
        guard = self.guard
        if len(guard.open) >= guard.max_connections:
            guard.refused += 1
            transport.write(guard.BUSY)
            transport.close()
            return
        guard.open[transport] = None
        guard.arm(transport)

    def connection_lost(self, exc) -> None:
        self.guard.disarm(self.transport)
        self.guard.open.pop(self.transport, None)
        self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


#: How often the TLS certificate and key files are checked for a change.
TLS_RELOAD_CHECK_S = 10.0


class ReloadingTls:
    """An SSL context whose certificate and key are re-read when either file changes (checked every ``TLS_RELOAD_CHECK_S``)."""

    def __init__(self, cert: Path, key: Path) -> None:
        import ssl

        self.cert, self.key = cert, key
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._stamp = None
        self.reload()

    def reload(self) -> bool:
        stamp = (self.cert.stat().st_mtime_ns, self.key.stat().st_mtime_ns)
        if stamp == self._stamp:
            return False
        # New handshakes use the new pair; open connections keep theirs.
        self.context.load_cert_chain(self.cert, self.key)
        self._stamp = stamp
        log.info("receiver TLS: certificate loaded from %s", self.cert)
        return True

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(TLS_RELOAD_CHECK_S)
            try:
                self.reload()
            except (OSError, ValueError) as exc:  # a half-written file: keep the old pair, try again
                log.error("receiver TLS: keeping the previous certificate, cannot load %s: %s", self.cert, exc)


def authenticator_for(config: ReceiverSettings) -> Authenticator:
    """The receiver's proofs of identity, from its settings (a bad credentials or JWKS file fails here, at start)."""
    return Authenticator(
        credentials=CredentialsFile(config.credentials_file) if config.credentials_file else None,
        oidc=OidcVerifier(config.oidc) if config.oidc else None,
        shared_tokens={"alertmanager": config.alertmanager_bearer_token, "releases": config.releases_bearer_token},
    )


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def unauthenticated_exposure(config: ReceiverSettings, auth: Authenticator) -> str | None:
    """Why serving ``config`` would let anyone on the network publish unchecked, or None."""
    if _loopback(config.host) or auth.configured or config.mlflow_secret is not None:
        return None
    return (f"listening on {config.host} (not loopback) with no credential configured (no credentials_file, oidc, "
            "per-source bearer token or MLflow webhook secret)")


async def _warn_every_minute(message: str) -> None:
    while True:
        log.warning("UNAUTHENTICATED receiver: %s; anyone who can reach it can publish events as anyone "
                    "(--allow-unauthenticated was given)", message)
        await asyncio.sleep(60)


async def serve(config: ReceiverSettings, publisher: EventPublisher, stop: asyncio.Event | None = None,
                on_listening: Callable[[str, int], None] | None = None, publish_timeout_s: float = 35.0,
                policy: Policy | None = None) -> None:
    """Listen until ``stop`` is set (forever if None); calls ``on_listening(host, port)``.

    Refuses (``ReceiverError``) to listen on a non-loopback address with no credential configured
    at all (``unauthenticated_exposure``), unless ``allow_unauthenticated`` (then warns every
    minute). With some credential configured, an endpoint that does not require one
    (``authentication.required_on``, a per-source token) still takes anonymous posts, marked
    unauthenticated (docs/receiver.md, Auth).
    """
    receiver = LifecycleReceiver(config, publisher, publish_timeout_s, policy=policy)
    exposure = unauthenticated_exposure(config, receiver.auth)
    if exposure and not config.allow_unauthenticated:
        raise ReceiverError(f"refusing to serve: {exposure}. Configure credentials (docs/receiver.md, Auth) or pass "
                            "--allow-unauthenticated (GPULEDGER_RECEIVER_ALLOW_UNAUTHENTICATED=true) to accept that")
    tls = ReloadingTls(config.tls_cert_file, config.tls_key_file) if config.tls_cert_file and config.tls_key_file else None
    app = receiver.build_app()
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=max(config.header_timeout_s, 1.0))
    await runner.setup()
    receiver.guard = guard = ConnectionGuard(runner.server, config.header_timeout_s, config.max_connections)
    background = [asyncio.create_task(coro) for coro in ((_warn_every_minute(exposure) if exposure else None),
                                                          (tls.watch() if tls else None)) if coro is not None]
    listener = None
    try:
        listener = await asyncio.get_running_loop().create_server(guard, config.host, config.port, ssl=tls.context if tls else None,
                                                                  reuse_address=True)
        host, port = listener.sockets[0].getsockname()[:2]
        if on_listening:
            on_listening(host, port)
        await (stop or asyncio.Event()).wait()
    finally:
        for task in background:
            task.cancel()
        if listener is not None:
            listener.close()
        await runner.cleanup()


class ReceiverError(ProducerError):
    """The receiver cannot serve (its address cannot be bound)."""


class ReceiverService:
    """``gpuledger receive`` as a long-running component (``producers._runtime.LongRunning``).

    ``run()`` serves until ``stop()`` (safe from any thread), then closes the publisher,
    which it owns: every accepted request was acknowledged by Kafka before its answer,
    so there is nothing left to flush but librdkafka's own queue.
    """

    def __init__(self, config: ReceiverSettings, publisher: EventPublisher, publish_timeout_s: float = 35.0,
                 on_listening: Callable[[str, int], None] | None = None, policy: Policy | None = None) -> None:
        self.config = config
        self.policy = policy
        self.publisher = publisher
        self.publish_timeout_s = publish_timeout_s
        self.on_listening = on_listening
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._stop_requested = threading.Event()

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        if self._stop_requested.is_set():
            self._stop.set()

        def listening(host: str, port: int) -> None:
            gctune.freeze()  # the started service's objects are never traversed again (gctune)
            if self.on_listening:
                self.on_listening(host, port)

        await serve(self.config, self.publisher, self._stop, listening, self.publish_timeout_s, self.policy)

    def run(self) -> None:
        gctune.tune()  # a few hundred short-lived objects per request: rarer young collections
        try:
            # uvloop (libuv): the receiver is one event loop answering small requests, and
            # the stock loop's per-callback cost was a large part of each one (py-spy).
            uvloop.run(self._serve())
        except OSError as exc:
            raise ReceiverError(f"cannot listen on {self.config.host}:{self.config.port}: {exc}") from exc
        finally:
            self.publisher.close(10)
            log.info("receiver stopped, producer flushed")

    def stop(self) -> None:
        self._stop_requested.set()
        loop, event = self._loop, self._stop
        if loop is not None and event is not None:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:
                pass  # the loop already ended: nothing left to stop
