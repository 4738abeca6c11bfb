-- MySQL 8 / MariaDB 10.6+ (InnoDB) twin of migrations/postgres: the same
-- tables and columns, with what InnoDB needs:
--
-- - The record key (route, idem_key, scope) is the PRIMARY key: a
--   duplicate insert then locks the one existing record, where a secondary
--   UNIQUE key would take a gap lock as well.
-- - Every column that is part of a key, or compared for equality, is
--   VARBINARY: compared as bytes. The server's default collations compare
--   case- and accent-insensitively, and PAD SPACE ones ignore trailing
--   spaces: `Order-1`, `order-1` and `order-1 ` would be one key, and one
--   client's stored answer would be handed to another request.
-- - claim_token: which claim last inserted or took the row over (a fresh
--   random value per statement). InnoDB has no RETURNING, and with
--   CLIENT_FOUND_ROWS (which sqlx always sets) an INSERT … ON DUPLICATE KEY
--   UPDATE counts an untouched duplicate as "affected": the row whose
--   token is the claim's own is the only proof the claim won it.
-- - No partitions: a partitioned table needs the partition column in every
--   unique key, so a key claimed in one period could be claimed again in
--   the next. Expired rows are swept in batches along the expiry index.
CREATE TABLE IF NOT EXISTS idempotency_records (
    route       VARBINARY(255)  NOT NULL,
    idem_key    VARBINARY(512)  NOT NULL,
    scope       VARBINARY(255)  NOT NULL,
    fingerprint VARBINARY(255)  NOT NULL,
    -- in_flight | completed | uncertain | released
    state       VARCHAR(16) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    -- fencing token: bumped on every takeover; writes must carry it
    epoch       BIGINT          NOT NULL,
    lease_until BIGINT          NOT NULL,   -- unix ms
    request_id  BLOB            NOT NULL,
    status      INT             NULL,
    headers     MEDIUMBLOB      NULL,
    body        LONGBLOB        NULL,
    body_kept   BOOLEAN         NOT NULL DEFAULT FALSE,
    created_at  BIGINT          NOT NULL,   -- unix ms
    updated_at  BIGINT          NOT NULL,
    expires_at  BIGINT          NOT NULL,   -- created_at + retention
    watched     BOOLEAN         NOT NULL DEFAULT FALSE,
    maybe_ran   BOOLEAN         NOT NULL DEFAULT FALSE,
    claim_token BINARY(16)      NULL,
    PRIMARY KEY (route, idem_key, scope),
    KEY idempotency_records_expires (expires_at)
) ENGINE = InnoDB;

CREATE TABLE IF NOT EXISTS idempotency_archive (
    route       VARBINARY(255)  NOT NULL,
    idem_key    VARBINARY(512)  NOT NULL,
    scope       VARBINARY(255)  NOT NULL,
    fingerprint VARBINARY(255)  NOT NULL,
    state       VARCHAR(16) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    epoch       BIGINT          NOT NULL,
    request_id  BLOB            NOT NULL,
    status      INT             NULL,
    headers     MEDIUMBLOB      NULL,
    body        LONGBLOB        NULL,
    body_kept   BOOLEAN         NOT NULL,
    created_at  BIGINT          NOT NULL,
    updated_at  BIGINT          NOT NULL,
    expires_at  BIGINT          NOT NULL,
    archived_at BIGINT          NOT NULL,
    -- Galera replicates only tables with a primary key.
    id          BIGINT          NOT NULL AUTO_INCREMENT PRIMARY KEY,
    KEY idempotency_archive_route_key (route, idem_key)
) ENGINE = InnoDB;
