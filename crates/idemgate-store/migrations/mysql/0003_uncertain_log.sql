-- MySQL twin of migrations/postgres/0004_uncertain_log.sql. No trigger
-- (creating one needs privileges a managed database may not grant while
-- binary logging is on): the store writes the log entry in the same
-- transaction that marks the record uncertain.
CREATE TABLE IF NOT EXISTS idempotency_uncertain (
    id        BIGINT          NOT NULL AUTO_INCREMENT PRIMARY KEY,
    route     VARBINARY(255)  NOT NULL,
    idem_key  VARBINARY(512)  NOT NULL,
    scope     VARBINARY(255)  NOT NULL,
    epoch     BIGINT          NOT NULL,
    marked_at BIGINT          NOT NULL,
    KEY idempotency_uncertain_marked (marked_at)
) ENGINE = InnoDB;
