"""``gpuledger admit`` as one long-running process: HTTPS webhook, release follower, AdmissionCheck controller, recorder.

Input: AdmissionReviews on ``POST /validate`` and ``/validate/<environment>`` (HTTPS), the release topic (read from the
beginning into the in-memory ``AdmissionState``, like every worker's release directory),
and with a kubeconfig the cluster's Kueue Workloads. Output: AdmissionReview answers,
Workload check states, and one ``admission.decided`` event per decision on Kafka.

Guarantees: no I/O on the request path but a DRA claim's — a decision reads memory only; an object
naming DRA claims has them read from the API server (``producers.admission.claims``: within a
3 s budget, in a worker thread, so the event loop never waits on the API server); a release event
reaches the state within the follower's poll (200 ms) of Kafka acknowledging it. Decisions
are published off the request path by the recorder thread in batches (acks=all): the
webhook answers even while Kafka is down; decisions beyond ``publish_queue`` are dropped,
counted (``/healthz``) and logged (an ERROR when drops begin, the count when publishing resumes),
never blocking an answer; a decision whose event the schema refuses is dead-lettered (stage
``admit.recorder``), counted (``unrecordable``) and logged, and the others go on. ``/readyz`` is 200 once the release
topic has been read up to its end offsets at start-up, 503 before. ``/healthz`` is 200 while the
process serves; its ``status`` is ``degraded`` (with ``problems``) while the release state could
not be confirmed current for ``stale_after_s`` (Kafka away after it loaded: decisions go on from
memory and each says so) or decisions could not be published for as long. Kafka unreachable at start
is not fatal: the follower keeps connecting (``KAFKA_RETRY_S``) while reviews get the
state-not-loaded answer; the AdmissionCheck controller decides nothing before the state has loaded
(``producers.admission.controller``).
Limits: a decision not yet published when the process dies is lost (the API server's
own audit log still has the request); the self-signed certificate changes at each start.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import queue
import ssl
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import orjson
from aiohttp import web

from gpuledger.telemetry import ComponentCounters
from producers._config import ResourceMatcher
from producers._errors import ProducerError
from producers.admission.certs import self_signed
from producers.admission.claims import ClaimReader
from producers.admission.config import WEBHOOK_PATH, AdmitSettings
from producers.admission.webhook import ReviewHandler
from streams.controls.admission import AdmissionState
from streams.controls.policy import Policy
from streams.correlate.directory import follow_release_topic

log = logging.getLogger(__name__)

#: Seconds between attempts to reach Kafka while the release topic cannot be read at start.
KAFKA_RETRY_S = 1.0


class AdmitError(ProducerError):
    """gpuledger admit cannot start (listen address, certificate, kubeconfig)."""


class DecisionRecorder:
    """Publishes decisions from a queue in batches on its own thread (off the request path)."""

    def __init__(self, publisher, batch: int = 500, capacity: int = 100_000) -> None:
        self.publisher, self.batch = publisher, batch
        self.queue: queue.Queue = queue.Queue(maxsize=capacity)
        self.counters = {"recorded": 0, "published": 0, "dropped": 0, "publish_errors": 0, "unrecordable": 0, "too_large": 0}
        self.failing_since: float | None = None  # time.monotonic() of the first failed publish of the batch in hand
        self.last_error: str | None = None
        self.in_hand = 0  # decisions of the batch being published (out of the queue, so not in qsize())
        self._dropped_at_start: int | None = None  # counters["dropped"] when the current run of drops began (None: not dropping)
        self._thread = threading.Thread(target=self._run, name="admit-recorder", daemon=True)
        self._stopping = threading.Event()

    def start(self) -> None:
        self._thread.start()

    def __call__(self, event) -> None:
        try:
            self.queue.put_nowait(event)
            self.counters["recorded"] += 1
        except queue.Full:
            self.counters["dropped"] += 1
            # Loud once per run of drops (not per decision: a busy cluster drops thousands a
            # minute), and again with the count when publishing takes decisions again (``_run``).
            if self._dropped_at_start is None:
                self._dropped_at_start = self.counters["dropped"] - 1
                log.error("admission decisions are being dropped: the queue of decisions waiting to be published is full "
                          "(publish_queue %d, behind a batch of %d being published%s), so the record of every decision until it "
                          "drains is lost (the webhook still answers; /healthz counts them)", self.queue.maxsize, self.in_hand,
                          f"; the last publish failed: {self.last_error}" if self.last_error else "")

    def _run(self) -> None:
        while True:
            try:
                first = self.queue.get(timeout=0.2)
            except queue.Empty:
                if self._stopping.is_set():
                    return
                continue
            events = [first]
            while len(events) < self.batch:
                try:
                    events.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            # The webhook hands over a function: the event is built here, not on the request path.
            events, letters = self._build(events)
            if not events and not letters:
                continue
            self.in_hand = len(events)
            while True:
                try:
                    while letters:  # (each sent once: a retry does not send it again)
                        self.publisher.publish_raw(self.publisher.catalogue.deadletter, None, letters[0])
                        letters.pop(0)
                    # What does not fit a record (an object name no API server would accept, from a direct
                    # caller; raw topics with a low max.message.bytes) is dead-lettered: as a ProducerError it
                    # was retried for ever, and no later decision was published.
                    sent = self.publisher.publish_fitting(events, "admit.recorder")
                    self.counters["published"] += sent
                    self.counters["too_large"] += len(events) - sent
                    self.failing_since = self.last_error = None
                    self.in_hand = 0
                    if (began := self._dropped_at_start) is not None and self.queue.qsize() < self.queue.maxsize:
                        self._dropped_at_start = None
                        log.warning("admission decisions are published again; %d were dropped while the queue was full "
                                    "(%d since admit started)", self.counters["dropped"] - began, self.counters["dropped"])
                    break
                except ProducerError as exc:
                    self.counters["publish_errors"] += 1
                    if self.failing_since is None:
                        self.failing_since = time.monotonic()
                    self.last_error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                    log.warning("admission decisions not published yet (%d): %s", len(events), exc)
                    if self._stopping.wait(1.0):
                        return

    def _build(self, items: list) -> tuple[list, list[bytes]]:
        """The batch's events, and a dead letter for each decision whose event cannot be built (a
        value the event refuses that ``decision_event`` does not leave out: a userInfo.username with
        a bidi override, or not a string) — logged and counted (``unrecordable``): raised here, it
        ended this thread, and no later decision was published while ``/healthz`` said ok; only
        logged, the decision was lost. Its dead letter (stage ``admit.recorder``) keeps what was
        decided (``describes``: the request uid, object, user, decision, rule and message)."""
        from schemas import encode_event
        from schemas.outputs import dead_letter

        events, letters = [], []
        for item in items:
            try:
                events.append(item() if callable(item) else item)
            except Exception as exc:  # noqa: BLE001 - one decision must not stop the recording of the others
                self.counters["unrecordable"] += 1
                error = " ".join(str(exc).split())
                log.error("an admission decision could not be recorded (its event cannot be built): %s", error)
                try:
                    described = item.describes() if hasattr(item, "describes") else None
                except Exception:  # noqa: BLE001 - the letter goes without it, never this thread
                    described = None
                letters.append(encode_event(dead_letter("validation", f"admission decision could not be recorded: {error}", "admit.recorder",
                                                        None, None, None, None, described)))
        return events, letters

    def problem(self, after_s: float) -> str | None:
        """What ``/healthz`` says when decisions could not be published for ``after_s`` seconds: how
        many wait (the batch being retried and the queue behind it), the queue's limit and how many
        were dropped since start — "over 100000 are dropped" read as if that many had been."""
        since = self.failing_since
        if since is None or time.monotonic() - since <= after_s:
            return None
        return (f"admission decisions not published for {time.monotonic() - since:.0f} s: {self.in_hand + self.queue.qsize()} waiting for Kafka "
                f"(beyond {self.queue.maxsize} queued behind the batch being retried, new ones are dropped; "
                f"{self.counters['dropped']} dropped since admit started): {self.last_error}")

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._thread.join(timeout)


class AdmitService:
    """``gpuledger admit`` (``producers._runtime`` lifecycle: ``run()`` until ``stop()``)."""

    def __init__(self, config: AdmitSettings, policy: Policy, publisher, bootstrap: str, release_topic: str, client_config: dict | None = None,
                 api_client=None, on_listening: Callable[[str, int, bytes | None], None] | None = None,
                 run_controller: bool | None = None) -> None:
        self.config, self.policy, self.publisher = config, policy, publisher
        self.bootstrap, self.release_topic, self.client_config = bootstrap, release_topic, client_config or {}
        self.api_client, self.on_listening = api_client, on_listening
        # The AdmissionCheck controller runs with API access unless told not to (claims_in_cluster:
        # the webhook reads DRA claims with it, and nothing else).
        self.run_controller = api_client is not None if run_controller is None else run_controller
        self.state = AdmissionState()
        self.resources = ResourceMatcher(config.gpu_resources)
        self.recorder = DecisionRecorder(publisher, config.publish_batch, config.publish_queue)
        # DRA claims' GPUs, read from the API server when this service has access to one
        # (producers.admission.claims; without, a claim counts as a GPU and the answer says why).
        self.claims = ClaimReader(api_client, ResourceMatcher(config.dra_drivers))
        self.handler = ReviewHandler(self.state, policy, self.resources, config.label_prefix, claims=self.claims, stale_after_s=config.stale_after_s)
        self.controller = None
        self.counters = {"reviews": 0, "bad_requests": 0, "denied": 0, "unauthenticated": 0}
        self.telemetry = ComponentCounters("admit")  # the component contract: received / rejected (with reason), via OpenTelemetry
        self.latencies: collections.deque[float] = collections.deque(maxlen=10_000)  # ms from body read to answer encoded
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._stop_requested = threading.Event()

    # -- HTTP ------------------------------------------------------------------------------------
    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes)
        app.add_routes([web.post(WEBHOOK_PATH, self.validate), web.post(WEBHOOK_PATH + "/{environment}", self.validate),
                        web.get("/healthz", self.healthz), web.get("/readyz", self.readyz)])
        return app

    async def validate(self, request: web.Request) -> web.Response:
        caller = None
        if self.config.client_ca_file is not None:
            caller, refused = self._caller(request.transport.get_extra_info("peercert") if request.transport else None)
            if refused is not None:
                self.counters["unauthenticated"] += 1
                self.telemetry.add_rejected("unauthenticated_caller")
                return web.json_response({"error": refused}, status=401 if caller is None else 403)
        environment = request.match_info.get("environment")
        if environment is not None and environment not in self.policy.admission.fail_closed:
            # Only a fail-closed environment's webhook has a path of its own (producers.admission.manifests),
            # and only such a floor cannot make a decision laxer than an unknown environment: another
            # environment's mode or its approval rule (dev: none needed) would. Loud: the webhook
            # configuration and the policy disagree.
            self.counters["bad_requests"] += 1
            self.telemetry.add_rejected("bad_admission_review")
            return web.json_response({"error": f"{WEBHOOK_PATH}/<environment> serves the policy's fail-closed environments "
                                               f"({', '.join(self.policy.admission.fail_closed) or 'none'}); {environment[:80]!r} is not one: "
                                               "the webhook configuration and the policy disagree (generate the configuration from the "
                                               "policy's admission.fail_closed: docs/admission.md)"}, status=400)
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            self.counters["bad_requests"] += 1
            self.telemetry.add_rejected("too_large")
            return web.json_response({"error": f"body over {self.config.max_body_bytes} bytes"}, status=413)
        started = time.perf_counter()
        if b'"resourceClaims"' in body:
            # Its DRA claims are read from the API server (blocking calls): off the event loop.
            status, answer, event = await asyncio.to_thread(self.handler.handle, body, caller, environment)
        else:
            status, answer, event = self.handler.handle(body, caller, environment)
        self.telemetry.add_received()
        if status != 200:
            self.counters["bad_requests"] += 1
            self.telemetry.add_rejected("bad_admission_review")
        else:
            self.counters["reviews"] += 1
            if not answer["response"]["allowed"]:
                self.counters["denied"] += 1
        if event is not None:
            self.recorder(event)
        response = web.Response(body=orjson.dumps(answer), status=status, content_type="application/json")
        self.latencies.append((time.perf_counter() - started) * 1000)
        return response

    def _caller(self, cert: dict | None) -> tuple[str | None, str | None]:
        """(``x509:<common name>``, None) for a caller whose client certificate the TLS handshake
        verified against client_ca_file (and, with client_names, that one of them names); else
        (its identity or None, why it is refused)."""
        if not cert:
            return None, (f"client certificate required: {WEBHOOK_PATH} answers only callers with a certificate signed by the "
                          "configured client CA (GPULEDGER_ADMIT_CLIENT_CA_FILE; docs/admission.md)")
        common = [value for rdn in cert.get("subject", ()) for key, value in rdn if key == "commonName"]
        dns = [value for kind, value in cert.get("subjectAltName", ()) if kind == "DNS"]
        name = common[0] if common else (dns[0] if dns else None)
        if not name:
            return None, "the client certificate names no common name or DNS name"
        allowed = self.config.client_names
        if allowed and not set(allowed) & {*common, *dns}:
            return f"x509:{name}", f"client certificate {name!r} is not one of the allowed callers (GPULEDGER_ADMIT_CLIENT_NAMES)"
        return f"x509:{name}", None

    async def healthz(self, request: web.Request) -> web.Response:
        controller = self.controller.counters if self.controller else None
        recent = sorted(self.latencies)
        latency = {"n": len(recent), "p50_ms": round(recent[len(recent) // 2], 3), "p99_ms": round(recent[int(len(recent) * 0.99)], 3),
                   "max_ms": round(recent[-1], 3)} if recent else {"n": 0}
        # 200 whatever the status: a liveness probe that restarted a webhook whose Kafka is away
        # would trade a stale state for none (state-not-loaded: fail-closed environments denied).
        fresh = self.state.freshness()
        problems = [p for p in (self._state_problem(fresh), self.recorder.problem(self.config.stale_after_s)) if p]
        return web.json_response({"status": "degraded" if problems else "ok", **({"problems": problems} if problems else {}),
                                  "releases": len(self.state.releases), "release_events": self.state.applied,
                                  "release_state": fresh, "webhook": self.counters, "decision_latency": latency, "recorder": self.recorder.counters,
                                  "controller": controller, "claims": {"lookups": self.claims.lookups, "unresolved": self.claims.unresolved}})

    def _state_problem(self, fresh: dict) -> str | None:
        """``fresh``: the state's ``freshness()``."""
        age = fresh["confirmed_age_s"]
        if not fresh["ready"] or age is None or age <= self.config.stale_after_s:
            return None
        return (f"release state not confirmed current for {age:.0f} s (since {fresh['confirmed_current_at']}; stale after "
                f"{self.config.stale_after_s:g} s): decisions are taken on it and say so; {fresh.get('problem') or 'the release topic is not read up to its end'}")

    async def readyz(self, request: web.Request) -> web.Response:
        if self.state.ready.is_set():
            return web.json_response({"ready": True, "releases": len(self.state.releases)})
        return web.json_response({"ready": False, "error": "release state not loaded yet"}, status=503)

    # -- lifecycle -----------------------------------------------------------------------------------
    def _tls(self, workdir: Path) -> tuple[ssl.SSLContext, bytes | None]:
        ca_pem = None
        cert, key = self.config.tls_cert_file, self.config.tls_key_file
        if cert is None:
            cert, key, ca_pem = self_signed(workdir, tuple(self.config.tls_names), (self.config.host,))
            if self.config.ca_out:
                self.config.ca_out.write_bytes(ca_pem)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(str(cert), str(key))
        except (OSError, ssl.SSLError) as exc:
            raise AdmitError(f"cannot load the serving certificate {cert} / key {key}: {exc}") from exc
        if self.config.client_ca_file is not None:
            # Optional at the handshake (the kubelet's probes of /healthz and /readyz bring no
            # certificate); one that is presented must verify; /validate requires one (``_caller``).
            try:
                context.load_verify_locations(cafile=str(self.config.client_ca_file))
            except (OSError, ssl.SSLError) as exc:
                raise AdmitError(f"cannot load the client CA {self.config.client_ca_file}: {exc}") from exc
            context.verify_mode = ssl.CERT_OPTIONAL
        return context, ca_pem

    def _on_release_change(self, keys: list[str]) -> None:
        if self.controller is not None:
            self.controller.release_changed(keys)

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        if self._stop_requested.is_set():
            self._stop.set()
        # Kafka unreachable at start is not fatal: until the state loads, reviews get the
        # state-not-loaded answer (fail-closed environments denied) and /readyz says 503.
        follower = asyncio.create_task(follow_release_topic(self.bootstrap, self.release_topic, self.state, self._on_release_change,
                                                            self._stop, self.client_config, retry_s=KAFKA_RETRY_S))
        with tempfile.TemporaryDirectory(prefix="gpuledger-admit-") as workdir:
            context, ca_pem = self._tls(Path(workdir))
            runner = web.AppRunner(self.build_app(), access_log=None)
            await runner.setup()
            try:
                site = web.TCPSite(runner, self.config.host, self.config.port, ssl_context=context)
                try:
                    await site.start()
                except OSError as exc:
                    raise AdmitError(f"cannot listen on {self.config.host}:{self.config.port}: {exc}") from exc
                host, port = site._server.sockets[0].getsockname()[:2]
                if self.api_client is not None and self.run_controller:
                    from producers.admission.controller import AdmissionCheckController

                    self.controller = AdmissionCheckController(self.api_client, self.state, self.policy, self.resources, self.config.label_prefix,
                                                               self.recorder, self.config.controller_name, self.config.resync_s,
                                                               self.config.watch_timeout_s, claims=self.claims,
                                                               stale_after_s=self.config.stale_after_s)
                    self.controller.start()
                if self.on_listening:
                    self.on_listening(host, port, ca_pem)
                stop_wait = asyncio.create_task(self._stop.wait())
                await asyncio.wait({stop_wait, follower}, return_when=asyncio.FIRST_COMPLETED)
                if follower.done() and follower.exception():
                    raise AdmitError(f"the release topic {self.release_topic} cannot be read: {follower.exception()}")
                stop_wait.cancel()
            finally:
                if self.controller is not None:
                    self.controller.stop()
                await runner.cleanup()
                follower.cancel()
                await asyncio.gather(follower, return_exceptions=True)

    def run(self) -> None:
        self.recorder.start()
        try:
            asyncio.run(self._serve())
        finally:
            self.recorder.stop()
            self.publisher.close(10)
            log.info("admit stopped, decisions flushed")

    def stop(self) -> None:
        self._stop_requested.set()
        loop, event = self._loop, self._stop
        if loop is not None and event is not None:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:
                pass
