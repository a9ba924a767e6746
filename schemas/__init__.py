"""gpuledger's shared contract: event envelope, event families, topic catalogue.

Every collector, stream processor and sink imports its types from here and nowhere
else. The pydantic v2 models are the single source of truth; the JSON Schema files
under ``schemas/json/`` are generated from them (``gpuledger schemas generate``).
"""

from schemas.envelope import (
    SCHEMA_VERSION,
    EventBase,
    Identity,
    Source,
    TraceContext,
    make_event_id,
)
from schemas.events import (
    AnyEvent,
    AlertEvent,
    CorrelatedEvent,
    DeadLetter,
    GpuAllocation,
    GpuEvent,
    ReleaseEvent,
    SchedulerEvent,
    Violation,
    decode_event,
    encode_event,
    EventDecodeError,
)

__all__ = [
    "SCHEMA_VERSION",
    "AlertEvent",
    "AnyEvent",
    "CorrelatedEvent",
    "DeadLetter",
    "EventBase",
    "EventDecodeError",
    "GpuAllocation",
    "GpuEvent",
    "Identity",
    "ReleaseEvent",
    "SchedulerEvent",
    "Source",
    "TraceContext",
    "Violation",
    "decode_event",
    "encode_event",
    "make_event_id",
]
