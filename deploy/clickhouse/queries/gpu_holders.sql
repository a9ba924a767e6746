-- Who held one GPU at a time (the row with held_at_time = 1), with the intervals before it.
-- clickhouse-client --param_db=gpuledger --param_node=node-b --param_gpu=GPU-bbbb-2222 --param_at='2026-11-30 13:10:00' --queries-file gpu_holders.sql
SELECT
    started_at, ended_at, end_reason, namespace, pod, container, workload_id, release_id, attribution,
    started_at <= {at:DateTime64(3, 'UTC')} AND (ended_at IS NULL OR ended_at > {at:DateTime64(3, 'UTC')}) AS held_at_time,
    allocation_id
FROM {db:Identifier}.gpu_allocations FINAL
WHERE node = {node:String} AND gpu_id = {gpu:String} AND started_at <= {at:DateTime64(3, 'UTC')}
  AND end_reason != 'withdrawn'  -- a tombstone: an interval the engine found started earlier (docs/schemas.md)
ORDER BY started_at, allocation_id
