"""Settings: env prefixes, and every problem reported at once before any I/O."""

import pytest

from gpuledger.settings import Settings, SettingsError


def test_env_vars_are_read_per_area(monkeypatch, tmp_path):
    monkeypatch.setenv("GPULEDGER_KAFKA_BOOTSTRAP", "10.0.0.1:9092")
    monkeypatch.setenv("GPULEDGER_CLICKHOUSE_DSN", "http://u:p@ch:8123/db")
    monkeypatch.setenv("GPULEDGER_DATA_DIR", str(tmp_path))
    s = Settings.load()
    assert s.kafka.bootstrap == "10.0.0.1:9092"
    assert s.clickhouse_dsn == "http://u:p@ch:8123/db"
    assert s.data_dir == tmp_path


def test_default_store_is_embedded_under_the_data_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("GPULEDGER_CLICKHOUSE_DSN", raising=False)
    monkeypatch.setenv("GPULEDGER_DATA_DIR", str(tmp_path))
    assert Settings.load().clickhouse_dsn == f"chdb://{tmp_path / 'clickhouse'}"


def test_flags_override_env(monkeypatch):
    monkeypatch.setenv("GPULEDGER_KAFKA_BOOTSTRAP", "a:1")
    assert Settings.load(kafka={"bootstrap": "b:2"}).kafka.bootstrap == "b:2"


def test_all_problems_listed_at_once(monkeypatch):
    monkeypatch.setenv("GPULEDGER_CLICKHOUSE_DSN", "mysql://x")
    monkeypatch.setenv("GPULEDGER_OTEL_EXPORTER", "zipkin")
    monkeypatch.setenv("GPULEDGER_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    with pytest.raises(SettingsError) as info:
        Settings.load()
    text = str(info.value)
    assert "GPULEDGER_CLICKHOUSE_DSN" in text and "chdb://" in text
    assert "GPULEDGER_OTEL_EXPORTER" in text
    assert "sasl_mechanism" in text


def test_unknown_gpuledger_variables_stop_start_up_with_the_valid_ones(monkeypatch):
    monkeypatch.setenv("GPULEDGER_KAFKA_BOOTSTAP", "10.0.0.1:9092")
    monkeypatch.setenv("GPULEDGER_TEST_SOMETHING", "1")  # the test suite's own switches are not settings
    with pytest.raises(SettingsError) as info:
        Settings.load()
    text = str(info.value)
    assert "GPULEDGER_KAFKA_BOOTSTAP: not a setting (did you mean GPULEDGER_KAFKA_BOOTSTRAP?)" in text
    assert "GPULEDGER_TEST_SOMETHING" not in text
    for valid in ("GPULEDGER_KAFKA_BOOTSTRAP", "GPULEDGER_RECEIVER_ALERT_LABELS__NODE", "GPULEDGER_SCHEDULER_NAMESPACE",
                  "GPULEDGER_PODRESOURCES_NODE", "GPULEDGER_POLICY_FILE", "GPULEDGER_OTEL_EXPORTER", "GPULEDGER_DATA_DIR"):
        assert valid in text


def test_one_root_holds_every_component_section(monkeypatch, tmp_path):
    monkeypatch.setenv("GPULEDGER_SCHEDULER_NAMESPACE", "ml")
    monkeypatch.setenv("GPULEDGER_PODRESOURCES_NODE", "gpu-node-1")
    monkeypatch.setenv("GPULEDGER_RECEIVER_PORT", "9999")
    monkeypatch.setenv("GPULEDGER_POLICY_FILE", str(tmp_path / "policy.yaml"))
    s = Settings.load(collectors={"scheduler": {"page_size": 7}})
    assert s.collectors.scheduler.namespace == "ml" and s.collectors.scheduler.page_size == 7
    assert s.collectors.podresources.node == "gpu-node-1" and s.receiver.port == 9999
    assert s.policy.file == tmp_path / "policy.yaml"
    monkeypatch.delenv("GPULEDGER_PODRESOURCES_NODE")
    assert Settings.load().collectors.podresources.node is None  # only required to run that collector
    with pytest.raises(SettingsError, match="GPULEDGER_PODRESOURCES_NODE: Field required"):
        Settings.load(run="collectors.podresources")


def test_the_cli_prints_a_settings_error_one_problem_per_line(tmp_path):
    """The CLI's error line escaped the message's own line breaks: 'invalid settings:\\x0a  ...'."""
    from typer.testing import CliRunner

    from gpuledger.cli import app as cli_app

    out = CliRunner().invoke(cli_app, ["sql", "SELECT 1"], env={"GPULEDGER_CLICKHOUSE_DNS": "x\x1b[31m", "GPULEDGER_DATA_DIR": str(tmp_path)})
    assert out.exit_code == 2, out.output
    lines = out.output.splitlines()
    assert lines[0] == "error: invalid settings:", lines[:3]
    assert any(line.strip().startswith("GPULEDGER_CLICKHOUSE_DNS: not a setting") for line in lines[1:]), lines[:3]
    assert "\\x0a" not in out.output and "\x1b" not in out.output  # line breaks kept, other control characters still escaped
