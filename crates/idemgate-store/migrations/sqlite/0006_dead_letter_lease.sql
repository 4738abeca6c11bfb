-- SQLite twin of migrations/postgres/0007_dead_letter_lease.sql (SQLite
-- keeps row sweeping, so it has no twin of Postgres's 0006, the record
-- partitions: its versions stay contiguous).
ALTER TABLE idempotency_deliveries ADD COLUMN copy_id TEXT;
ALTER TABLE idempotency_deliveries ADD COLUMN copy_holder TEXT;
ALTER TABLE idempotency_deliveries ADD COLUMN copying_until INTEGER;
