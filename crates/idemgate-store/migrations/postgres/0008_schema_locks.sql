-- The locks that let one gateway at a time make or retire partitions
-- (0006_partitions.sql) are advisory locks, which Postgres keeps per
-- database, not per schema: gateways of two deployments sharing a database
-- in schemas of their own (the library's `schema`, or `search_path` in
-- the database URL) made each other wait, and one's
-- retirement made the other skip its own until its next sweep. Their keys
-- now name the schema the functions run in. The functions are otherwise
-- those of 0006.

CREATE OR REPLACE FUNCTION idempotency_extend(p_span BIGINT, p_until BIGINT, p_lock_wait TEXT)
RETURNS INTEGER
LANGUAGE plpgsql AS $$
DECLARE
    now_ms BIGINT := (extract(epoch from clock_timestamp()) * 1000)::bigint;
    lo     BIGINT;
    hi     BIGINT;
    made   INTEGER := 0;
    part   TEXT;
BEGIN
    PERFORM set_config('lock_timeout', p_lock_wait, true);
    PERFORM pg_advisory_xact_lock(hashtextextended(current_schema() || '.idempotency_partitions', 0));
    SELECT max(upper_ms) INTO lo FROM idempotency_partitions;
    lo := greatest(coalesce(lo, 0), now_ms - now_ms % p_span);
    WHILE lo < p_until LOOP
        hi := (lo / p_span + 1) * p_span;
        part := 'idempotency_records_'
            || to_char(to_timestamp(lo / 1000.0) AT TIME ZONE 'UTC', 'YYYYMMDD"t"HH24MISSMS');
        EXECUTE format('CREATE TABLE %I (LIKE idempotency_records INCLUDING DEFAULTS) '
                       'WITH (fillfactor = 70)', part);
        EXECUTE format('ALTER TABLE idempotency_records ATTACH PARTITION %I '
                       'FOR VALUES FROM (%s) TO (%s)', part, lo, hi);
        INSERT INTO idempotency_partitions (name, lower_ms, upper_ms) VALUES (part, lo, hi);
        made := made + 1;
        lo := hi;
    END LOOP;
    RETURN made;
END
$$;

CREATE OR REPLACE FUNCTION idempotency_retire(p_name TEXT)
RETURNS BIGINT
LANGUAGE plpgsql AS $$
DECLARE
    now_ms BIGINT := (extract(epoch from clock_timestamp()) * 1000)::bigint;
    total  BIGINT;
    held   BIGINT;
BEGIN
    IF NOT pg_try_advisory_xact_lock(hashtextextended(current_schema() || '.idempotency_retire', 0)) THEN
        RETURN -2;
    END IF;
    -- Another gateway may have retired it since this one listed it.
    IF NOT EXISTS (SELECT 1 FROM idempotency_partitions WHERE name = p_name AND NOT detached)
       OR to_regclass(p_name) IS NULL THEN
        RETURN 0;
    END IF;
    EXECUTE format('SELECT count(*), count(*) FILTER (WHERE state IN (''in_flight'', ''uncertain'') '
                   'AND lease_until > $1) FROM %I', p_name)
        INTO total, held USING now_ms;
    IF held > 0 THEN
        RETURN -1;
    END IF;
    PERFORM set_config('lock_timeout', '200ms', true);
    EXECUTE format('ALTER TABLE idempotency_records DETACH PARTITION %I', p_name);
    UPDATE idempotency_partitions SET detached = TRUE WHERE name = p_name;
    RETURN total;
END
$$;
