"""How every stream agent runs its batches: handled completely, or not acked at all.

Faust's ``take_events`` acks a batch's events when the agent's body leaves the batch —
also when the body raised or was cancelled. So a batch must never leave the body
half done:

- ``handle(events)`` processes a whole batch (outputs produced and acknowledged, state
  written) or raises;
- when it raises, the agent's in-memory state for the batch is reset (``reset``: the
  durable state is the truth) and the batch is handled again record by record; a
  record that fails alone is dead-lettered with the error (``dead``) and the rest go
  on — so one bad record costs a dead letter, never the batch;
- when the worker stops mid-batch (cancellation), the batch is given ``STOP_GRACE_S``
  to finish; if it cannot (Kafka unreachable), the process exits at once without
  acking — a hard exit is as safe as a crash by design, and it is what keeps the
  un-flushed batch's offsets from being committed on the way out.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

BATCH = 2000
WITHIN_S = 0.1
STOP_GRACE_S = 5.0
HARD_EXIT = 75  # EX_TEMPFAIL: stopped with a batch unfinished; restart re-processes it


async def run_batches(stream, name: str, handle: Callable[[list], Awaitable[None]], reset: Callable[[list], Awaitable[None]],
                      dead: Callable[[object, BaseException], Awaitable[None]], batch: int = BATCH, within: float = WITHIN_S) -> None:
    async for events in stream.take_events(batch, within=within):
        task = asyncio.ensure_future(_handle(name, events, handle, reset, dead))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            try:
                await asyncio.wait_for(task, STOP_GRACE_S)
            except BaseException:  # noqa: BLE001 - any way the batch did not finish
                log.critical("%s: stopping with a batch of %d unfinished; exiting without acking it", name, len(events))
                os._exit(HARD_EXIT)
            raise


async def _handle(name: str, events: list, handle, reset, dead) -> None:
    try:
        await handle(events)
        return
    except Exception:  # noqa: BLE001 - retried record by record below
        log.exception("%s: a batch of %d failed; handling it record by record", name, len(events))
    await reset(events)
    for event in events:
        try:
            await handle([event])
        except Exception as exc:  # noqa: BLE001 - the record is dead-lettered with the error
            log.exception("%s: record %s[%d]@%d failed on its own; dead-lettering it", name, event.message.topic,
                          event.message.partition, event.message.offset)
            await reset([event])
            await dead(event, exc)
