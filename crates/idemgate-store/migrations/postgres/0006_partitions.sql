-- The record table, partitioned by expiry (docs/semantics.md, "Retention").
--
-- Why: retiring expired records row by row writes WAL for every row and
-- leaves the table and its indexes to vacuum; a table of 100 million rows
-- then claims slower than an empty one, and the sweep competes with the
-- claims. Partitioned by `expires_at`, a span of records whose retention
-- (and tombstone) is over goes at once: DETACH + DROP (or DETACH + keep,
-- with `store.archive`), a catalog change of milliseconds and no per-row
-- WAL. The gateways make the partitions ahead (the sweeper, and every
-- start). Each is made as a table of its own and then attached: ATTACH
-- takes only a SHARE UPDATE EXCLUSIVE lock on the parent, which claims do
-- not wait for (CREATE TABLE … PARTITION OF would take ACCESS EXCLUSIVE).
-- There is no DEFAULT partition, on purpose: attaching beside one scans it
-- under an exclusive lock every claim would queue behind. A claim whose
-- expiry finds no partition (every sweeper stopped for spans on end)
-- makes the partitions it needs and is tried again.
--
-- The claim must stay atomic across partitions. Postgres cannot enforce a
-- unique key that leaves out the partition column, and a key claimed again
-- gets a later expiry, i.e. another partition: `ON CONFLICT` alone would
-- let one key hold two rows in two partitions, both claimable. So every
-- fresh key is inserted under its transaction-scoped advisory lock, after
-- a look for the key in every partition (PL/pgSQL takes a fresh snapshot
-- for each statement, so the look after the lock sees every row committed
-- before it). A takeover deletes the old row and inserts its successor in
-- one transaction: the DELETE locks that one row, so a second takeover
-- finds it gone, and a claim that saw the key never inserts it. The
-- functions below do each in one round trip. Updates in place (complete,
-- release, renew) never change `expires_at`, so they never move a row.
--
-- An existing (unpartitioned) table is kept, not copied: it becomes the
-- partition for every expiry up to its newest, so its rows keep answering
-- and it is retired like any other partition once that expiry has passed.
-- Attaching it builds one index on it ((route, idem_key, scope): its
-- primary key cannot serve a partitioned parent, which has no unique
-- index) and checks its expiries once; both take time in proportion to
-- the table, under the migration's lock. Gateways of earlier releases must
-- be stopped first: their claims use `ON CONFLICT` on the old primary key.

-- Checking and indexing an existing table takes as long as the table is
-- big: not bounded by the pool's per-statement timeout (this migration
-- runs in one transaction, which SET LOCAL lasts for). Its locks are: a
-- gateway of the earlier release still running makes it fail after ten
-- seconds (and the gateway not start) rather than queue every claim.
SET LOCAL statement_timeout = 0;
SET LOCAL lock_timeout = '10s';

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_class WHERE oid = to_regclass('idempotency_records')
               AND relkind = 'r') THEN
        ALTER TABLE idempotency_records RENAME TO idempotency_records_legacy;
        ALTER TABLE idempotency_records_legacy
            RENAME CONSTRAINT idempotency_records_pkey TO idempotency_records_legacy_pkey;
        ALTER INDEX IF EXISTS idempotency_records_expires RENAME TO idempotency_records_legacy_expires;
        -- The parent's own trigger is cloned onto it when attached.
        DROP TRIGGER IF EXISTS idempotency_records_uncertain ON idempotency_records_legacy;
    END IF;
END
$$;

CREATE TABLE IF NOT EXISTS idempotency_records (
    route       TEXT     NOT NULL,
    idem_key    TEXT     NOT NULL,
    scope       TEXT     NOT NULL,
    fingerprint TEXT     NOT NULL,
    state       TEXT     NOT NULL,
    epoch       BIGINT   NOT NULL,
    lease_until BIGINT   NOT NULL,
    request_id  TEXT     NOT NULL,
    status      INTEGER,
    headers     BYTEA,
    body        BYTEA,
    body_kept   BOOLEAN  NOT NULL DEFAULT FALSE,
    created_at  BIGINT   NOT NULL,
    updated_at  BIGINT   NOT NULL,
    expires_at  BIGINT   NOT NULL,
    watched     BOOLEAN  NOT NULL DEFAULT FALSE,
    maybe_ran   BOOLEAN  NOT NULL DEFAULT FALSE
) PARTITION BY RANGE (expires_at);
-- Not unique (see above); as before, neither indexed column is changed by
-- a completion, which stays a HOT update.
CREATE INDEX IF NOT EXISTS idempotency_records_key ON idempotency_records (route, idem_key, scope);
CREATE INDEX IF NOT EXISTS idempotency_records_expires ON idempotency_records (expires_at);

