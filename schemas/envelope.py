"""The one envelope every gpuledger event travels in.

Input: nothing (pure types). Output: frozen pydantic models shared by every stage.
Guarantees: unknown fields and wrong types are rejected with a message naming the
field; all times are timezone-aware and normalised to UTC; ``event_id`` is a
deterministic hash of (source, natural key, source version), so an event re-sent by
a collector after a restart or by an HA pair carries the same id and the idempotent
tables downstream collapse it.
"""

from __future__ import annotations

import hashlib
import unicodedata
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Annotated, Any

from pydantic import AfterValidator, AwareDatetime, BaseModel, ConfigDict, Field, model_validator

SCHEMA_VERSION = 1


def _to_utc(value: datetime) -> datetime:
    return value.astimezone(timezone.utc)


#: A timezone-aware timestamp, normalised to UTC. Naive datetimes are rejected:
#: guessing a zone for event time is how timelines silently shift by hours.
UtcDatetime = Annotated[AwareDatetime, AfterValidator(_to_utc)]


#: Unicode categories an identifier must not contain: controls (NUL, ESC, DEL, C1), format
#: characters (the bidi overrides and isolates U+202A–U+202E, U+2066–U+2069, zero-width
#: characters), line/paragraph separators and lone surrogates.
_NOT_IN_IDENTITY = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})


def identity_text_problem(value: str) -> str | None:
    """Why ``value`` cannot be an identifier (a control or bidi character in it), or None.

    Identifiers are joined on, compared and printed: a NUL or a right-to-left override in
    one would make two ids look alike, or reorder what a terminal shows after it.
    """
    if value.isprintable():  # the fast path, in C: no control, format or separator character
        return None
    for i, char in enumerate(value):
        if unicodedata.category(char) in _NOT_IN_IDENTITY:
            name = unicodedata.name(char, "control character")
            return f"contains U+{ord(char):04X} ({name}) at position {i}; identifiers must not carry control or bidi characters"
    return None


def nfc(value: str) -> str:
    """``value`` in Unicode normalization form C: what every identifier is stored and compared as.

    Why: one text can be typed as different code points — ``café`` as ``caf`` + U+00E9, or as
    ``cafe`` + U+0301 (a combining acute accent: macOS file names, some input methods, copied
    text). They look the same and are *canonically equivalent* (Unicode says they are the same
    text), yet compared as strings they were two releases: ``release approve --release-id`` in
    one form and ``trace --release`` in the other matched nothing (exploratory review).
    Why NFC and not refusing combining marks: NFC only ever maps a text to one canonically
    equivalent to it, so no id that already means one thing comes to mean another; and a name
    that needs a combining mark (no precomposed character exists) stays possible. Why not NFKC:
    compatibility folding (``ﬁ`` → ``fi``, full-width → ASCII) changes what a text says, not
    only how it is encoded. Lookalikes across scripts (Cyrillic ``а``) are different text and
    stay different. ASCII is its own NFC: every ASCII id — each Kubernetes name, uid, digest and
    hash id — is unchanged (and ``isascii`` is O(1) in CPython, so their cost is one call)."""
    return value if value.isascii() else unicodedata.normalize("NFC", value)


def refusing(problem: Callable[[str], str | None], fine: Callable[[str], bool] | None = None) -> AfterValidator:
    """A validator that refuses a string ``problem`` finds fault with, with its words (the one
    rule, said once, for the schema and for the checks before a model is built: ``IdText``,
    ``schemas.release.ActorIdText``), and gives the string in NFC (``nfc``: checked after
    normalising, so the rule holds for what is stored). ``fine``: a test, in C, that ``problem``
    would find no fault with the value — ``problem``'s own fast path, taken without calling it:
    every id of every event goes through this (~9 per bench event), and a second Python frame per
    id cost the route stage's decoding ~5 % (``decode_event``, min of 9 runs: 10.3 -> 9.8 us per bench event)."""
    normalize = unicodedata.normalize
    if fine is None:
        def check(value: str) -> str:
            if not value.isascii():
                value = normalize("NFC", value)
            if (why := problem(value)):
                raise ValueError(why)
            return value
    else:
        def check(value: str) -> str:
            if not value.isascii():
                value = normalize("NFC", value)
            if fine(value) or not (why := problem(value)):
                return value
            raise ValueError(why)
    return AfterValidator(check)


