-- The durable idempotency record: the source of truth (SPEC §1 rule 1).
-- One row per (client scope, route, key); the unique key is what makes the
-- claim `INSERT … ON CONFLICT DO NOTHING` atomic (rule 2).
CREATE TABLE IF NOT EXISTS idempotency_records (
    id          BIGSERIAL PRIMARY KEY,
    scope       TEXT     NOT NULL,
    route       TEXT     NOT NULL,
    idem_key    TEXT     NOT NULL,
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
    expires_at  BIGINT   NOT NULL,
    -- (route, key, scope): the claim's conflict target, and by its prefix
    -- the index `keys show|purge ROUTE KEY` reads across client scopes.
    UNIQUE (route, idem_key, scope)
);
CREATE INDEX IF NOT EXISTS idempotency_records_expires ON idempotency_records (expires_at);

CREATE TABLE IF NOT EXISTS idempotency_archive (
    id          BIGINT   NOT NULL,
    scope       TEXT     NOT NULL,
    route       TEXT     NOT NULL,
    idem_key    TEXT     NOT NULL,
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
