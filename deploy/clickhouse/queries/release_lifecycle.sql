-- A release's lifecycle with its manifest, as of a time: the last row is the state (one instant's rows in the
-- order a release lives them, as the worker reads them: one --at for every pipeline step).
-- Approvals are the release.approved rows, promotions the release.promoted rows.
-- clickhouse-client --param_db=gpuledger --param_release=fraud-scorer-v7-prod --param_at='\N' --queries-file release_lifecycle.sql
SELECT
    occurred_at, event_type, actor, approval_id, to_environment, reason, superseded_release_id,
    model_name, model_version, artifact_digest, image_digest, config_digest, dataset_ref, owner, environment,
    reservation_id, reservation_gpus, target, expires_at, correlation_id
FROM {db:Identifier}.release_history FINAL
WHERE release_id = {release:String}
  AND ({at:Nullable(DateTime64(3, 'UTC'))} IS NULL OR occurred_at <= {at:Nullable(DateTime64(3, 'UTC'))})
ORDER BY occurred_at, indexOf(['release.registered', 'release.evaluated', 'release.approved', 'release.promoted', 'release.rolled_back', 'release.revoked', 'release.retired'], event_type), correlation_id
