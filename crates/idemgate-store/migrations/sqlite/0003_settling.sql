-- SQLite twin of migrations/postgres/0003_settling.sql.
ALTER TABLE idempotency_records ADD COLUMN watched INTEGER NOT NULL DEFAULT 0;
ALTER TABLE idempotency_records ADD COLUMN maybe_ran INTEGER NOT NULL DEFAULT 0;
