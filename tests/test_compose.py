"""compose.yaml cannot run here (no Docker engine); check it is coherent with the code."""

from pathlib import Path

import yaml

from gpuledger.settings import ClickHouseSettings, KafkaSettings, Settings, TelemetrySettings
from gpuledger.cli import app

ROOT = Path(__file__).resolve().parent.parent


def test_compose_names_the_services_and_the_env_the_code_reads():
    doc = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = doc["services"]
    assert {"kafka", "clickhouse", "worker", "topics", "migrate"} <= set(services)
    assert services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"
    known = {f"GPULEDGER_KAFKA_{f.upper()}" for f in KafkaSettings.model_fields}
    known |= {f"GPULEDGER_CLICKHOUSE_{f.upper()}" for f in ClickHouseSettings.model_fields}
    known |= {f"GPULEDGER_OTEL_{f.upper()}" for f in TelemetrySettings.model_fields}
    known |= {f"GPULEDGER_{f.upper()}" for f in Settings.model_fields}
    commands = {c.name for c in app.registered_commands} | {g.name for g in app.registered_groups}
    for name, svc in services.items():
        for var in (svc.get("environment") or {}):
            if var.startswith("GPULEDGER_"):
                assert var in known, f"{name}: {var} is not a setting the code reads"
        cmd = svc.get("command")
        if cmd and cmd[0] == "gpuledger":
            assert cmd[1] in commands, f"{name}: `gpuledger {cmd[1]}` does not exist"
    env = services["worker"]["environment"]
    assert env["GPULEDGER_KAFKA_BOOTSTRAP"] == "kafka:9092"
    assert env["GPULEDGER_CLICKHOUSE_DSN"].startswith("http://") and "@clickhouse:8123" in env["GPULEDGER_CLICKHOUSE_DSN"]


def test_compose_runs_the_exercise_and_provisions_grafana():
    from gpuledger.sim.scenario import load_scenario

    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    cmd = services["exercise"]["command"]
    assert cmd[:2] == ["gpuledger", "exercise"]
    load_scenario(cmd[2])  # a shipped scenario
    assert services["exercise"]["environment"]["GPULEDGER_CLICKHOUSE_DSN"].startswith("http://")
    grafana = services["grafana"]
    for volume in grafana["volumes"]:
        assert (ROOT / volume.split(":")[0]).is_dir(), volume
    assert grafana["depends_on"] == {"clickhouse": {"condition": "service_healthy"}}
