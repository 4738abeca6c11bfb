-- SQLite twin of migrations/postgres/0002_purges.sql.
CREATE TABLE IF NOT EXISTS idempotency_purges (
    id        INTEGER PRIMARY KEY AUTOINCREMENT,
    route     TEXT    NOT NULL,
    idem_key  TEXT    NOT NULL,
    scope     TEXT,
    purged_at INTEGER NOT NULL
);
