"""The producers' errors: one base, split retriable vs fatal; only the CLI turns them into exits.

``ProducerError.retriable`` says whether the same call may succeed later (Kafka down, a
state dir briefly full) or will fail the same way (bad input, bad configuration).
Component-specific errors subclass these next to their component
(``producers.kubernetes.collector.KubeConfigError``, ``producers.podresources.collector.KubeletUnavailable``,
``producers.receiver.mlflow.SignatureError``, ``producers.releases.ReleaseInputError``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from producers._limits import Oversize, RecordLimit


class ProducerError(RuntimeError):
    """Base error of the producers package."""

    retriable = False


class PublishError(ProducerError):
    """Some records of a batch were not acknowledged by Kafka (broker down, timeout)."""

    retriable = True


class KafkaNotConfigured(ProducerError):
    """No bootstrap servers given and no local broker running."""


class StateFileError(ProducerError):
    """A collector's state file cannot be read or written (full disk, permissions)."""

    retriable = True


class EventTooLarge(ProducerError):
    """An event too large to travel: encoded over ``max_event_bytes``, or refused by Kafka for its size.

    Not retriable as is (the same bytes are refused again). ``oversize`` lists every
    offender of the batch; ``event_id``, ``event_type``, ``size_bytes`` and ``index``
    describe the first, ``limit_bytes`` is the limit it broke.
    """

    retriable = False

    def __init__(self, oversize: Sequence[Oversize], limit: RecordLimit, refused_by_kafka: str | None = None) -> None:
        self.oversize = list(oversize)
        first = self.oversize[0]
        self.index, self.event_id, self.event_type, self.size_bytes = first.index, first.event_id, first.event_type, first.size_bytes
        self.record_limit = limit
        if refused_by_kafka:
            self.limit_bytes = limit.bytes
            text = (f"Kafka refused {first.event_type} event {first.event_id} ({first.size_bytes} bytes encoded) as too large: "
                    f"{refused_by_kafka} (hint: the topic's max.message.bytes is lower than the {limit.bytes} bytes read from "
                    f"{limit.source}; it is read again for the next batch)")
        else:
            self.limit_bytes = limit.max_event_bytes
            text = (f"{first.event_type} event {first.event_id} is {first.size_bytes} bytes encoded, over the "
                    f"{self.limit_bytes}-byte limit for one event (a quarter of {limit.source}, {limit.bytes} bytes, "
                    f"at most 256 KiB: downstream re-encodes events into bigger records)")
        if len(self.oversize) > 1:
            text += f"; {len(self.oversize) - 1} more event(s) of the batch too"
        super().__init__(text)


class PayloadError(ProducerError):
    """Input rejected at the edge (HTTP body, webhook payload); never retriable as is.

    ``field`` names the offending field (``alerts[2].startsAt``), ``reason`` is a short
    machine-readable code for metrics, ``status`` the HTTP status the receiver answers,
    ``details`` extra members of the JSON answer (``limit_bytes``, ``size_bytes``).
    """

    def __init__(self, message: str, field: str | None = None, reason: str = "validation", status: int = 422,
                 details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.reason = reason
        self.status = status
        self.details = details or {}
