"""How big one event may be at the edge, and how free text is cut to fit: pure, no I/O.

Input: the largest record the raw topics take (``max.message.bytes``, learned by
``EventPublisher``), free-text values of source objects (alert annotations, Kubernetes
condition and Event messages).
Output: ``max_event_bytes_for`` — the one per-event limit every producer enforces
(``RecordLimit.max_event_bytes``; ``Oversize`` names an event over it);
``truncate_text`` / ``TextTrimmer`` — free text cut to a per-field cap with a visible
marker, remembering what was cut so callers can count and report it.
Guarantees: a cut value is at most its cap in UTF-8 bytes, marker included, never splits
a character, and says how many bytes went (``…[truncated 12345 bytes]``). Identity-carrying
values (labels, ids) are never cut here: changing them would change what the event is
about, so callers refuse them instead (``IDENTITY_TEXT_BYTES``).
Limits: the caps are constants, not settings; an event whose free text is all within its
caps can still be over ``max_event_bytes`` (many fields, huge label sets), and is then
refused (receiver, 422) or dead-lettered (collectors) by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

#: Kafka's default ``message.max.bytes`` (broker) / ``max.message.bytes`` (topic), used
#: when neither can be read (no DescribeConfigs right).
DEFAULT_RECORD_LIMIT = 1_048_588

#: Upper bound of one encoded event, whatever the topics allow.
MAX_EVENT_BYTES_CAP = 256 * 1024

#: Per-field cap of free text (annotation values, generatorURL, event messages).
FREE_TEXT_BYTES = 8 * 1024

#: Per-value cap of identity-carrying text (alert labels, fingerprints); over it → refused.
IDENTITY_TEXT_BYTES = 4 * 1024

TRUNCATION_MARKER = "…[truncated {n} bytes]"


class Oversize(NamedTuple):
    """One event of a batch that cannot travel: its place in the batch, what it is, its size."""

    index: int
    event_id: str
    event_type: str
    size_bytes: int


@dataclass(frozen=True)
class RecordLimit:
    """The largest record Kafka takes on the raw topics, and where that number came from."""

    bytes: int
    source: str
    #: False when some raw topic's config could not be read (a fallback, read again later).
    confirmed: bool = True

    @property
    def max_event_bytes(self) -> int:
        return max_event_bytes_for(self.bytes)


def max_event_bytes_for(record_limit: int) -> int:
    """The largest encoded event the edge accepts when the raw topics take ``record_limit``.

    A raw event does not travel alone for long: the stream worker re-encodes it into
    bigger records — a ``CorrelatedEvent`` carries the payload again as an escaped JSON
    string (``payload_json``; escaping alone can double quote-heavy text) next to the
    resolved identity and the release manifest (a few KB) — roughly 2x plus a few KB,
    and it batches outputs and table changelog entries that pack several events. A
    quarter of the record limit leaves that 2x growth a further 2x of headroom. The
    256 KiB cap holds even where a topic allows far larger records: downstream producers
    keep librdkafka's own 1,000,000-byte ``message.max.bytes``, below the broker's
    1,048,588 (raw records between the two were accepted, then refused downstream), and
    no real scheduling or lifecycle event comes near it (a typical one is under 4 KB).
    """
    return max(1, min(record_limit // 4, MAX_EVENT_BYTES_CAP))


def truncate_text(value: str, cap_bytes: int = FREE_TEXT_BYTES) -> tuple[str, int]:
    """``value`` cut to at most ``cap_bytes`` UTF-8 bytes (marker included); (text, bytes cut).

    Unchanged (and 0) when it already fits.
    """
    raw = value.encode("utf-8")
    if len(raw) <= cap_bytes:
        return value, 0
    # The marker's own length depends on the count; the original length bounds its digits.
    room = max(0, cap_bytes - len(TRUNCATION_MARKER.format(n=len(raw)).encode("utf-8")))
    head = raw[:room].decode("utf-8", "ignore")
    cut = len(raw) - len(head.encode("utf-8"))
    return head + TRUNCATION_MARKER.format(n=cut), cut


@dataclass
class TextTrimmer:
    """Cuts free-text values to ``cap_bytes`` and remembers what it cut (field → bytes)."""

    cap_bytes: int = FREE_TEXT_BYTES
    cut: dict[str, int] = field(default_factory=dict)

    def __call__(self, where: str, value: str | None) -> str | None:
        if value is None:
            return None
        text, removed = truncate_text(value, self.cap_bytes)
        if removed:
            self.cut[where] = removed
        return text

    def mapping(self, where: str, values: dict[str, str]) -> dict[str, str]:
        """Every value of a string map trimmed (``where.key`` names each field)."""
        return {key: self(f"{where}.{key}", value) for key, value in values.items()}
