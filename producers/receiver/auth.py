"""Who is calling the receiver: a request's credential → a proven identity.

Input: the ``Authorization`` header of a request (and, for MLflow, the delivery's
signature, checked in ``producers.receiver.mlflow``). Output: a ``Principal`` — identity
(``user:alice``, ``service:ci-gitlab``, ``service:mlflow/gpuledger``), groups and how it was
proven — or None when the request carries no credential.

Proofs, tried in this order for a bearer token:
- **credentials file** (``credentials_file``): YAML ``callers: [{identity, groups,
  token_sha256, endpoints}]``. Only the SHA-256 of each token is stored: tokens are random
  secrets of at least 128 bits (``openssl rand -hex 32``), so a fast hash is enough — there
  is no low-entropy password to stretch — and a leaked file leaks no token. The file is
  re-read when it changes (mtime, size, inode), so callers can be added or revoked without a restart.
- **OIDC / JWT** (``oidc``): a token with three dot-separated parts is verified with PyJWT
  against the configured issuer's JWKS (file or URL), ``iss``, ``aud`` and ``exp``;
  identity = ``identity_prefix`` + the ``identity_claim`` (default ``user:`` + ``sub``),
  groups from ``groups_claim`` (a list of strings).
Identities and groups, from a token or the file, must be what the release schema takes as
an actor (``schemas.release.ActorIdText``): a token that proves anything else is a 401
naming the claim, a file entry a load error naming it.
- **per-source shared token** (``<source>_bearer_token``, the older setting): identity
  ``service:<source>``, method ``shared-token``.
Guarantees: a credential that is presented and wrong is a 401 (``AuthError``), never
"anonymous"; comparisons of secrets are constant-time; tokens are never logged.
JWKS URLs are fetched by PyJWT's ``PyJWKClient`` and cached by it (the whole key set for
``jwks_cache_s``; an unknown ``kid`` refetches at most once per 30 s, its cooldown). A
verification whose key is in that cache needs no I/O (``fetch=False``); one that needs the
network raises ``KeyFetchNeeded`` so that the receiver repeats it on a thread of its own and
its event loop never waits for the identity provider.
A credentials file that becomes unreadable or invalid while serving fails closed: every
bearer token that is not a JWT is refused (503, retriable) until the file is fixed.
Limits: no token revocation list beyond removing a caller from the file.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from producers._errors import PayloadError, ProducerError
from schemas.envelope import nfc
from schemas.release import ActorIdText, actor_name_problem

log = logging.getLogger(__name__)

ENDPOINTS = ("alertmanager", "releases", "mlflow")


@dataclass(frozen=True)
class Principal:
    """A caller the receiver proved: its identity, its groups and how it was proven."""

    identity: str
    groups: tuple[str, ...] = ()
    method: str = "token"  # token | oidc | shared-token | mlflow-webhook


class AuthError(PayloadError):
    """A credential that is missing where required, or presented and not valid (HTTP 401)."""

    def __init__(self, message: str, field: str = "Authorization") -> None:
        super().__init__(message, field=field, reason="unauthorized", status=401)


class Caller(BaseModel):
    """One caller of the credentials file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # ActorIdText: what the receiver stamps on the caller's events must be what the release schema
    # accepts (an event it answered 200 for must not be dead-lettered by the worker).
    identity: ActorIdText = Field(pattern=r"^(user|service):[^\s:][^\s]*$", description="Who the token proves: 'user:<name>' or 'service:<name>' (no control or bidi character, no '>').")
    groups: tuple[ActorIdText, ...] = Field(default=(), description="Groups of the caller (recorded with its events; no control or bidi character, no '>').")
    token_sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="SHA-256 (hex) of the bearer token: `printf %s TOKEN | sha256sum`.")
    endpoints: tuple[str, ...] = Field(default=ENDPOINTS, description="Endpoints the token may call (default: all).")

    @model_validator(mode="after")
    def _known_endpoints(self) -> Caller:
        unknown = sorted(set(self.endpoints) - set(ENDPOINTS))
        if unknown:
            raise ValueError(f"endpoints: unknown {', '.join(unknown)} (known: {', '.join(ENDPOINTS)})")
        return self


class KeyFetchNeeded(Exception):
    """Verifying this JWT needs the JWKS URL (cache empty or expired, unknown ``kid``):
    call again with ``fetch=True`` off the event loop."""


