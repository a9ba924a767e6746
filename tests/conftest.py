"""Shared pytest fixtures: real Kafka and real ClickHouse (see tests/fixtures/)."""

from tests.fixtures.clickhouse import clickhouse_client, clickhouse_db, clickhouse_dsn  # noqa: F401
from tests.fixtures.kafka import catalogue, kafka_bootstrap, settings_for  # noqa: F401
from tests.fixtures.worker import worker_factory  # noqa: F401


def pytest_collection_modifyitems(session, config, items):
    """The real-cluster tier runs last: on a fresh machine .ci/run builds its Go binaries in
    the background while the rest of the suite runs, so the tier waits least there."""
    items.sort(key=lambda item: item.get_closest_marker("real_cluster") is not None)
