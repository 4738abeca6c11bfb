-- SQLite twin of migrations/postgres/0004_uncertain_log.sql.
CREATE TABLE IF NOT EXISTS idempotency_uncertain (
    id        INTEGER PRIMARY KEY AUTOINCREMENT,
    route     TEXT    NOT NULL,
    idem_key  TEXT    NOT NULL,
    scope     TEXT    NOT NULL,
    epoch     INTEGER NOT NULL,
    marked_at INTEGER NOT NULL
);

CREATE TRIGGER IF NOT EXISTS idempotency_records_uncertain
    AFTER UPDATE OF state ON idempotency_records
    FOR EACH ROW WHEN NEW.state = 'uncertain' AND OLD.state <> 'uncertain'
BEGIN
    INSERT INTO idempotency_uncertain (route, idem_key, scope, epoch, marked_at)
    VALUES (NEW.route, NEW.idem_key, NEW.scope, NEW.epoch,
            CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER));
END;
