"""Alert family: quality and infrastructure alerts from Alertmanager."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from schemas.envelope import EventBase, Frozen, IdText, UtcDatetime

AlertEventType = Literal["alert.firing", "alert.resolved"]


class AlertPayload(Frozen):
    """One alert as Alertmanager reports it (webhook v4)."""

    alertname: IdText = Field(description="The alertname label.")
    severity: IdText | None = Field(default=None, description="The severity label.")
    labels: dict[IdText, IdText] = Field(default_factory=dict, description="All alert labels.")
    annotations: dict[str, str] = Field(default_factory=dict, description="All alert annotations.")
    starts_at: UtcDatetime = Field(description="startsAt: when the alert started firing.")
    ends_at: UtcDatetime | None = Field(default=None, description="endsAt, when resolved (Alertmanager's zero time maps to null).")
    generator_url: str | None = Field(default=None, description="generatorURL back to the rule.")
    receiver: str | None = Field(default=None, description="Alertmanager receiver name.")
    group_key: str | None = Field(default=None, description="Alertmanager groupKey.")


class AlertEvent(EventBase):
    """One alert state change (firing / resolved)."""

    event_type: AlertEventType
    payload: AlertPayload

    @model_validator(mode="after")
    def _required_identity(self):
        ident = self.identity
        if not (ident.alert_fingerprint):
            raise ValueError("identity.alert_fingerprint is required for alert events")
        return self
