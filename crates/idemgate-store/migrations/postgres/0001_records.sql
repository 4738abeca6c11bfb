-- The durable idempotency record: the source of truth (docs/semantics.md, rule 1).
-- One row per (route, key, client scope); the primary key is what makes the
-- claim `INSERT … ON CONFLICT DO NOTHING` atomic (rule 2), and by its prefix
-- it is also the index `keys show|purge ROUTE KEY` reads across scopes.
--
-- Two indexes only, and the completion UPDATE touches neither indexed
-- column, so Postgres can complete a record as a HOT update (no index
-- writes); the fillfactor leaves each page room for that new row version.
CREATE TABLE IF NOT EXISTS idempotency_records (
    route       TEXT     NOT NULL,
    idem_key    TEXT     NOT NULL,
    scope       TEXT     NOT NULL,
    fingerprint TEXT     NOT NULL,
    -- in_flight | completed | uncertain | released
    state       TEXT     NOT NULL,
    -- fencing token: bumped on every takeover; writes must carry it
    epoch       BIGINT   NOT NULL,
    lease_until BIGINT   NOT NULL,          -- unix ms
    request_id  TEXT     NOT NULL,
    status      INTEGER,
    headers     BYTEA,
    body        BYTEA,
    body_kept   BOOLEAN  NOT NULL DEFAULT FALSE,
    created_at  BIGINT   NOT NULL,          -- unix ms
    updated_at  BIGINT   NOT NULL,
    expires_at  BIGINT   NOT NULL,          -- created_at + retention
    PRIMARY KEY (route, idem_key, scope)
) WITH (fillfactor = 70);
CREATE INDEX IF NOT EXISTS idempotency_records_expires ON idempotency_records (expires_at);

CREATE TABLE IF NOT EXISTS idempotency_archive (
    route       TEXT     NOT NULL,
    idem_key    TEXT     NOT NULL,
    scope       TEXT     NOT NULL,
    fingerprint TEXT     NOT NULL,
    state       TEXT     NOT NULL,
    epoch       BIGINT   NOT NULL,
    request_id  TEXT     NOT NULL,
    status      INTEGER,
    headers     BYTEA,
    body        BYTEA,
    body_kept   BOOLEAN  NOT NULL,
    created_at  BIGINT   NOT NULL,
    updated_at  BIGINT   NOT NULL,
    expires_at  BIGINT   NOT NULL,
    archived_at BIGINT   NOT NULL
);
CREATE INDEX IF NOT EXISTS idempotency_archive_route_key ON idempotency_archive (route, idem_key);
