-- Purges, as a log every gateway reads: an in-process fast layer (one per
-- gateway process) may still hold a purged key's outcome, and a purge made
-- by the CLI or another instance must reach it (docs/semantics.md, "Purges"). Gateways poll
-- rows past the last id they saw; the sweeper trims old rows.
CREATE TABLE IF NOT EXISTS idempotency_purges (
    id        BIGSERIAL PRIMARY KEY,
    route     TEXT   NOT NULL,
    idem_key  TEXT   NOT NULL,
    scope     TEXT,                -- NULL: every scope
    purged_at BIGINT NOT NULL      -- unix ms, the database's clock
);
