-- MySQL twin of migrations/postgres/0002_purges.sql. On Galera the ids of
-- different nodes interleave (auto_increment_increment): followers re-read
-- a trailing window of ids, as they do for out-of-order commits anywhere.
CREATE TABLE IF NOT EXISTS idempotency_purges (
    id        BIGINT          NOT NULL AUTO_INCREMENT PRIMARY KEY,
    route     VARBINARY(255)  NOT NULL,
    idem_key  VARBINARY(512)  NOT NULL,
    scope     VARBINARY(255)  NULL,
    purged_at BIGINT          NOT NULL
) ENGINE = InnoDB;
