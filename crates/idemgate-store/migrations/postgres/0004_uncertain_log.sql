-- Which records became uncertain, most recent last: what an operator's
-- list of uncertain records (`GET /admin/uncertain`, the dashboard) reads.
-- An index on `state` would find them directly, but an indexed (or
-- predicate) column changed by every completion would cost completions
-- their HOT update; this log is written only on the rare way into
-- `uncertain`, by a trigger in the same transaction. The list re-checks
-- each logged key against its record (still uncertain), so the log needs
-- no removal when a record moves on; the sweeper trims old entries.
CREATE TABLE IF NOT EXISTS idempotency_uncertain (
    id        BIGSERIAL PRIMARY KEY,
    route     TEXT   NOT NULL,
    idem_key  TEXT   NOT NULL,
    scope     TEXT   NOT NULL,
    epoch     BIGINT NOT NULL,
    marked_at BIGINT NOT NULL          -- unix ms, the database's clock
);

CREATE OR REPLACE FUNCTION idempotency_log_uncertain() RETURNS trigger AS $$
BEGIN
    INSERT INTO idempotency_uncertain (route, idem_key, scope, epoch, marked_at)
    VALUES (NEW.route, NEW.idem_key, NEW.scope, NEW.epoch,
            (EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT);
    RETURN NULL;
END
$$ LANGUAGE plpgsql;

DROP TRIGGER IF EXISTS idempotency_records_uncertain ON idempotency_records;
CREATE TRIGGER idempotency_records_uncertain
    AFTER UPDATE OF state ON idempotency_records
    FOR EACH ROW WHEN (NEW.state = 'uncertain' AND OLD.state IS DISTINCT FROM 'uncertain')
    EXECUTE FUNCTION idempotency_log_uncertain();