#: A string that identifies something (an id, a name, a label, an actor): no control or
#: bidi characters, and in Unicode NFC (``nfc``: two spellings of one text are one id).
#: Free text (reasons, messages, annotations) stays ``str``, escaped on output.
#: (``str.isprintable``: ``identity_text_problem``'s fast path — a printable string has none.)
IdText = Annotated[str, refusing(identity_text_problem, str.isprintable)]

#: Integers bounded to what they are. An unbounded ``int`` let a number past 64 bits through
#: validation as a Python int, and the route stage's JSON decoder (orjson: 64-bit integers)
#: read it back as a float — a 2**70 priority was stored as 1.1805916207174113e+21, silently.
#: The limits, for the checks that must agree with them before a model is built (collectors, the CLI).
INT32_MAX, UINT32_MAX, INT64_MAX = 2**31 - 1, 2**32 - 1, 2**63 - 1
#: Kubernetes' int32 (priorities, counts, indexes)...
Int32 = Annotated[int, Field(ge=-INT32_MAX - 1, le=INT32_MAX)]
NonNegInt32 = Annotated[int, Field(ge=0, le=INT32_MAX)]
#: ...a count stored in a ``UInt32`` column (GPUs requested or reserved)...
Count32 = Annotated[int, Field(ge=0, le=UINT32_MAX)]
#: ...and a 64-bit one: a NUMA node id as the kubelet reports it (int64; -1 is Linux's "no NUMA
#: affinity", which device plugins may pass on), a time-slicing share index, a version of ours.
Int64 = Annotated[int, Field(ge=-INT64_MAX - 1, le=INT64_MAX)]
NonNegInt64 = Annotated[int, Field(ge=0, le=INT64_MAX)]


class Frozen(BaseModel):
    """Base for every contract model: immutable, strict about unknown fields."""

    model_config = ConfigDict(frozen=True, extra="forbid", str_strip_whitespace=True)


def make_event_id(source: str, natural_key: str | tuple[Any, ...], source_version: str | int | None = "") -> str:
    """The one event-id function: hash of source + natural key + source version.

    ``natural_key`` identifies the fact in its source system (e.g. an alert's
    fingerprint + status + startsAt, a pod's uid + transition); ``source_version`` is
    the source's own version of it (a resourceVersion, a delivery id) when that is
    part of the fact's identity. Re-sending the same fact yields the same id.
    Computed on the NFC of the key (``nfc``, as ``IdText`` stores it): producers derive ids
    from what a source sent, before validation, and one fact typed in two canonically
    equivalent spellings must be one id. (The NFC of the joined text is the join of each
    part's NFC: the separators are starters nothing composes with.) ASCII keys, and keys
    already in NFC, keep the ids they always had.
    """
    if isinstance(natural_key, tuple):
        natural_key = "\x1f".join("" if part is None else str(part) for part in natural_key)
    material = nfc("\x1e".join((source, natural_key, "" if source_version is None else str(source_version))))
    return hashlib.sha256(material.encode("utf-8")).hexdigest()[:32]


class Source(Frozen):
    """Which collector produced the event, and where it ran."""

    collector: IdText = Field(description="Collector name, e.g. 'kubernetes', 'podresources', 'alertmanager', 'releases'.")
    host: IdText = Field(default="", description="Host or node the collector ran on.")


class TraceContext(Frozen):
    """W3C trace context, so one span tree covers an event's trip from collector to sink."""

    traceparent: str | None = Field(default=None, description="W3C traceparent header value.")
    tracestate: str | None = Field(default=None, description="W3C tracestate header value.")


