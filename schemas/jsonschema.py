"""Generate the JSON Schema files under schemas/json/ from the pydantic models."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import TypeAdapter

from schemas.admission import AdmissionEvent
from schemas.alert import AlertEvent
from schemas.events import AnyEvent
from schemas.gpu import GpuEvent
from schemas.outputs import CorrelatedEvent, DeadLetter, GpuAllocation, Violation
from schemas.release import ReleaseEvent
from schemas.scheduler import SchedulerEvent

JSON_DIR = Path(__file__).parent / "json"

MODELS = {
    "scheduler_event": SchedulerEvent,
    "gpu_event": GpuEvent,
    "release_event": ReleaseEvent,
    "alert_event": AlertEvent,
    "admission_event": AdmissionEvent,
    "correlated_event": CorrelatedEvent,
    "gpu_allocation": GpuAllocation,
    "violation": Violation,
    "dead_letter": DeadLetter,
}


def render_all() -> dict[str, str]:
    out = {name: model.model_json_schema() for name, model in MODELS.items()}
    out["any_event"] = TypeAdapter(AnyEvent).json_schema()
    return {f"{name}.schema.json": json.dumps(schema, indent=2, sort_keys=True) + "\n" for name, schema in out.items()}


def write_all(check: bool = False) -> list[str]:
    """Write (or with check=True only compare) the files; return those that differ."""
    JSON_DIR.mkdir(exist_ok=True)
    changed = []
    for name, text in render_all().items():
        path = JSON_DIR / name
        if not path.exists() or path.read_text() != text:
            changed.append(name)
            if not check:
                path.write_text(text)
    return changed
