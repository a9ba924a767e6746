-- Preemptions, evictions, requeues and failed scheduling on some nodes in a time window,
-- whichever workload they hit (what else happened where the incident happened).
-- clickhouse-client --param_db=gpuledger --param_nodes="['node-a','node-b']" \
--   --param_from='2026-11-30 12:00:00' --param_to='2026-11-30 14:00:00' --queries-file node_scheduler_events.sql
SELECT
    occurred_at, event_type, workload_id, namespace, pod, node, reason,
    concat(preemptor_kind, if(preemptor_kind = '', '', '/'), preemptor_namespace, if(preemptor_namespace = '', '', '/'), preemptor_name) AS preemptor,
    priority_class, priority, release_id, correlation_id
FROM {db:Identifier}.workload_timeline FINAL
WHERE occurred_at BETWEEN {from:DateTime64(3, 'UTC')} AND {to:DateTime64(3, 'UTC')}
  AND node IN {nodes:Array(String)}
  AND event_type IN ('scheduler.preempted', 'scheduler.evicted', 'scheduler.requeued', 'scheduler.failed_scheduling', 'scheduler.scheduled')
  AND (correlation_id, version) IN (
        SELECT correlation_id, max(version) FROM {db:Identifier}.workload_timeline
        WHERE occurred_at BETWEEN {from:DateTime64(3, 'UTC')} AND {to:DateTime64(3, 'UTC')}
        GROUP BY correlation_id)
ORDER BY occurred_at, correlation_id
