-- Alerts in a time window that concern a release or fired on some nodes: the other
-- alerts a responder should look at next to the one that paged.
-- clickhouse-client --param_db=gpuledger --param_release=fraud-scorer-v7-prod --param_nodes="['node-a','node-b']" \
--   --param_from='2026-11-30 12:00:00' --param_to='2026-11-30 14:00:00' --queries-file alerts_in_window.sql
SELECT
    occurred_at, alert_fingerprint, alertname, severity, event_type, release_id, workload_id, namespace, pod, node, gpu_id,
    attribution, release_state, correlation_id
FROM {db:Identifier}.enriched_alerts FINAL
WHERE occurred_at BETWEEN {from:DateTime64(3, 'UTC')} AND {to:DateTime64(3, 'UTC')}
  AND (release_id = {release:String} OR node IN {nodes:Array(String)})
ORDER BY occurred_at, correlation_id
