-- SQLite twin of migrations/postgres/0007_dead_letter_lease.sql (SQLite
-- has no 0006: Postgres's record partitions).
ALTER TABLE idempotency_deliveries ADD COLUMN copy_id TEXT;
ALTER TABLE idempotency_deliveries ADD COLUMN copy_holder TEXT;
ALTER TABLE idempotency_deliveries ADD COLUMN copying_until INTEGER;
