"""How often a bound on the state a stage keeps bit, in this process: the health page's
``stats.capped`` (each process's counts; the worker's page sums its children's).

The bounds themselves live where the state is kept (``streams.correlate.entities``:
``MAX_ROWS``/``MAX_STATE_BYTES`` rows per entity, ``MAX_LINKS`` links, ``MAX_ROW_PAYLOAD``
bytes of a row's payload; ``streams.controls.rules``: ``MAX_ROWS`` rows per control key).
What each one cost is counted here, by kind:

- ``rows_detached``: an entity's oldest rows let go past its row or byte bound;
- ``links_detached``: a node/GPU's (or workload's) links let go past ``MAX_LINKS`` — the
  holders whose latest interval started earliest (a link from a detached source that comes
  again is detached again, and counted again);
- ``payloads_truncated``: a row's payload cut to ``MAX_ROW_PAYLOAD`` (the raw event log
  keeps the whole event);
- ``control_rows_dropped``: a control key's oldest rows let go past its bound.

A bound that bites is not an error — the state stays within what a changelog record can
carry — but it is where exactness ends (docs/architecture.md, Bounds), so it must be seen:
the first time a kind bites in a process its entity is logged (WARNING), and from then on
it is only counted (calm logging: a busy GPU past its link cap detaches at every new holder).
Since the process started: a restart starts from 0, and a re-processed batch counts again.
"""

from __future__ import annotations

import logging
from collections import Counter

log = logging.getLogger(__name__)

CAPPED: Counter = Counter()


def capped(kind: str, n: int, key: str, what: str) -> None:
    """Count ``n`` of ``kind`` (at ``key``: the entity or control key); log the first one."""
    if not n:
        return
    if kind not in CAPPED:
        log.warning("%s: %s — the first in this process; counted from now on in the health page's stats.capped.%s",
                    key, what, kind)
    CAPPED[kind] += n


def counts() -> dict[str, int]:
    """What the health page shows (``stats.capped``): every kind, 0 when it never bit."""
    return {kind: CAPPED.get(kind, 0) for kind in ("rows_detached", "links_detached", "payloads_truncated", "control_rows_dropped",
                                                     "control_fingerprints_detached")}
