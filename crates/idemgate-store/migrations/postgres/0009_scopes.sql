-- What scoped the records kept under each route identity (docs/semantics.md,
-- rule 12). One row per record namespace: a route's or consumer's id (its
-- name unless it keeps another), and `/token` for every token. `records`
-- is the namespace the records sit under, `scope` says what made their
-- keys (the identity source for client-scoped routes and tokens, the
-- business-key sources for callbacks and consumers). A configuration that
-- would drop a namespace, or scope it otherwise, while records under it
-- are live or retained is refused at start-up and on reload: those records
-- would be out of reach and their retries executed again.
CREATE TABLE IF NOT EXISTS idempotency_scopes (
    route      TEXT   PRIMARY KEY,
    records    TEXT   NOT NULL,
    scope      TEXT   NOT NULL,
    updated_at BIGINT NOT NULL
);
