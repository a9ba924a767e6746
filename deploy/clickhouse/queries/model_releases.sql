-- Every release of a model (optionally one version: --param_version='' for all), with its
-- state and environment as of a time, most recently active first: a release holding GPUs at that
-- time first (`holding_gpus`), then one whose lifecycle has not ended (its latest lifecycle event
-- is not a rollback, revocation or retirement), then by its latest event — a rollback counting as
-- an event of the release it restored (superseded_release_id). `state` is the latest event of any
-- kind (a reservation released after a rollback is one), `lifecycle_state` the latest lifecycle
-- event. `gpuledger trace --model` ranks so too, and also counts a release replaced by a later
-- promotion (its superseded_release_id) as ended: where the two differ, the trace is right.
-- clickhouse-client --param_db=gpuledger --param_model=fraud-scorer --param_version=7 --param_at='\N' --queries-file model_releases.sql
SELECT
    r.release_id AS release_id,
    r.latest_model_version AS model_version,
    r.latest_environment AS environment,
    r.state AS state,
    r.state_since AS state_since,
    r.lifecycle_state AS lifecycle_state,
    r.latest_owner AS owner,
    r.latest_artifact_digest AS artifact_digest,
    held.gpus AS holding_gpus
FROM (
    SELECT
        release_id,
        argMax(model_version, (occurred_at, indexOf(['release.registered', 'release.evaluated', 'release.approved', 'release.promoted', 'release.rolled_back', 'release.revoked', 'release.retired'], event_type), correlation_id)) AS latest_model_version,
        argMax(environment, (occurred_at, indexOf(['release.registered', 'release.evaluated', 'release.approved', 'release.promoted', 'release.rolled_back', 'release.revoked', 'release.retired'], event_type), correlation_id)) AS latest_environment,
        argMax(event_type, (occurred_at, indexOf(['release.registered', 'release.evaluated', 'release.approved', 'release.promoted', 'release.rolled_back', 'release.revoked', 'release.retired'], event_type), correlation_id)) AS state,
        max(occurred_at) AS state_since,
        argMaxIf(event_type, (occurred_at, indexOf(['release.registered', 'release.evaluated', 'release.approved', 'release.promoted', 'release.rolled_back', 'release.revoked', 'release.retired'], event_type), correlation_id), event_type IN ('release.registered', 'release.evaluated', 'release.approved', 'release.promoted',
                                                         'release.rolled_back', 'release.revoked', 'release.retired')) AS lifecycle_state,
        argMax(owner, (occurred_at, indexOf(['release.registered', 'release.evaluated', 'release.approved', 'release.promoted', 'release.rolled_back', 'release.revoked', 'release.retired'], event_type), correlation_id)) AS latest_owner,
        argMax(artifact_digest, (occurred_at, indexOf(['release.registered', 'release.evaluated', 'release.approved', 'release.promoted', 'release.rolled_back', 'release.revoked', 'release.retired'], event_type), correlation_id)) AS latest_artifact_digest
    FROM {db:Identifier}.release_history FINAL
    WHERE model_name = {model:String}
      AND ({version:String} = '' OR model_version = {version:String})
      AND ({at:Nullable(DateTime64(3, 'UTC'))} IS NULL OR occurred_at <= {at:Nullable(DateTime64(3, 'UTC'))})
    GROUP BY release_id
) AS r
LEFT JOIN (
    SELECT superseded_release_id AS release_id, max(occurred_at) AS restored_at
    FROM {db:Identifier}.release_history FINAL
    WHERE event_type = 'release.rolled_back' AND superseded_release_id != ''
      AND ({at:Nullable(DateTime64(3, 'UTC'))} IS NULL OR occurred_at <= {at:Nullable(DateTime64(3, 'UTC'))})
    GROUP BY superseded_release_id
) AS restored ON restored.release_id = r.release_id
LEFT JOIN (
    SELECT release_id, toUInt32(count()) AS gpus
    FROM {db:Identifier}.gpu_allocations FINAL
    WHERE release_id != '' AND end_reason != 'withdrawn'
      AND ({at:Nullable(DateTime64(3, 'UTC'))} IS NULL OR started_at <= {at:Nullable(DateTime64(3, 'UTC'))})
      AND (ended_at IS NULL OR ({at:Nullable(DateTime64(3, 'UTC'))} IS NOT NULL AND ended_at > {at:Nullable(DateTime64(3, 'UTC'))}))
    GROUP BY release_id
) AS held ON held.release_id = r.release_id
ORDER BY holding_gpus > 0 DESC, r.lifecycle_state IN ('release.rolled_back', 'release.revoked', 'release.retired'),
         greatest(r.state_since, if(restored.release_id = '', r.state_since, restored.restored_at)) DESC, r.release_id
SETTINGS join_use_nulls = 0