class CredentialsFileError(ProducerError):
    """A credentials file that cannot be used; the message names the file and every problem."""


class CredentialsFile:
    """The callers of a credentials file, by token hash; re-read when the file changes.

    Fails closed: while the file cannot be read (deleted, unreadable) or is invalid, ``lookup``
    raises ``CredentialsFileError`` for every token — keeping the previous callers meant that a
    caller removed in an edit that also broke the file (a stray tab), or in deleting it, stayed
    valid. Logged once per change of state; usable again as soon as the file is fixed.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._stamp: tuple[int, int, int] | None = None  # of the file last read, good or not
        self._by_hash: dict[str, Caller] = {}
        self._problem: str | None = None  # why the file on disk cannot be used, or None
        self._lock = threading.Lock()
        self._serving = False  # (a bad file at start is the caller's error to report, not a log line)
        self._refresh()
        if self._problem is not None:  # fail at start on a bad file, before serving
            raise CredentialsFileError(self._problem)
        self._serving = True

    def _read(self) -> dict[str, Caller]:
        try:
            data = yaml.safe_load(self.path.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise CredentialsFileError(f"{self.path}: {exc}") from exc
        callers = data.get("callers") if isinstance(data, dict) else None
        if not isinstance(callers, list):
            raise CredentialsFileError(f"{self.path}: expected a mapping with a `callers:` list")
        problems, by_hash = [], {}
        for i, item in enumerate(callers):
            try:
                caller = Caller.model_validate(item)
            except ValidationError as exc:
                problems += [f"callers[{i}].{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors(include_url=False)]
                continue
            if caller.token_sha256 in by_hash:
                problems.append(f"callers[{i}]: the same token as {by_hash[caller.token_sha256].identity}")
            by_hash[caller.token_sha256] = caller
        if problems:
            raise CredentialsFileError(f"{self.path}: " + "; ".join(problems))
        return by_hash

    def _refresh(self) -> None:
        """Re-read the file if it changed; ``_problem`` says why it cannot be used, if it cannot."""
        try:
            st = self.path.stat()
        except OSError as exc:
            self._fail(None, f"{self.path}: {exc}")
            return
        # Size and inode too: a file replaced (renamed over, a Kubernetes secret's symlink swap)
        # or edited within the filesystem's timestamp granularity keeps its mtime.
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp == self._stamp:
            return
        try:
            by_hash = self._read()
        except CredentialsFileError as exc:
            self._fail(stamp, str(exc))
            return
        if self._problem is not None:
            log.warning("credentials file %s is usable again: its callers are accepted", self.path)
        self._by_hash, self._stamp, self._problem = by_hash, stamp, None
        log.info("credentials: %d caller(s) from %s", len(by_hash), self.path)

    def _fail(self, stamp: tuple[int, int, int] | None, problem: str) -> None:
        if self._serving and problem != self._problem:
            log.error("credentials file cannot be used, refusing every token of it until it is fixed: %s", problem)
        # A missing file has no stamp: whatever appears next is read.
        self._by_hash, self._stamp, self._problem = {}, stamp, problem

    def lookup(self, token: str) -> Caller | None:
        """The caller of ``token``, or None; ``CredentialsFileError`` while the file cannot be used."""
        with self._lock:
            self._refresh()
            if self._problem is not None:
                raise CredentialsFileError(self._problem)
            digest = hashlib.sha256(token.encode()).hexdigest()
            # The dict lookup is on a hash of a high-entropy secret; compare again in constant time.
            caller = self._by_hash.get(digest)
            return caller if caller is not None and hmac.compare_digest(caller.token_sha256, digest) else None


class OidcSettings(BaseModel):
    """OIDC / JWT bearer tokens: verified against the issuer's signing keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    issuer: str = Field(min_length=1, description="Expected `iss` claim (the identity provider's issuer URL).")
    audience: str = Field(min_length=1, description="Expected `aud` claim (the audience the tokens are minted for).")
    jwks_file: Path | None = Field(default=None, description="JWKS (JSON Web Key Set) file with the issuer's public keys.")
    jwks_url: str | None = Field(default=None, description="URL of the issuer's JWKS (e.g. <issuer>/.well-known/jwks.json).")
    algorithms: tuple[str, ...] = Field(default=("RS256", "ES256"), description="Accepted signature algorithms (never 'none').")
    identity_claim: str = Field(default="sub", description="Claim that names the caller.")
    identity_prefix: str = Field(default="user:", description="Prefix of the identity made from the claim ('user:' or 'service:').")
    groups_claim: str = Field(default="groups", description="Claim listing the caller's groups.")
    leeway_s: float = Field(default=30.0, ge=0, description="Clock skew allowed on exp/nbf/iat.")
    jwks_cache_s: float = Field(default=300.0, gt=0, description="How long a key set fetched from jwks_url is used before it is fetched again (a rotated-out key stops verifying after at most this long).")
    jwks_timeout_s: float = Field(default=10.0, gt=0, description="Timeout of one jwks_url fetch; requests waiting for it get 503 (retriable) when it fails.")

    @model_validator(mode="after")
    def _one_key_source(self) -> OidcSettings:
        if (self.jwks_file is None) == (self.jwks_url is None):
            raise ValueError("give exactly one of jwks_file or jwks_url")
        if self.identity_prefix.startswith("group:"):
            raise ValueError("identity_prefix: 'group:' names groups in the policy, not callers (use 'user:' or 'service:')")
        if "none" in {a.lower() for a in self.algorithms}:
            raise ValueError("algorithms: 'none' would accept unsigned tokens")
        return self


