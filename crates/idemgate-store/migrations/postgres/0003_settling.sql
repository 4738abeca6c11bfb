-- What a record needs after its first answer.
--
-- watched: a duplicate on some instance is waiting for this record to
-- settle. The statement that settles it (complete, release, uncertain)
-- returns the flag, and only then is a notification sent, so a record
-- nobody waits for costs no NOTIFY (Postgres serialises every notifying
-- commit behind one lock).
--
-- maybe_ran: set by the takeover from the state it replaced. True when the
-- attempt before may have reached the upstream (uncertain, or a lease that
-- ran out under a holder that may have forwarded): the new holder asks the
-- upstream first (reconciliation) where the route can.
--
-- An uncertain record's lease_until is when it may be taken over again: a
-- copy may still be running at the upstream until then.
--
-- Both columns are added with a constant default: a catalog change only,
-- no table rewrite, however large the table.
ALTER TABLE idempotency_records ADD COLUMN IF NOT EXISTS watched BOOLEAN NOT NULL DEFAULT FALSE;
ALTER TABLE idempotency_records ADD COLUMN IF NOT EXISTS maybe_ran BOOLEAN NOT NULL DEFAULT FALSE;
