"""The worker's Kafka transport (streams/transport.py): Faust's aiokafka consumer with a
100 ms fetch wait instead of Faust's fixed 1.5 s — what live records on the internal hops
waited for (make bench's correlate hop: p50 1.6-2.1 s before, 0.5 s after)."""

from __future__ import annotations

import asyncio

from gpuledger.settings import Settings
from streams.app import create_app
from streams.transport import FETCH_MAX_WAIT_MS, Transport


def test_the_worker_consumes_through_its_transport_with_a_short_fetch_wait(kafka_bootstrap, monkeypatch, tmp_path):
    monkeypatch.setenv("GPULEDGER_KAFKA_BOOTSTRAP", kafka_bootstrap)
    monkeypatch.setenv("GPULEDGER_DATA_DIR", str(tmp_path))

    async def build():
        app = create_app(Settings())
        return app, app.consumer._thread._create_worker_consumer(app.transport)

    app, kafka_consumer = asyncio.run(build())
    assert type(app.transport) is Transport and str(app.conf.broker[0]).startswith("gpuledger://")
    assert kafka_consumer._fetch_max_wait_ms == FETCH_MAX_WAIT_MS == 100
    # everything else as Faust builds it (its group, its bootstrap)
    assert kafka_consumer._group_id == app.conf.id and kafka_consumer._client._bootstrap_servers == [kafka_bootstrap]


def test_the_correlation_agent_takes_its_batches_at_the_configured_cadence(kafka_bootstrap, monkeypatch, tmp_path):
    """The correlation agent's batches start at most every ``streams.correlate_within_s``
    (default 0.25 s; streams.runner.run_batches' ``cadence``), not after a fixed wait."""
    from streams.correlate import agents
    from streams.runner import WITHIN_S

    monkeypatch.setenv("GPULEDGER_KAFKA_BOOTSTRAP", kafka_bootstrap)
    monkeypatch.setenv("GPULEDGER_DATA_DIR", str(tmp_path))
    taken: list[tuple] = []

    async def run_batches(stream, epoch, batch, cadence):
        taken.append((stream, epoch.name, batch, cadence))

    monkeypatch.setattr(agents, "run_batches", run_batches)

    async def drive(settings):
        app = create_app(settings)
        app.gpuledger.directory.ready.set()
        [agent] = [a for name, a in app.agents.items() if name.endswith("correlate_entities")]
        await agent.fun("the stream")

    asyncio.run(drive(Settings()))
    monkeypatch.setenv("GPULEDGER_STREAMS_CORRELATE_WITHIN_S", "0.05")
    asyncio.run(drive(Settings()))
    assert Settings().streams.correlate_within_s == 0.05 and WITHIN_S == 0.1
    assert taken == [("the stream", "correlate_entities", Settings().streams.packed_batch_messages // Settings().streams.pack_max, 0.25),
                     ("the stream", "correlate_entities", 50, 0.05)]
