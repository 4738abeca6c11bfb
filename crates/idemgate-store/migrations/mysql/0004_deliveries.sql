-- MySQL twin of migrations/postgres/0005_deliveries.sql and
-- 0007_dead_letter_lease.sql.
CREATE TABLE IF NOT EXISTS idempotency_deliveries (
    route         VARBINARY(255)  NOT NULL,
    idem_key      VARBINARY(512)  NOT NULL,
    failures      INT             NOT NULL,
    dead_letter   BOOLEAN         NOT NULL,
    updated_at    BIGINT          NOT NULL,
    copy_id       VARBINARY(255)  NULL,
    copy_holder   VARBINARY(255)  NULL,
    copying_until BIGINT          NULL,
    PRIMARY KEY (route, idem_key),
    KEY idempotency_deliveries_updated (updated_at)
) ENGINE = InnoDB;