class OidcVerifier:
    """PyJWT verification of bearer JWTs against the configured issuer and key set."""

    def __init__(self, settings: OidcSettings) -> None:
        import jwt

        self.settings = settings
        self._jwt = jwt
        if settings.jwks_file is not None:
            try:
                self._keys = jwt.PyJWKSet.from_json(settings.jwks_file.read_text())
            except (OSError, jwt.PyJWTError) as exc:
                raise CredentialsFileError(f"{settings.jwks_file}: not a usable JWKS: {exc}") from exc
            self._client = None
        else:
            self._keys = None
            # The key-set cache only (it expires); PyJWT's per-kid LRU (cache_keys) never does,
            # so a key the issuer rotated out would verify for ever.
            self._client = jwt.PyJWKClient(settings.jwks_url, cache_keys=False, cache_jwk_set=True, lifespan=settings.jwks_cache_s,
                                           timeout=settings.jwks_timeout_s)

    @property
    def fetches(self) -> bool:
        """Keys come from a URL (verification may need the network)."""
        return self._client is not None

    def prefetch(self) -> None:
        """Fill the key-set cache (at start, on a thread); a failure is logged, requests retry it."""
        if self._client is None:
            return
        try:
            self._client.get_jwk_set()
        except self._jwt.PyJWTError as exc:
            log.warning("oidc: cannot fetch the JWKS from %s yet: %s", self.settings.jwks_url, exc)

    def _key(self, token: str, fetch: bool):
        kid = self._jwt.get_unverified_header(token).get("kid")
        if self._client is not None:
            if fetch:
                return self._client.get_signing_key(kid).key
            # Read the library's own cache without its lock (a fetch on a thread holds it).
            cached = self._client.jwk_set_cache.get()
            key = next((k for k in cached.keys if k.key_id == kid and k.public_key_use in ("sig", None)), None) if cached else None
            if key is None:
                raise KeyFetchNeeded(kid)
            return key.key
        keys = [k for k in self._keys.keys if kid is None or k.key_id == kid]
        if not keys:
            raise self._jwt.InvalidTokenError(f"no key with kid {kid!r} in {self.settings.jwks_file}")
        return keys[0].key

    def verify(self, token: str, fetch: bool = True) -> Principal:
        """The caller a JWT proves; ``KeyFetchNeeded`` when ``fetch`` is False and the key is not cached."""
        s = self.settings
        try:
            claims = self._jwt.decode(token, self._key(token, fetch), algorithms=list(s.algorithms), audience=s.audience, issuer=s.issuer,
                                      leeway=s.leeway_s, options={"require": ["exp", "iss", "aud", s.identity_claim]})
        except self._jwt.PyJWKClientConnectionError as exc:
            raise PayloadError(f"Authorization: the identity provider's keys ({s.jwks_url}) cannot be fetched, retry later: {exc}",
                               field="Authorization", reason="jwks_unavailable", status=503, details={"retriable": True}) from exc
        except self._jwt.PyJWTError as exc:
            raise AuthError(f"Authorization: bearer JWT not accepted: {exc}") from exc
        name = claims.get(s.identity_claim)
        if not isinstance(name, str) or not name:
            raise AuthError(f"Authorization: the token's {s.identity_claim!r} claim is not a name")
        # Checked here, by the release schema's rule: a name it refuses was stamped on the event
        # unchecked, answered 200, and dead-lettered by the worker — accepted, never recorded.
        identity = nfc(s.identity_prefix + name)  # (as the schema stores it: the body's actor is compared with it)
        problem = actor_name_problem(identity)
        if problem:
            raise AuthError(f"Authorization: the token's {s.identity_claim!r} claim cannot name a caller: the identity it makes "
                            f"({s.identity_prefix!r} + the claim) {problem}")
        groups = claims.get(s.groups_claim)
        if groups is None:
            groups = []  # (absent or null: no groups)
        if not isinstance(groups, list) or not all(isinstance(g, str) for g in groups):
            # Ignored before: a caller whose groups the issuer meant to say was silently groupless.
            raise AuthError(f"Authorization: the token's {s.groups_claim!r} claim is not a list of group names")
        groups = [nfc(g) for g in groups]
        for i, group in enumerate(groups):
            problem = actor_name_problem(group)
            if problem:
                raise AuthError(f"Authorization: the token's {s.groups_claim!r} claim, item {i}: {problem}")
        return Principal(identity, tuple(groups), "oidc")


