"""The union of raw events and the one codec for Kafka values.

Input: bytes from Kafka / HTTP bodies. Output: typed, frozen events.
Decoding failures raise ``EventDecodeError`` carrying a short ``reason`` (for the
dead-letter record and metrics) and a message that names the offending field.
"""

from __future__ import annotations

from typing import Annotated, Union, get_args

import orjson
from pydantic import Field, TypeAdapter, ValidationError

from schemas.admission import AdmissionEvent
from schemas.alert import AlertEvent
from schemas.envelope import SCHEMA_VERSION
from schemas.gpu import GpuEvent
from schemas.outputs import CorrelatedEvent, DeadLetter, GpuAllocation, Violation
from schemas.release import ReleaseEvent
from schemas.scheduler import SchedulerEvent

AnyEvent = Annotated[
    Union[SchedulerEvent, GpuEvent, ReleaseEvent, AlertEvent, AdmissionEvent],
    Field(discriminator="event_type"),
]

_ANY_EVENT = TypeAdapter(AnyEvent)

#: Every raw event type, family-qualified ('alert.firing', ...).
EVENT_TYPES: frozenset[str] = frozenset(
    t for model in (SchedulerEvent, GpuEvent, ReleaseEvent, AlertEvent, AdmissionEvent)
    for t in get_args(model.model_fields["event_type"].annotation)
)


class EventDecodeError(ValueError):
    """A record that is not a valid gpuledger event; ``reason`` is machine-readable."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _describe(exc: ValidationError, skip_tag: bool = False) -> str:
    parts = []
    for err in exc.errors(include_url=False):
        loc_parts = err["loc"][1:] if skip_tag and err["loc"] and err["loc"][0] in EVENT_TYPES else err["loc"]
        loc = ".".join(str(p) for p in loc_parts) or "<root>"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


def unsupported_schema_version(seen) -> EventDecodeError:
    """The error for an envelope written by a newer gpuledger (reason ``unsupported_schema_version``).

    The message carries the version seen in a fixed form (``[schema_version=99 supported=1]``),
    so a dead letter says which gpuledger can read it.
    """
    return EventDecodeError(
        "unsupported_schema_version",
        f"schema_version: {seen!r} is newer than this gpuledger reads (up to {SCHEMA_VERSION}); upgrade gpuledger and "
        f"replay the dead letter [schema_version={seen} supported={SCHEMA_VERSION}]")


def _check_schema_version(obj: dict) -> None:
    seen = obj.get("schema_version")
    if isinstance(seen, int) and not isinstance(seen, bool) and seen > SCHEMA_VERSION:
        raise unsupported_schema_version(seen)


def decode_event(data: bytes | str | dict):
    """Parse one raw event (JSON bytes or a dict) into its family model.

    An envelope from the future (``schema_version`` above ``SCHEMA_VERSION``) is never read
    as the current version: it raises ``EventDecodeError`` with reason
    ``unsupported_schema_version`` (the worker dead-letters it, the receiver refuses it).
    """
    if isinstance(data, (bytes, bytearray, str)):
        try:
            event = _ANY_EVENT.validate_json(data)  # the fast path: one pass in pydantic-core
        except ValidationError:
            pass  # say exactly what is wrong, below
        else:
            if event.schema_version > SCHEMA_VERSION:
                raise unsupported_schema_version(event.schema_version)
            return event
    if isinstance(data, (bytes, bytearray, memoryview, str)):
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise EventDecodeError("not_json", f"value is not JSON: {exc}") from exc
    else:
        obj = data
    if not isinstance(obj, dict):
        raise EventDecodeError("not_object", f"value must be a JSON object, got {type(obj).__name__}")
    _check_schema_version(obj)
    if "event_type" not in obj:
        raise EventDecodeError("validation", "event_type: Field required")
    if obj["event_type"] not in EVENT_TYPES:
        raise EventDecodeError("unknown_event_type", f"event_type: unknown event type {obj['event_type']!r}")
    try:
        return _ANY_EVENT.validate_python(obj)
    except ValidationError as exc:
        # Drop the union tag pydantic puts first in every location ("alert.firing.x").
        raise EventDecodeError("validation", _describe(exc, skip_tag=True)) from exc


def encode_event(event) -> bytes:
    """Serialise any contract model to compact JSON bytes (the Kafka value)."""
    return event.model_dump_json(exclude_none=False).encode("utf-8")


__all__ = [
    "EVENT_TYPES",
    "AnyEvent",
    "AlertEvent",
    "CorrelatedEvent",
    "DeadLetter",
    "EventDecodeError",
    "GpuAllocation",
    "GpuEvent",
    "ReleaseEvent",
    "SchedulerEvent",
    "Violation",
    "decode_event",
    "encode_event",
]
