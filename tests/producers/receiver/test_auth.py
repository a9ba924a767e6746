"""producers/receiver/auth.py through the real receiver and broker: who an event is by.

Callers prove themselves with a bearer token from a credentials file (stored hashed), an
OIDC JWT signed by a key of the configured JWKS (a real RSA key pair, PyJWT on both sides),
or a signed MLflow delivery; the events on the topic carry the proven identity.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from datetime import datetime, timezone

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa

from producers._kafka import EventPublisher
from producers.receiver.config import ReceiverSettings
from producers.receiver.server import ReceiverError, serve
from producers.releases import COMMANDS, build_event
from streams.controls.policy import Policy, Role
from tests.producers.receiver.test_server import RunningReceiver, events_on, release_event

ISSUER, AUDIENCE = "https://idp.example.com", "gpuledger-receiver"
TOKENS = {"alice": "tok-alice-" + "a" * 40, "mallory": "tok-mallory-" + "m" * 40, "ci": "tok-ci-" + "c" * 40}


def _sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@pytest.fixture
def credentials(tmp_path):
    path = tmp_path / "callers.yaml"
    path.write_text(json.dumps({"callers": [
        {"identity": "user:alice", "groups": ["release-managers"], "token_sha256": _sha(TOKENS["alice"])},
        {"identity": "user:mallory", "token_sha256": _sha(TOKENS["mallory"])},
        {"identity": "service:ci-gitlab", "groups": ["ci"], "token_sha256": _sha(TOKENS["ci"]), "endpoints": ["releases"]},
    ]}))
    assert TOKENS["alice"] not in path.read_text()  # only hashes are stored
    return path


@pytest.fixture
def signing_key(tmp_path):
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key()))
    jwks = tmp_path / "jwks.json"
    jwks.write_text(json.dumps({"keys": [{**jwk, "kid": "k1", "use": "sig", "alg": "RS256"}]}))
    return key, jwks


def _jwt(key, **claims) -> str:
    now = int(time.time())
    body = {"iss": ISSUER, "aud": AUDIENCE, "sub": "carol", "iat": now, "exp": now + 300, "groups": ["sre"], **claims}
    return jwt.encode(body, key, algorithm="RS256", headers={"kid": "k1"})


DELEGATING = Policy().model_copy(update={"roles": {**Policy().roles, "ci": Role(owner="team-mlops", members=("service:ci-gitlab",),
                                                                                actions=("delegate",))}})


@pytest.fixture
def start(catalogue, settings_for):
    running: list[RunningReceiver] = []

    def go(policy: Policy | None = None, **config) -> RunningReceiver:
        rx = RunningReceiver(ReceiverSettings(**config), EventPublisher.from_settings(settings_for(catalogue), "receiver"), policy=policy)
        running.append(rx.__enter__())
        return rx

    yield go
    for rx in running:
        rx.__exit__()


def _bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def test_actor_is_the_authenticated_caller_and_delegation_needs_the_right(start, credentials, catalogue, kafka_bootstrap):
    rx = start(policy=DELEGATING, credentials_file=str(credentials))
    # alice approves; naming herself (bare or proven form) or nobody is fine.
    status, own = rx.post("/v1/releases", release_event(payload={"actor": "alice", "approval_id": "CHG-1"}), headers=_bearer(TOKENS["alice"]))
    assert status == 200, own
    # mallory claims to be alice: refused, naming the field; nothing published.
    status, forged = rx.post("/v1/releases", release_event(payload={"actor": "alice", "approval_id": "CHG-9"}), headers=_bearer(TOKENS["mallory"]))
    assert (status, forged["field"]) == (403, "payload.actor") and "user:mallory may not publish as 'alice'" in forged["error"]
    # CI for alice: allowed, the policy gives service:ci-gitlab the delegate right.
    ci = release_event(payload={"on_behalf_of": "user:alice", "approval_id": "CHG-2"})
    status, delegated = rx.post("/v1/releases", ci, headers=_bearer(TOKENS["ci"]))
    assert status == 200, delegated
    # mallory asserting a person: no delegate right → 403.
    status, answer = rx.post("/v1/releases", release_event(payload={"on_behalf_of": "user:alice"}), headers=_bearer(TOKENS["mallory"]))
    assert (status, answer["field"]) == (403, "payload.on_behalf_of"), answer
    # A wrong token is 401, never anonymous; a token outside its endpoints is 403.
    assert rx.post("/v1/releases", release_event(), headers=_bearer("tok-nobody"))[0] == 401
    assert rx.post("/v1/alertmanager", b'{"alerts": []}', headers=_bearer(TOKENS["ci"]))[0] == 403

    stored = {e.event_id: e.payload for _, e in events_on(kafka_bootstrap, catalogue.release, 2)}
    assert len(stored) == 2
    alice = stored[own["event_ids"][0]]
    assert (alice.actor, alice.authenticated_by, alice.actor_groups) == ("user:alice", "token", ("release-managers",))
    via_ci = stored[delegated["event_ids"][0]]
    assert (via_ci.actor, via_ci.on_behalf_of, via_ci.authenticated_by) == ("service:ci-gitlab", "user:alice", "token")


def test_one_decision_relayed_for_two_people_at_one_time_is_two_events(start, credentials, catalogue, kafka_bootstrap):
    """The id names the person a service relays for: the same approval relayed for alice and for bob
    at one time had one id, so the tables kept one of the two (a retry of either keeps its own)."""
    rx = start(policy=DELEGATING, credentials_file=str(credentials))
    ids = []
    for person in ("user:alice", "user:bob", "user:alice"):
        status, answer = rx.post("/v1/releases", release_event(payload={"on_behalf_of": person, "approval_id": "CHG-7"}),
                                 headers=_bearer(TOKENS["ci"]))
        assert status == 200, answer
        ids.append(answer["event_ids"][0])
    assert ids[0] == ids[2] and ids[0] != ids[1]
    stored = {e.event_id: e.payload.on_behalf_of for _, e in events_on(kafka_bootstrap, catalogue.release, 3)}
    assert sorted(stored.values()) == ["user:alice", "user:bob"] and set(stored) == set(ids)


def test_the_delegate_right_can_be_held_through_the_callers_group(start, credentials):
    # The policy grants delegate to group:ci; service:ci-gitlab is in it by its credentials file entry, mallory is not.
    by_group = Policy().model_copy(update={"roles": {**Policy().roles, "ci": Role(owner="team-mlops", members=("group:ci",), actions=("delegate",))}})
    rx = start(policy=by_group, credentials_file=str(credentials))
    status, answer = rx.post("/v1/releases", release_event(payload={"on_behalf_of": "user:alice", "approval_id": "CHG-3"}), headers=_bearer(TOKENS["ci"]))
    assert status == 200, answer
    status, answer = rx.post("/v1/releases", release_event(payload={"on_behalf_of": "user:alice", "actor_groups": ["ci"]}),
                             headers=_bearer(TOKENS["mallory"]))  # groups in the body are not the caller's
    assert (status, answer["field"]) == (403, "payload.on_behalf_of"), answer


def test_delegation_without_the_policy_right_is_403(start, credentials):
    rx = start(credentials_file=str(credentials))  # the default policy: nobody may delegate
    status, answer = rx.post("/v1/releases", release_event(payload={"on_behalf_of": "user:alice"}), headers=_bearer(TOKENS["ci"]))
    assert (status, answer["field"]) == (403, "payload.on_behalf_of"), answer


def test_forged_event_id_is_ignored(start, credentials, catalogue, kafka_bootstrap):
    rx = start(credentials_file=str(credentials))
    at = datetime(2026, 5, 4, 9, tzinfo=timezone.utc)
    approve = next(c for c in COMMANDS if c.name == "approve")
    genuine = build_event(approve, {"release_id": "fraud-detector:7", "actor": "alice", "approval_id": "CHG-1042", "at": at.isoformat()})
    forged = release_event(event_id=genuine.event_id, occurred_at=at.isoformat(), payload={"approval_id": "CHG-1042"})
    status, answer = rx.post("/v1/releases", forged, headers=_bearer(TOKENS["mallory"]))
    assert status == 200 and answer["event_ids"] != [genuine.event_id]
    # The same decision by alice is another fact with its own id; a retry of hers keeps it.
    by_alice = rx.post("/v1/releases", forged, headers=_bearer(TOKENS["alice"]))[1]["event_ids"]
    assert by_alice != answer["event_ids"] and rx.post("/v1/releases", forged, headers=_bearer(TOKENS["alice"]))[1]["event_ids"] == by_alice
    ids = {e.event_id for _, e in events_on(kafka_bootstrap, catalogue.release, 2)}
    assert ids == {answer["event_ids"][0], by_alice[0]} and genuine.event_id not in ids


def test_oidc_tokens_are_verified_against_the_jwks(start, signing_key, catalogue, kafka_bootstrap):
    key, jwks = signing_key
    rx = start(oidc={"issuer": ISSUER, "audience": AUDIENCE, "jwks_file": str(jwks)})
    status, answer = rx.post("/v1/releases", release_event(payload={"approval_id": "CHG-7"}), headers=_bearer(_jwt(key)))
    assert status == 200, answer
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    for bad in (_jwt(key, exp=int(time.time()) - 3600), _jwt(key, iss="https://evil.example.com"), _jwt(key, aud="someone-else"), _jwt(other)):
        status, refused = rx.post("/v1/releases", release_event(), headers=_bearer(bad))
        assert (status, refused["field"]) == (401, "Authorization"), refused
    [(_, event)] = events_on(kafka_bootstrap, catalogue.release, 1)
    assert (event.payload.actor, event.payload.authenticated_by, event.payload.actor_groups) == ("user:carol", "oidc", ("sre",))


def test_policy_can_require_a_credential_per_endpoint(start, credentials):
    policy = Policy().model_copy(update={"authentication": Policy().authentication.model_copy(update={"required_on": ("releases",)})})
    rx = start(policy=policy, credentials_file=str(credentials))
    status, answer = rx.post("/v1/releases", release_event())
    assert (status, answer["field"]) == (401, "Authorization"), answer
    assert rx.post("/v1/alertmanager", b'{"alerts": []}')[0] == 200  # not required there


def test_non_loopback_bind_without_any_credential_is_refused(catalogue, settings_for):
    publisher = EventPublisher.from_settings(settings_for(catalogue), "receiver")
    try:
        with pytest.raises(ReceiverError, match="--allow-unauthenticated"):
            asyncio.run(serve(ReceiverSettings(host="0.0.0.0", port=0), publisher))
    finally:
        publisher.close(5)


def _self_signed(tmp_path, name: str):
    from datetime import timedelta

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID
    import ipaddress

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.now(timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - timedelta(minutes=1)).not_valid_after(now + timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .sign(key, hashes.SHA256()))
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return cert_pem, key_pem


def test_tls_serves_https_and_reloads_a_changed_certificate(start, tmp_path, monkeypatch):
    import os
    import ssl
    import urllib.error
    import urllib.request

    import producers.receiver.server as server

    monkeypatch.setattr(server, "TLS_RELOAD_CHECK_S", 0.2)
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    first, second = _self_signed(tmp_path, "first"), _self_signed(tmp_path, "second")
    cert.write_bytes(first[0])
    key.write_bytes(first[1])
    rx = start(tls_cert_file=str(cert), tls_key_file=str(key))
    url = rx.url.replace("http://", "https://")

    def trusted_by(pem: bytes) -> bool:
        try:
            with urllib.request.urlopen(f"{url}/healthz", context=ssl.create_default_context(cadata=pem.decode()), timeout=10) as resp:
                return resp.status == 200
        except (ssl.SSLError, urllib.error.URLError):
            return False

    assert trusted_by(first[0]) and not trusted_by(second[0])
    key.write_bytes(second[1])
    cert.write_bytes(second[0])
    later = time.time_ns() + 2 * 10**9  # a distinct mtime even on coarse filesystems
    os.utime(cert, ns=(later, later))
    os.utime(key, ns=(later, later))
    deadline = time.monotonic() + 10
    while not trusted_by(second[0]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert trusted_by(second[0]) and not trusted_by(first[0])


class _Idp:
    """A JWKS endpoint on 127.0.0.1 that answers after ``delay_s``, counting its fetches."""

    def __init__(self, body: bytes, delay_s: float = 0.0) -> None:
        import http.server
        import threading

        idp = self

        class Jwks(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's naming
                idp.fetches += 1
                time.sleep(idp.delay_s)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.fetches, self.delay_s = 0, delay_s
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Jwks)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/.well-known/jwks.json"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_slow_jwks_endpoint_holds_only_the_requests_that_need_its_keys(start, signing_key, catalogue, kafka_bootstrap):
    import concurrent.futures

    key, jwks = signing_key
    idp = _Idp(jwks.read_bytes(), delay_s=6.0)
    try:
        rx = start(oidc={"issuer": ISSUER, "audience": AUDIENCE, "jwks_url": idp.url})
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            t0 = time.monotonic()
            pending = pool.submit(rx.post, "/v1/releases", release_event(payload={"approval_id": "CHG-11"}), headers=_bearer(_jwt(key, sub="dana")))
            time.sleep(0.3)  # let the JWT request reach the receiver (not a condition: it is what the request waits for below)
            # While the keys are being fetched (6 s), everything else is answered (a blocked loop
            # would hold each of these until the JWKS answer; the bounds leave room for a loaded machine).
            for _ in range(3):
                t = time.monotonic()
                assert rx.request("GET", "/healthz")[0] == 200
                assert time.monotonic() - t < 2.0, "/healthz waited for the JWKS endpoint"
                status, answer = rx.post("/v1/releases", release_event(payload={"approval_id": "CHG-12"}))
                assert status == 200, answer
                assert time.monotonic() - t < 3.0, "an unrelated request waited for the JWKS endpoint"
            assert not pending.done(), "the JWT request did not wait for its keys (the test proves nothing)"
            status, answer = pending.result(timeout=30)
            assert status == 200, answer
            assert time.monotonic() - t0 >= 5.5
        # The key set is cached by PyJWT: the next token verifies without a fetch.
        fetched = idp.fetches
        t = time.monotonic()
        status, _ = rx.post("/v1/releases", release_event(payload={"approval_id": "CHG-13"}), headers=_bearer(_jwt(key, sub="erin")))
        assert status == 200 and time.monotonic() - t < 3.0 and idp.fetches == fetched
        actors = {e.payload.approval_id: (e.payload.actor, e.payload.authenticated_by) for _, e in events_on(kafka_bootstrap, catalogue.release, 5)}
        assert actors["CHG-11"] == ("user:dana", "oidc") and actors["CHG-13"] == ("user:erin", "oidc") and actors["CHG-12"][1] is None
    finally:
        idp.close()


def test_an_unreachable_jwks_endpoint_answers_503_retriable(start, signing_key):
    from gpuledger.dev.process import free_port

    key, _ = signing_key
    rx = start(oidc={"issuer": ISSUER, "audience": AUDIENCE, "jwks_url": f"http://127.0.0.1:{free_port()}/jwks.json", "jwks_timeout_s": 2})
    status, answer = rx.post("/v1/releases", release_event(), headers=_bearer(_jwt(key)))
    assert status == 503 and answer["retriable"] is True and answer["field"] == "Authorization", answer
    assert "cannot be fetched, retry later" in answer["error"]


def test_oidc_keys_from_a_jwks_url(start, signing_key, catalogue, kafka_bootstrap):
    key, jwks = signing_key
    idp = _Idp(jwks.read_bytes())
    try:
        url = idp.url
        rx = start(oidc={"issuer": ISSUER, "audience": AUDIENCE, "jwks_url": url})
        status, answer = rx.post("/v1/releases", release_event(payload={"approval_id": "CHG-8"}), headers=_bearer(_jwt(key, sub="dana")))
        assert status == 200, answer
        [(_, event)] = events_on(kafka_bootstrap, catalogue.release, 1)
        assert (event.payload.actor, event.payload.authenticated_by) == ("user:dana", "oidc")
    finally:
        idp.close()


BY_GROUP = Policy().model_copy(update={"roles": {**Policy().roles, "ci": Role(owner="team-mlops", members=("group:ci",), actions=("delegate",))}})


def test_a_token_whose_identity_or_groups_the_schema_refuses_is_401_naming_the_claim(start, signing_key, catalogue, kafka_bootstrap):
    # These were answered 200 with an event id and then dead-lettered by the worker (payload.actor:
    # contains U+202E): an "accepted" answer for an event that never reached history. And 'mallory>alice'
    # in group ci was judged as mallory acting for alice, though no on_behalf_of was named or checked.
    key, jwks = signing_key
    rx = start(policy=BY_GROUP, oidc={"issuer": ISSUER, "audience": AUDIENCE, "jwks_file": str(jwks)})
    cases = [
        (_jwt(key, sub="ali\u202ece"), "'sub' claim", "contains U+202E (RIGHT-TO-LEFT OVERRIDE)"),
        (_jwt(key, sub="mallory>alice", groups=["ci"]), "'sub' claim", "contains '>'"),
        (_jwt(key, groups=["ok", "bad\u202e"]), "'groups' claim, item 1", "contains U+202E"),
        (_jwt(key, groups=["ci>x"]), "'groups' claim, item 0", "contains '>'"),
        (_jwt(key, groups="ci"), "'groups' claim", "not a list of group names"),
        (_jwt(key, groups=["ci", 7]), "'groups' claim", "not a list of group names"),
    ]
    for token, claim, problem in cases:
        status, answer = rx.post("/v1/releases", release_event(payload={"approval_id": "CHG-5"}), headers=_bearer(token))
        assert (status, answer["field"]) == (401, "Authorization"), answer
        assert claim in answer["error"] and problem in answer["error"] and "\u202e" not in answer["error"], answer
    # A proven identity cannot start like an unproven one (an empty identity_prefix makes the claim the whole identity).
    bare = start(oidc={"issuer": ISSUER, "audience": AUDIENCE, "jwks_file": str(jwks), "identity_prefix": ""})
    status, answer = bare.post("/v1/releases", release_event(payload={"approval_id": "CHG-5"}), headers=_bearer(_jwt(key, sub="unauthenticated:bob")))
    assert status == 401 and "starts with 'unauthenticated:'" in answer["error"], answer
    # A groups claim that is absent or null is no group.
    status, answer = rx.post("/v1/releases", release_event(payload={"approval_id": "CHG-6"}), headers=_bearer(_jwt(key, groups=None)))
    assert status == 200, answer
    [(_, event)] = events_on(kafka_bootstrap, catalogue.release, 1)
    assert (event.payload.actor, event.payload.actor_groups) == ("user:carol", ())


def test_an_identity_the_schema_refuses_is_never_stamped_on_an_event_unvalidated():
    """The stamping behind every event a caller proves validates what it stamps: were a proof
    ever to let such an identity past the edge, the request fails instead of publishing it."""
    from pydantic import ValidationError

    from producers.receiver.auth import Principal
    from producers.receiver.server import LifecycleReceiver
    from schemas import decode_event

    receiver = LifecycleReceiver(ReceiverSettings(), publisher=None, policy=BY_GROUP)
    event = decode_event(release_event(payload={"approval_id": "CHG-5"}))
    for principal in (Principal("user:ali\u202ece", (), "oidc"), Principal("user:carol", ("ci>x",), "oidc")):
        with pytest.raises(ValidationError, match=r"actor(_groups\.0)?\n.*(U\+202E|contains .>.)"):
            receiver._proven(event, principal, "")


def test_a_person_named_with_a_delegation_marker_is_422(start, credentials, catalogue, kafka_bootstrap):
    # 'x>alice' read back as the service acting for alice.
    rx = start(policy=BY_GROUP, credentials_file=str(credentials))
    status, answer = rx.post("/v1/releases", release_event(payload={"on_behalf_of": "x>alice"}), headers=_bearer(TOKENS["ci"]))
    assert (status, answer["field"]) == (422, "payload.on_behalf_of") and "contains '>'" in answer["error"], answer
    status, answer = rx.post("/v1/releases", release_event(payload={"actor": "mallory>alice"}))  # unauthenticated alike
    assert (status, answer["field"]) == (422, "payload.actor"), answer
    assert events_on(kafka_bootstrap, catalogue.release, 0, timeout=3) == []


@pytest.mark.parametrize(("caller", "where", "problem"), [
    ({"identity": "user:mallory>alice"}, "callers[0].identity", "contains '>'"),
    ({"identity": "user:ali\u202ece"}, "callers[0].identity", "U+202E"),
    ({"identity": "user:alice", "groups": ["ok", "bad\u202e"]}, "callers[0].groups.1", "U+202E"),
    ({"identity": "user:alice", "groups": ["ci>x"]}, "callers[0].groups.0", "contains '>'"),
])
def test_a_callers_file_entry_the_schema_would_refuse_is_a_load_error_naming_it(tmp_path, caller, where, problem):
    from producers.receiver.auth import CredentialsFile, CredentialsFileError

    path = tmp_path / "callers.yaml"
    path.write_text(json.dumps({"callers": [{**caller, "token_sha256": _sha(TOKENS["alice"])}]}))
    with pytest.raises(CredentialsFileError) as info:
        CredentialsFile(path)
    assert f"{where}: " in str(info.value) and problem in str(info.value), info.value


def test_a_credentials_file_that_breaks_refuses_its_tokens_until_it_is_fixed(start, credentials, signing_key, caplog):
    # Revocation failed open: mallory removed in an edit that also left a stray tab (or the file
    # deleted) kept her token valid, "keeping the previous callers".
    key, jwks = signing_key
    rx = start(credentials_file=str(credentials), oidc={"issuer": ISSUER, "audience": AUDIENCE, "jwks_file": str(jwks)})
    good = credentials.read_text()
    approve = release_event(payload={"approval_id": "CHG-20"})
    assert rx.post("/v1/releases", approve, headers=_bearer(TOKENS["mallory"]))[0] == 200
    without_mallory = json.loads(good)
    without_mallory["callers"] = [c for c in without_mallory["callers"] if c["identity"] != "user:mallory"]
    broken = json.dumps(without_mallory, indent=2).replace('\n  "callers"', '\n\t"callers"')  # a tab: not YAML
    caplog.set_level("ERROR", logger="producers.receiver.auth")
    for state in (broken, None):  # invalid, then deleted
        if state is None:
            credentials.unlink()
        else:
            credentials.write_text(state)
        for token in (TOKENS["mallory"], TOKENS["alice"], "tok-nobody"):
            for _ in range(2):
                status, answer = rx.post("/v1/releases", approve, headers=_bearer(token))
                assert (status, answer["field"], answer.get("retriable")) == (503, "Authorization", True), answer
                assert "credentials file cannot be read or is invalid" in answer["error"] and str(credentials) not in answer["error"]
        # A JWT is not the file's: still verified.
        assert rx.post("/v1/releases", approve, headers=_bearer(_jwt(key)))[0] == 200
    # Logged once per state (invalid, deleted), not once per request.
    logged = [r.getMessage() for r in caplog.records if r.name == "producers.receiver.auth" and r.levelname == "ERROR"]
    assert len(logged) == 2 and "found character '\\t'" in logged[0] and "No such file" in logged[1], logged
    # Fixed: the file's callers as it now says — mallory's revocation holds.
    credentials.write_text(json.dumps(without_mallory))
    assert rx.post("/v1/releases", approve, headers=_bearer(TOKENS["alice"]))[0] == 200
    status, answer = rx.post("/v1/releases", approve, headers=_bearer(TOKENS["mallory"]))
    assert (status, answer["field"]) == (401, "Authorization"), answer


def test_a_bad_credentials_file_at_start_is_an_error(tmp_path):
    from producers.receiver.auth import CredentialsFile, CredentialsFileError

    path = tmp_path / "callers.yaml"
    path.write_text("callers:\n\t- identity: user:alice\n")
    with pytest.raises(CredentialsFileError, match="callers.yaml"):
        CredentialsFile(path)
    with pytest.raises(CredentialsFileError, match="No such file"):
        CredentialsFile(tmp_path / "missing.yaml")


def test_a_caller_removed_within_the_same_mtime_is_revoked(tmp_path, credentials):
    # An edit within the filesystem's timestamp granularity (or a file replaced by one with the
    # same mtime) was taken for no change: the removed caller stayed valid.
    import os

    from producers.receiver.auth import CredentialsFile

    callers = CredentialsFile(credentials)
    assert callers.lookup(TOKENS["mallory"]) is not None
    mtime = credentials.stat().st_mtime_ns
    edited = json.loads(credentials.read_text())
    edited["callers"] = [c for c in edited["callers"] if c["identity"] != "user:mallory"]
    credentials.write_text(json.dumps(edited))
    os.utime(credentials, ns=(mtime, mtime))
    assert callers.lookup(TOKENS["mallory"]) is None and callers.lookup(TOKENS["alice"]).identity == "user:alice"


def test_alias_holders_are_only_moves_a_credential_proved(start, credentials, catalogue, kafka_bootstrap):
    # /v1/mlflow authenticated by bearer tokens (no MLflow secret): an anonymous POST to
    # /v1/releases that only said it was an MLflow move of prod to version 9 was read back as
    # prod's holder, and alice's proven move to 6 published as "rt-hold:9 rolled_back out of prod
    # (replaced by rt-hold:6) by user:alice" — a proven actor on a rollback of what nobody proved.
    from tests.producers.receiver.test_server import mlflow_headers

    t0 = datetime(2026, 5, 4, 9, tzinfo=timezone.utc)

    def move(version: str, seconds: int) -> bytes:
        return json.dumps({"entity": "model_version_alias", "action": "created", "timestamp": (t0.replace(second=seconds)).isoformat(),
                           "data": {"name": "rt-hold", "alias": "prod", "version": version}}).encode()

    forged = release_event("release.promoted", "rt-hold:9", occurred_at=t0.isoformat(), source={"collector": "mlflow", "host": "rx"},
                           identity={"release_id": "rt-hold:9", "model_name": "rt-hold", "model_version": "9", "environment": "prod"},
                           payload={"to_environment": "prod", "tags": {"mlflow.alias": "prod"}})
    assert start(credentials_file=str(credentials)).post("/v1/releases", forged)[0] == 200
    rx = start(credentials_file=str(credentials))  # reads the alias holders from the topic at start
    published = []
    for version, seconds in (("6", 1), ("8", 2), ("7", 3)):
        body = move(version, seconds)
        status, answer = rx.post("/v1/mlflow", body, headers={**mlflow_headers(body), **_bearer(TOKENS["alice"])})
        assert status == 200, answer
        published.append(answer["event_ids"])
    by_id = {e.event_id: e for _, e in events_on(kafka_bootstrap, catalogue.release, 5)}
    moves = [[(by_id[i].event_type, by_id[i].identity.release_id, by_id[i].payload.superseded_release_id, by_id[i].payload.actor)
              for i in ids] for ids in published]
    assert moves == [
        [("release.promoted", "rt-hold:6", None, "user:alice")],  # the forged holder is no holder
        [("release.promoted", "rt-hold:8", "rt-hold:6", "user:alice")],  # a proven one is
        [("release.rolled_back", "rt-hold:8", "rt-hold:7", "user:alice"), ("release.promoted", "rt-hold:7", "rt-hold:8", "user:alice")],
    ]


def test_an_anonymous_relay_is_403_naming_on_behalf_of_and_nothing_is_stored(start, catalogue, kafka_bootstrap):
    """An anonymous POST naming on_behalf_of was answered 200 and stored with a null actor
    ("someone for user:alice (unauthenticated)"; control 7 read "…:  acted for user:alice"):
    only a proven service's delegate right makes a relay mean anything (exploratory review)."""
    rx = start()  # no credential configured: anonymous posts are taken on loopback
    for payload in ({"on_behalf_of": "user:alice", "approval_id": "CHG-1"},
                    {"actor": "ci", "on_behalf_of": "user:alice", "approval_id": "CHG-1"}):
        status, answer = rx.post("/v1/releases", release_event(payload=payload))
        assert (status, answer["field"]) == (403, "payload.on_behalf_of"), answer
        assert "acting on behalf of 'user:alice' needs a credential" in answer["error"], answer
    status, answer = rx.post("/v1/releases", [release_event(), release_event(payload={"on_behalf_of": "user:alice"})])
    assert (status, answer["field"]) == (403, "[1].payload.on_behalf_of"), answer  # all-or-nothing
    # Anonymous posts naming only themselves are still taken: the one stored event is this one.
    status, own = rx.post("/v1/releases", release_event(payload={"actor": "ci", "approval_id": "CHG-2"}))
    assert status == 200, own
    [(_, stored)] = events_on(kafka_bootstrap, catalogue.release, 1)
    assert (stored.event_id, stored.payload.actor, stored.payload.on_behalf_of) == (own["event_ids"][0], "ci", None)


