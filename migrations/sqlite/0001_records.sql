-- SQLite twin of migrations/postgres: the same tables, columns and indexes;
-- only the type names differ (BLOB for BYTEA, INTEGER for BIGINT/BOOLEAN).
-- The durable idempotency record: the source of truth (SPEC §1 rule 1).
-- One row per (client scope, route, key); the unique key is what makes the
-- claim `INSERT … ON CONFLICT DO NOTHING` atomic (rule 2).
CREATE TABLE IF NOT EXISTS idempotency_records (
    id          INTEGER PRIMARY KEY,
    scope       TEXT     NOT NULL,
    route       TEXT     NOT NULL,
    idem_key    TEXT     NOT NULL,
    fingerprint TEXT     NOT NULL,
    -- in_flight | completed | uncertain | released
    state       TEXT     NOT NULL,
    -- fencing token: bumped on every takeover; writes must carry it
    epoch       INTEGER  NOT NULL,
    lease_until INTEGER  NOT NULL,          -- unix ms
    request_id  TEXT     NOT NULL,
    status      INTEGER,
    headers     BLOB,
    body        BLOB,
    body_kept   INTEGER  NOT NULL DEFAULT 0,
    created_at  INTEGER  NOT NULL,          -- unix ms
    updated_at  INTEGER  NOT NULL,
    expires_at  INTEGER  NOT NULL,
    -- (route, key, scope): the claim's conflict target, and by its prefix
    -- the index `keys show|purge ROUTE KEY` reads across client scopes.
    UNIQUE (route, idem_key, scope)
);
CREATE INDEX IF NOT EXISTS idempotency_records_expires ON idempotency_records (expires_at);

CREATE TABLE IF NOT EXISTS idempotency_archive (
    id          INTEGER  NOT NULL,
    scope       TEXT     NOT NULL,
    route       TEXT     NOT NULL,
    idem_key    TEXT     NOT NULL,
    fingerprint TEXT     NOT NULL,
    state       TEXT     NOT NULL,
    epoch       INTEGER  NOT NULL,
    request_id  TEXT     NOT NULL,
    status      INTEGER,
    headers     BLOB,
    body        BLOB,
    body_kept   INTEGER  NOT NULL,
    created_at  INTEGER  NOT NULL,
    updated_at  INTEGER  NOT NULL,
    expires_at  INTEGER  NOT NULL,
    archived_at INTEGER  NOT NULL
);
CREATE INDEX IF NOT EXISTS idempotency_archive_route_key ON idempotency_archive (route, idem_key);