DROP TRIGGER IF EXISTS idempotency_records_uncertain ON idempotency_records;
CREATE TRIGGER idempotency_records_uncertain
    AFTER UPDATE OF state ON idempotency_records
    FOR EACH ROW WHEN (NEW.state = 'uncertain' AND OLD.state IS DISTINCT FROM 'uncertain')
    EXECUTE FUNCTION idempotency_log_uncertain();

-- Which range partitions exist, and their bounds (unix ms, `upper_ms`
-- exclusive): what the sweeper retires from and extends.
CREATE TABLE IF NOT EXISTS idempotency_partitions (
    name     TEXT    PRIMARY KEY,
    lower_ms BIGINT  NOT NULL,
    upper_ms BIGINT  NOT NULL,
    -- detached, not yet dropped (or renamed to the archive)
    detached BOOLEAN NOT NULL DEFAULT FALSE
);

DO $$
DECLARE
    cutoff BIGINT;
BEGIN
    IF to_regclass('idempotency_records_legacy') IS NOT NULL THEN
        SELECT max(expires_at) + 1 INTO cutoff FROM idempotency_records_legacy;
        IF cutoff IS NULL THEN
            DROP TABLE idempotency_records_legacy;
        ELSE
            -- Proves the partition bound, so ATTACH does not scan again.
            EXECUTE format('ALTER TABLE idempotency_records_legacy ADD CONSTRAINT '
                           'idempotency_records_legacy_bound CHECK (expires_at < %s)', cutoff);
            ALTER TABLE idempotency_records_legacy SET (fillfactor = 70);
            EXECUTE format('ALTER TABLE idempotency_records ATTACH PARTITION '
                           'idempotency_records_legacy FOR VALUES FROM (MINVALUE) TO (%s)', cutoff);
            ALTER TABLE idempotency_records_legacy
                DROP CONSTRAINT idempotency_records_legacy_pkey;
            INSERT INTO idempotency_partitions (name, lower_ms, upper_ms)
            VALUES ('idempotency_records_legacy', -9223372036854775808, cutoff);
        END IF;
    END IF;
END
$$;

-- One array per column: claims the keys no row holds, in one transaction
-- → the rows inserted. A key twice in the arrays is inserted once (its
-- first occurrence). Only keys absent at first sight are locked and may
-- be inserted: the duplicates of a key that has a record (the many
-- retries of one order) never queue on its lock; one whose record
-- vanishes meanwhile (a purge) is simply not won, and its caller looks
-- again.
CREATE OR REPLACE FUNCTION idempotency_claim(
    p_scope TEXT[], p_route TEXT[], p_key TEXT[], p_fingerprint TEXT[],
    p_lease BIGINT, p_request_id TEXT[], p_retention BIGINT)