class Authenticator:
    """Turns a request's ``Authorization`` header into a ``Principal`` (or None)."""

    def __init__(self, credentials: CredentialsFile | None = None, oidc: OidcVerifier | None = None,
                 shared_tokens: dict[str, SecretStr | None] | None = None) -> None:
        self.credentials = credentials
        self.oidc = oidc
        self.shared_tokens = {k: v for k, v in (shared_tokens or {}).items() if v is not None}

    @property
    def configured(self) -> bool:
        return bool(self.credentials or self.oidc or self.shared_tokens)

    def requires_credential(self, endpoint: str) -> bool:
        """An endpoint with a shared token (the older per-source setting) accepts nothing else."""
        return endpoint in self.shared_tokens

    def authenticate(self, endpoint: str, authorization: str | None, fetch: bool = True) -> Principal | None:
        """The caller proven by the header, None if it carries no credential; ``AuthError`` if it is wrong.
        With ``fetch`` False, ``KeyFetchNeeded`` instead of a network fetch of the JWKS."""
        if authorization is None:
            return None
        if not authorization.strip():  # (presented, empty: a credential that is wrong, not none)
            raise AuthError("Authorization: empty; expected 'Bearer <token>'")
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise AuthError("Authorization: expected 'Bearer <token>'")
        shared = self.shared_tokens.get(endpoint)
        if shared is not None and hmac.compare_digest(token.encode(), shared.get_secret_value().encode()):
            return Principal(f"service:{endpoint}", (), "shared-token")
        unusable = False
        if self.credentials is not None:
            try:
                caller = self.credentials.lookup(token)
            except CredentialsFileError:  # (logged by the file, once)
                caller, unusable = None, True
            if caller is not None:
                if endpoint not in caller.endpoints:
                    raise PayloadError(f"Authorization: {caller.identity} may not call /v1/{endpoint} (its endpoints: "
                                       f"{', '.join(caller.endpoints)})", field="Authorization", reason="forbidden", status=403)
                return Principal(caller.identity, caller.groups, "token")
        if self.oidc is not None and token.count(".") == 2:
            return self.oidc.verify(token, fetch)  # a JWT is not the file's: it is verified whatever the file's state
        if unusable:
            # 503, not 401: the fault is the receiver's file, not the caller's token. Senders retry
            # 5xx (Alertmanager and MLflow do, 4xx they drop), so a valid caller loses nothing while
            # it is fixed, and a revoked one still gets nothing in. The problem itself is in the log only.
            raise PayloadError("Authorization: the receiver's credentials file cannot be read or is invalid, so none of its tokens is "
                               "accepted until an operator fixes it (the receiver's log says why); retry later", field="Authorization",
                               reason="credentials_unavailable", status=503, details={"retriable": True})
        raise AuthError("Authorization: missing or wrong bearer token")
