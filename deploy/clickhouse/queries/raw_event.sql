-- The raw envelope(s) behind a correlated row or a violation's evidence: event id in,
-- what the collector sent and where it sits in Kafka out.
-- clickhouse-client --param_db=gpuledger --param_event_id=0123abcd... --queries-file raw_event.sql
SELECT
    event_id, event_type, occurred_at, observed_at, source_collector, source_host,
    release_id, workload_id, namespace, pod, node, gpu_id, alert_fingerprint,
    kafka_topic, kafka_partition, kafka_offset, payload_json
FROM {db:Identifier}.raw_events FINAL
WHERE event_id = {event_id:String}
ORDER BY occurred_at
