-- The workloads attributed to a release: queue, cluster queue, priority, first admission,
-- preemptions/evictions, pods and nodes, as of a time.
-- (workload_timeline is keyed by workload_id; the last condition drops a row whose
-- correlation_id was re-attributed to another workload by a newer version.)
-- clickhouse-client --param_db=gpuledger --param_release=fraud-scorer-v7-prod --param_at='\N' --queries-file release_workloads.sql
SELECT
    workload_id,
    argMaxIf(queue, occurred_at, queue != '') AS queue,
    argMaxIf(cluster_queue, occurred_at, cluster_queue != '') AS cluster_queue,
    argMaxIf(priority_class, occurred_at, priority_class != '') AS priority_class,
    argMaxIf(priority, occurred_at, priority IS NOT NULL) AS priority,
    minIf(occurred_at, event_type = 'scheduler.admitted') AS first_admitted_at,
    countIf(event_type = 'scheduler.admitted') AS admissions,
    countIf(event_type = 'scheduler.preempted') AS preemptions,
    countIf(event_type = 'scheduler.evicted') AS evictions,
    groupUniqArrayIf(concat(namespace, '/', pod), pod != '') AS pods,
    groupUniqArrayIf(node, node != '') AS nodes,
    argMax(event_type, occurred_at) AS last_event
FROM {db:Identifier}.workload_timeline FINAL
WHERE workload_id IN (  -- candidates: any version ever named the release (the release_id projection)
        SELECT workload_id FROM {db:Identifier}.workload_timeline WHERE release_id = {release:String})
  AND ({at:Nullable(DateTime64(3, 'UTC'))} IS NULL OR occurred_at <= {at:Nullable(DateTime64(3, 'UTC'))})
  AND (correlation_id, version) IN (
        SELECT correlation_id, max(version) FROM {db:Identifier}.workload_timeline
        WHERE (occurred_at, correlation_id) IN (
            SELECT occurred_at, correlation_id FROM {db:Identifier}.workload_timeline
            WHERE workload_id IN (SELECT workload_id FROM {db:Identifier}.workload_timeline WHERE release_id = {release:String}))
        GROUP BY correlation_id)
GROUP BY workload_id
HAVING countIf(release_id = {release:String}) > 0  -- the latest versions still name the release
ORDER BY workload_id