class Identity(Frozen):
    """The shared identifiers (DESIGN.md). Every field is optional: each source knows some."""

    release_id: IdText | None = Field(default=None, description="One model release: model + version + artifact + environment plan.")
    model_name: IdText | None = Field(default=None, description="Model name as the registry names it.")
    model_version: IdText | None = Field(default=None, description="Model version as the registry names it.")
    artifact_digest: IdText | None = Field(default=None, description="sha256 of the model artifact (immutable).")
    image_digest: IdText | None = Field(default=None, description="Container image digest, 'sha256:...'.")
    config_digest: IdText | None = Field(default=None, description="Serving/training config hash.")
    dataset_ref: IdText | None = Field(default=None, description="Dataset reference.")
    environment: IdText | None = Field(default=None, description="dev / eval / staging / prod (configurable list).")
    workload_id: IdText | None = Field(default=None, description="One admitted unit of GPU work (Kueue Workload or owning controller).")
    pod_uid: IdText | None = Field(default=None, description="Pod UID.")
    namespace: IdText | None = Field(default=None, description="Kubernetes namespace.")
    pod: IdText | None = Field(default=None, description="Pod name (with namespace: namespace/pod).")
    node: IdText | None = Field(default=None, description="Node name.")
    gpu_id: IdText | None = Field(default=None, description="Device ID as the device plugin reports it (GPU or MIG UUID).")
    owner: IdText | None = Field(default=None, description="Accountable team.")
    data_class: IdText | None = Field(default=None, description="Data classification.")
    alert_fingerprint: IdText | None = Field(default=None, description="Alertmanager fingerprint of one alert series.")

    def merged(self, other: Identity) -> Identity:
        """Fill this block's gaps from ``other``; what is already known wins."""
        mine = self.model_dump(exclude_none=True)
        theirs = other.model_dump(exclude_none=True)
        return Identity(**{**theirs, **mine})


#: How far an event's ``occurred_at`` may be past its ``observed_at`` (``EventBase``): clocks disagree.
MAX_FUTURE_SKEW = timedelta(minutes=15)


def _span(delta: timedelta) -> str:
    """A duration as a person reads it: "36 years", "3 days", "2 h", "20 min"."""
    seconds = int(delta.total_seconds())
    for unit, size in (("years", 365 * 86400), ("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * size or (unit in ("h", "min") and seconds >= size):
            return f"{seconds // size} {unit}"
    return f"{seconds} s"


class EventBase(Frozen):
    """Fields every event carries, whatever its family."""

    event_id: IdText = Field(min_length=8, max_length=64, description="Deterministic id (see make_event_id).")
    event_type: str = Field(description="'<family>.<action>', e.g. 'alert.firing'.")
    schema_version: int = Field(default=SCHEMA_VERSION, ge=1, description="Envelope schema version.")
    occurred_at: UtcDatetime = Field(description="Event time in UTC (when it happened in the source).")
    observed_at: UtcDatetime = Field(description="When the collector observed it, UTC.")
    source: Source = Field(description="Producing collector and host.")
    identity: Identity = Field(default_factory=Identity, description="Shared identifiers known at the source.")
    trace: TraceContext = Field(default_factory=TraceContext, description="W3C trace context.")

    @model_validator(mode="after")
    def _not_after_it_was_observed(self):
        """An event cannot have happened well after it was observed: ``occurred_at`` more than
        ``MAX_FUTURE_SKEW`` past ``observed_at`` is refused (the CLI's ``--at``, the receiver's 422,
        the worker's dead letter — the same rule everywhere, a function of the event alone).

        Why: the controls judge deadlines on event time, their watermark the latest event time
        seen. ``gpuledger release retire --at 2062-12-05…`` (a year mistyped) was accepted; from
        then on every reservation window and grace period read as passed — three control 5
        violations dated weeks ahead for a window not yet open — and the release's state read
        ``retired since 2062`` (an exploratory review). The skew allowed is for clocks that
        disagree (the API server's and the collector's, Prometheus' and the receiver's)."""
        if self.occurred_at - self.observed_at > MAX_FUTURE_SKEW:
            ahead = self.occurred_at - self.observed_at
            raise ValueError(f"occurred_at {self.occurred_at.isoformat()} is {_span(ahead)} after observed_at "
                             f"{self.observed_at.isoformat()}: an event cannot have happened more than "
                             f"{_span(MAX_FUTURE_SKEW)} after it was observed (a mistyped time, or a wrong clock)")
        return self

    def correlation_key(self) -> str:
        """The shared Kafka key: release_id where known, else the workload key."""
        ident = self.identity
        return (
            ident.release_id
            or ident.workload_id
            or (f"{ident.namespace}/{ident.pod}" if ident.namespace and ident.pod else None)
            or ident.alert_fingerprint
            or (f"node:{ident.node}" if ident.node else None)
            or self.event_id
        )
