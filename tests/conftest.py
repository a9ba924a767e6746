"""Shared pytest fixtures: real Kafka and real ClickHouse (see tests/fixtures/)."""

from tests.fixtures.clickhouse import clickhouse_client, clickhouse_db, clickhouse_dsn  # noqa: F401
from tests.fixtures.kafka import catalogue, kafka_bootstrap, settings_for  # noqa: F401
from tests.fixtures.worker import worker_factory  # noqa: F401