RETURNS TABLE (scope TEXT, route TEXT, idem_key TEXT, epoch BIGINT, expires_at BIGINT)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    fresh BIGINT[];
BEGIN
    SELECT coalesce(array_agg(v.n), '{}') INTO fresh
    FROM unnest(p_route, p_key, p_scope) WITH ORDINALITY AS v(route, idem_key, scope, n)
    WHERE NOT EXISTS (SELECT 1 FROM idempotency_records AS o
                      WHERE o.route = v.route AND o.idem_key = v.idem_key AND o.scope = v.scope);
    IF cardinality(fresh) = 0 THEN
        RETURN;
    END IF;
    -- In one order, so that two batches sharing keys never deadlock.
    PERFORM pg_advisory_xact_lock(h)
    FROM (SELECT DISTINCT hashtextextended(v.route || chr(1) || v.idem_key || chr(1) || v.scope, 0) AS h
          FROM unnest(p_route, p_key, p_scope) WITH ORDINALITY AS v(route, idem_key, scope, n)
          WHERE v.n = ANY (fresh)
          ORDER BY 1) AS locks;
    RETURN QUERY
    INSERT INTO idempotency_records AS r
        (scope, route, idem_key, fingerprint, state, epoch, lease_until, request_id,
         created_at, updated_at, expires_at, body_kept)
    SELECT DISTINCT ON (v.route, v.idem_key, v.scope)
           v.scope, v.route, v.idem_key, v.fingerprint, 'in_flight',
           (extract(epoch from clock_timestamp()) * 1000000)::bigint,
           (extract(epoch from clock_timestamp()) * 1000)::bigint + p_lease, v.request_id,
           (extract(epoch from clock_timestamp()) * 1000)::bigint,
           (extract(epoch from clock_timestamp()) * 1000)::bigint,
           (extract(epoch from clock_timestamp()) * 1000)::bigint + p_retention, FALSE
    FROM unnest(p_scope, p_route, p_key, p_fingerprint, p_request_id)
         WITH ORDINALITY AS v(scope, route, idem_key, fingerprint, request_id, n)
    WHERE v.n = ANY (fresh)
      AND NOT EXISTS (SELECT 1 FROM idempotency_records AS o
                      WHERE o.route = v.route AND o.idem_key = v.idem_key AND o.scope = v.scope)
    ORDER BY v.route, v.idem_key, v.scope, v.n
    RETURNING r.scope, r.route, r.idem_key, r.epoch, r.expires_at;
END
$$;

-- Whether a record may be taken over by a request with `p_fingerprint`:
-- forgotten (retention and tombstone over, and not held) or released, any
-- request; within retention, an uncertain record whose hold is over or a
-- lease-expired one, the same request only.
CREATE OR REPLACE FUNCTION idempotency_takeable(
    o idempotency_records, p_fingerprint TEXT, p_tombstone BIGINT, now_ms BIGINT)
RETURNS BOOLEAN
LANGUAGE sql IMMUTABLE AS $$
    SELECT (o.expires_at + p_tombstone <= now_ms
            AND NOT (o.state IN ('in_flight', 'uncertain') AND o.lease_until > now_ms))
        OR o.state = 'released'
        OR (o.fingerprint = p_fingerprint AND o.expires_at > now_ms
            AND o.state IN ('uncertain', 'in_flight') AND o.lease_until <= now_ms)
$$;

-- Takes over the record of one key where it may be taken
-- (`idempotency_takeable`, evaluated again on the row the DELETE locks):
-- deletes it and inserts its successor (epoch + 1, expiry from now, so
-- possibly in another partition) in one transaction → the new epoch, its
-- expiry, and whether the attempt replaced may have reached the upstream.
CREATE OR REPLACE FUNCTION idempotency_take_over(
    p_scope TEXT, p_route TEXT, p_key TEXT, p_fingerprint TEXT,
    p_lease BIGINT, p_request_id TEXT, p_retention BIGINT, p_tombstone BIGINT)
RETURNS TABLE (epoch BIGINT, expires_at BIGINT, maybe_ran BOOLEAN)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    now_ms BIGINT;
BEGIN
    -- Most callers are duplicates of a record that may not be taken (in
    -- flight, completed): they are answered without queueing on the lock.
    now_ms := (extract(epoch from clock_timestamp()) * 1000)::bigint;
    IF NOT EXISTS (SELECT 1 FROM idempotency_records AS o
                   WHERE o.scope = p_scope AND o.route = p_route AND o.idem_key = p_key
                     AND idempotency_takeable(o, p_fingerprint, p_tombstone, now_ms)) THEN
        RETURN;
    END IF;
    now_ms := (extract(epoch from clock_timestamp()) * 1000)::bigint;
    RETURN QUERY
    WITH old AS (
        DELETE FROM idempotency_records AS o
        WHERE o.scope = p_scope AND o.route = p_route AND o.idem_key = p_key
          AND idempotency_takeable(o, p_fingerprint, p_tombstone, now_ms)
        RETURNING o.*
    )
    INSERT INTO idempotency_records AS r
        (scope, route, idem_key, fingerprint, state, epoch, lease_until, request_id,
         created_at, updated_at, expires_at, body_kept, watched, maybe_ran)
    SELECT old.scope, old.route, old.idem_key, p_fingerprint, 'in_flight', old.epoch + 1,
           now_ms + p_lease, p_request_id,
           CASE WHEN old.expires_at + p_tombstone <= now_ms OR old.state = 'released'
                THEN now_ms ELSE old.created_at END,
           now_ms, now_ms + p_retention, FALSE, FALSE,
           old.state IN ('uncertain', 'in_flight') AND old.expires_at > now_ms
    FROM old
    RETURNING r.epoch, r.expires_at, r.maybe_ran;
