"""The read side of the store: everything that answers a person's question from ClickHouse.

- ``query``  — read-only readers (direct, or through the worker that owns an embedded
  store) and the read-only enforcement every reader query goes through.
- ``trace``  — the responder's chain from any identifier (``gpuledger trace``).
- ``audit``  — the controls' evidence over a time range (``gpuledger audit``).
- ``report`` — the incident timeline and the audit as self-contained HTML (templates/).

Nothing here writes to the store.
"""
