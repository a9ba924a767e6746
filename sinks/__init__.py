"""Sinks: write correlated history into ClickHouse (embedded chDB or a server)."""
