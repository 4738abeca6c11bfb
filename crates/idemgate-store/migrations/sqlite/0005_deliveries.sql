-- SQLite twin of migrations/postgres/0005_deliveries.sql.
CREATE TABLE IF NOT EXISTS idempotency_deliveries (
    route       TEXT    NOT NULL,
    idem_key    TEXT    NOT NULL,
    failures    INTEGER NOT NULL,
    dead_letter INTEGER NOT NULL,
    updated_at  INTEGER NOT NULL,
    PRIMARY KEY (route, idem_key)
);
