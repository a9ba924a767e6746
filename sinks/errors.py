"""Errors of the sinks package, split retriable vs fatal."""


class SinkError(RuntimeError):
    """Base error of the sinks package."""

    retriable = False


class StoreUnavailable(SinkError):
    """ClickHouse did not answer or answered with a server error; try again later."""

    retriable = True


class StoreLocked(SinkError):
    """The embedded chDB directory is owned by another process."""
