-- One alert series (fingerprint) with its attribution: release, workload, pod, node, GPU,
-- and release_state: the release's latest event of any kind as of the alert's event (docs/schemas.md:
-- a reservation or an evaluation counts; for its lifecycle state — promoted, rolled back — read
-- release_history, or `gpuledger trace --alert`). Latest version of every row.
-- clickhouse-client --param_db=gpuledger --param_fp=7d1f2a9c3b4e5f60 --param_at='\N' --queries-file alert.sql
--   at: a time ('2026-11-30 13:10:00') to see the state as of then, or \N for now.
SELECT
    occurred_at, event_type, alertname, severity, starts_at, ends_at, attribution,
    release_id, release_state, model_name, model_version, owner, environment,
    workload_id, namespace, pod, node, gpu_id, labels, annotations, correlation_id
FROM {db:Identifier}.enriched_alerts FINAL
WHERE alert_fingerprint = {fp:String}
  AND ({at:Nullable(DateTime64(3, 'UTC'))} IS NULL OR occurred_at <= {at:Nullable(DateTime64(3, 'UTC'))})
ORDER BY occurred_at, correlation_id
