-- SQLite twin of migrations/postgres/0009_scopes.sql.
CREATE TABLE IF NOT EXISTS idempotency_scopes (
    route      TEXT    PRIMARY KEY,
    records    TEXT    NOT NULL,
    scope      TEXT    NOT NULL,
    updated_at INTEGER NOT NULL
);
