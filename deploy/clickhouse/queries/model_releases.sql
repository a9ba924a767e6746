-- Every release of a model (optionally one version: --param_version='' for all), with its
-- state and environment as of a time, most recently active first.
-- clickhouse-client --param_db=gpuledger --param_model=fraud-scorer --param_version=7 --param_at='\N' --queries-file model_releases.sql
SELECT
    release_id,
    argMax(model_version, occurred_at) AS model_version,
    argMax(environment, occurred_at) AS environment,
    argMax(event_type, occurred_at) AS state,
    max(occurred_at) AS state_since,
    argMax(owner, occurred_at) AS owner,
    argMax(artifact_digest, occurred_at) AS artifact_digest
FROM (
    SELECT * FROM {db:Identifier}.release_history FINAL
    WHERE model_name = {model:String}
      AND ({version:String} = '' OR model_version = {version:String})
      AND ({at:Nullable(DateTime64(3, 'UTC'))} IS NULL OR occurred_at <= {at:Nullable(DateTime64(3, 'UTC'))})
)
GROUP BY release_id
ORDER BY state_since DESC, release_id
