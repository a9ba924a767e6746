"""The worker's Kafka transport: Faust's aiokafka transport with a short fetch wait.

Why: Faust builds its worker consumer with ``fetch_max_wait_ms=1500``, a constant (not a
setting). aiokafka keeps one fetch request in flight per broker, and a request names only
the partitions that had no buffered records when it was sent; a record arriving on another
partition meanwhile waits until that request returns — up to 1.5 s when the named partitions
stay quiet. The internal hops (route → correlation, controls) carry a few packed records a
second per partition, so live input waited there most of the time: ``make bench``'s
correlate hop measured p50 1.6-2.1 s / p99 3.3-3.7 s at 2,500 events/s, and 0.48 s / 1.15 s
with a 100 ms wait (same run settings). Bulk throughput does not change: a fetch returns as
soon as any named partition has data.

Faust's documented extension point for a transport is the ``faust.transports`` entry point
(pyproject.toml: ``gpuledger = "streams.transport:Transport"``), chosen by the broker URL's
scheme (``gpuledger://host:port``). The only change is the fetch wait: aiokafka reads it
from the consumer when the consumer starts (its ``Fetcher``), after Faust constructed it.
"""

from __future__ import annotations

import asyncio
import logging

from faust.transport.drivers import aiokafka as faust_aiokafka

#: Faust's own lifecycle lines ("[^--Consumer]: Starting...") under Faust's loggers, as they
#: were before this subclass: a library's INFO (gpuledger.telemetry.OWN_LOGGERS). A logger of
#: its own below Faust's: mode replaces a class's logger that mode itself made (``__modex__``).
_FAUST_LOG = logging.getLogger(f"{faust_aiokafka.__name__}.gpuledger")

#: Milliseconds a broker may hold a fetch of the worker's consumer without data.
FETCH_MAX_WAIT_MS = 100


class ConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
    logger = _FAUST_LOG

    async def on_thread_stop(self) -> None:
        """Faust's stop of the consumer, without the traceback a stop during a broker outage
        printed ("Exception in thread ... CancelledError"): aiokafka's ``Fetcher.close`` cancels
        its pending fetch requests and awaits each without suppressing the cancellation it
        caused — one sleeping on its retry back-off (the broker away) raises it out of
        ``AIOKafkaConsumer.stop``. The fetcher is closed by then; what the consumer's stop had
        left (its client's connections, to a broker that is away) ends with the process."""
        try:
            await super().on_thread_stop()
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # this stop itself is cancelled: let it be
                raise
            self.log.info("consumer stopped while Kafka was unreachable (its last fetch was cancelled)")

    def _create_worker_consumer(self, transport):
        consumer = super()._create_worker_consumer(transport)
        consumer._fetch_max_wait_ms = FETCH_MAX_WAIT_MS  # aiokafka passes it to its Fetcher in start()
        return consumer


class Consumer(faust_aiokafka.Consumer):
    logger = _FAUST_LOG

    def _new_consumer_thread(self) -> ConsumerThread:
        return ConsumerThread(self, loop=self.loop, beacon=self.beacon)


class Transport(faust_aiokafka.Transport):
    Consumer = Consumer
