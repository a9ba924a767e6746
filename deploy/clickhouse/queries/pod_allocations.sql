-- The GPU allocation intervals of one pod (open intervals have ended_at NULL), as of a time:
-- an interval that ended after --param_at shows as still held.
-- clickhouse-client --param_db=gpuledger --param_namespace=risk --param_pod=fraud-scorer-7-def34 --param_at='\N' --queries-file pod_allocations.sql
SELECT
    node, gpu_id, mig_instance, container, started_at,
    if({at:Nullable(DateTime64(3, 'UTC'))} IS NOT NULL AND ended_at > {at:Nullable(DateTime64(3, 'UTC'))}, NULL, ended_at) AS ended_at,
    end_reason, workload_id, release_id, attribution, allocation_id
FROM {db:Identifier}.gpu_allocations FINAL
WHERE namespace = {namespace:String} AND pod = {pod:String} AND end_reason != 'withdrawn'  -- (tombstones: docs/schemas.md)
  AND ({at:Nullable(DateTime64(3, 'UTC'))} IS NULL OR started_at <= {at:Nullable(DateTime64(3, 'UTC'))})
ORDER BY started_at, allocation_id
