-- Everything the scheduler did to one workload and its pods, as of a time:
-- submissions, admissions, placements, preemptions (with the preemptor), evictions.
-- clickhouse-client --param_db=gpuledger --param_workload=risk/fraud-scorer-7 --param_at='\N' --queries-file workload_timeline.sql
SELECT
    occurred_at, event_type, namespace, pod, node, queue, cluster_queue, priority_class, priority, reason, message,
    concat(preemptor_kind, if(preemptor_kind = '', '', '/'), preemptor_namespace, if(preemptor_namespace = '', '', '/'), preemptor_name) AS preemptor,
    release_id, release_state, attribution, correlation_id
FROM {db:Identifier}.workload_timeline FINAL
WHERE workload_id = {workload:String}
  AND ({at:Nullable(DateTime64(3, 'UTC'))} IS NULL OR occurred_at <= {at:Nullable(DateTime64(3, 'UTC'))})
  -- Keep a row only if it is the newest version of its correlation_id anywhere in the table
  -- (a row re-attributed to another workload leaves its old version under this key).
  -- Every version shares its occurred_at, which the (occurred_at, correlation_id) projection serves.
  AND (correlation_id, version) IN (
        SELECT correlation_id, max(version) FROM {db:Identifier}.workload_timeline
        WHERE (occurred_at, correlation_id) IN (
            SELECT occurred_at, correlation_id FROM {db:Identifier}.workload_timeline WHERE workload_id = {workload:String})
        GROUP BY correlation_id)
ORDER BY occurred_at, correlation_id
