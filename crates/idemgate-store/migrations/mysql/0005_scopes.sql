-- MySQL twin of migrations/postgres/0009_scopes.sql.
CREATE TABLE IF NOT EXISTS idempotency_scopes (
    route      VARBINARY(255)  NOT NULL PRIMARY KEY,
    records    VARBINARY(255)  NOT NULL,
    scope      BLOB            NOT NULL,
    updated_at BIGINT          NOT NULL
) ENGINE = InnoDB;
