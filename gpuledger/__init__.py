"""gpuledger: the thin front package (CLI, root settings, telemetry, local Kafka)."""

__version__ = "0.1.0"