def test_the_readmes_ci_curl_example_works_as_documented(start, credentials, catalogue, kafka_bootstrap):
    """README.md's CI example, run by bash and curl as written (only the URL is this receiver's):
    stored as the CI service relaying for the person; a caller without the delegate right is refused."""
    import os
    import re
    import subprocess
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    [script] = [b for b in re.findall(r"```sh\n(.*?)```", readme, re.S) if "curl" in b and "/v1/releases" in b]
    rx = start(policy=DELEGATING, credentials_file=str(credentials))
    script = script.replace("https://gpuledger-receiver.gpuledger.svc:9095", rx.url).replace("curl -sf", "curl -sS -w '\\n%{http_code}'")
    env = {"PATH": os.environ["PATH"], "CI_PIPELINE_CREATED_AT": "2026-05-04T09:00:00Z", "GITLAB_USER_LOGIN": "alice"}

    def run(token: str) -> tuple[int, dict]:
        out = subprocess.run(["bash", "-c", script], env={**env, "CI_RECEIVER_TOKEN": token}, capture_output=True, text=True, timeout=60)
        body, _, status = out.stdout.rpartition("\n")
        return int(status), json.loads(body)

    status, answer = run(TOKENS["ci"])
    assert status == 200, answer
    [(_, stored)] = events_on(kafka_bootstrap, catalogue.release, 1)
    assert stored.event_id == answer["event_ids"][0] and stored.event_type == "release.promoted"
    assert (stored.payload.actor, stored.payload.on_behalf_of, stored.payload.authenticated_by) == ("service:ci-gitlab", "user:alice", "token")
    status, answer = run(TOKENS["mallory"])  # a caller without the delegate right
    assert (status, answer["field"]) == (403, "payload.on_behalf_of"), answer