END
$$;

-- Makes the range partitions that cover expiries up to `p_until`, each
-- `p_span` ms wide on a grid from the epoch, after the newest existing
-- one (or from now) → how many were made. One gateway at a time. The
-- sweeper waits `p_lock_wait` ('200ms') for the locks and tries again at
-- its next sweep rather than hold anyone up; a claim that found no
-- partition waits ('0': its statement timeout) for whoever is making them.
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
    PERFORM pg_advisory_xact_lock(hashtextextended('idempotency_partitions', 0));
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

-- Detaches one partition whose expiries (and tombstones) are all over,
-- unless a row in it is still held (in flight or uncertain under a live
-- lease: its holder may still write its outcome) → the rows it held; -1
-- when held (the caller then sweeps its free rows one by one); -2 when
-- another gateway is retiring one now. Nothing in such a partition can
-- become held again, so the check needs no lock and reads the partition
-- without blocking anyone: the start-up checks keep every attempt, and so
-- every renewal and uncertain mark, within the retention of its claim;
-- renew and uncertain marks refuse a forgotten record whose lease lapsed
-- besides; a takeover moves the row to a later partition. DETACH takes the parent's exclusive lock, and this transaction
-- ends right after it; the table is dropped (or renamed, `store.archive`)
-- by `idempotency_discard`, in a transaction of its own.
CREATE OR REPLACE FUNCTION idempotency_retire(p_name TEXT)
RETURNS BIGINT
LANGUAGE plpgsql AS $$
DECLARE
    now_ms BIGINT := (extract(epoch from clock_timestamp()) * 1000)::bigint;
    total  BIGINT;
    held   BIGINT;
BEGIN
    IF NOT pg_try_advisory_xact_lock(hashtextextended('idempotency_retire', 0)) THEN
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

-- Drops a detached partition, or keeps it renamed `idempotency_archive_…`.
CREATE OR REPLACE FUNCTION idempotency_discard(p_name TEXT, p_keep BOOLEAN)
RETURNS VOID
LANGUAGE plpgsql AS $$
BEGIN
    IF to_regclass(p_name) IS NOT NULL THEN
        IF p_keep THEN
            EXECUTE format('ALTER TABLE %I RENAME TO %I', p_name,
                           replace(p_name, 'idempotency_records_', 'idempotency_archive_'));
        ELSE
            EXECUTE format('DROP TABLE %I', p_name);
        END IF;
    END IF;
    DELETE FROM idempotency_partitions WHERE name = p_name AND detached;
END
$$;

-- Rows kept by retired partitions (`store.archive`), beside the rows
-- moved one by one into `idempotency_archive`.
CREATE OR REPLACE FUNCTION idempotency_archived() RETURNS BIGINT
LANGUAGE plpgsql AS $$
DECLARE
    total BIGINT;
    n     BIGINT;
    t     TEXT;
BEGIN
    SELECT count(*) INTO total FROM idempotency_archive;
    FOR t IN SELECT c.relname FROM pg_class c
             WHERE c.relnamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema())
               AND c.relkind = 'r'
               AND c.relname LIKE 'idempotency\_archive\_%'
    LOOP
        EXECUTE format('SELECT count(*) FROM %I', t) INTO n;
        total := total + n;
    END LOOP;
    RETURN total;
END
$$;
