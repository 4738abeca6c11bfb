-- Dead letters made once across instances. A message's dead-letter copy
-- is published by the one instance that holds its row's copy lease
-- (`copy_holder` until `copying_until`, the database's clock; the holder
-- renews it while the broker has not confirmed): another instance
-- deciding the same message's end meanwhile (a broker's redelivery after
-- its ack deadline, a Redis Streams claim of a stalled consumer's entry)
-- waits instead of publishing a second copy, and acknowledges once
-- `dead_letter` says the copy is stored. A holder that dies leaves the
-- lease to lapse; whoever takes it next publishes under the same
-- `copy_id`, so the cases that can still make two copies (a holder dead
-- between the broker's confirm and the record, or cut off from the store
-- for a whole lease) make two copies with one id, which a reader of the
-- dead letters can tell apart from two messages.
ALTER TABLE idempotency_deliveries ADD COLUMN IF NOT EXISTS copy_id TEXT;
ALTER TABLE idempotency_deliveries ADD COLUMN IF NOT EXISTS copy_holder TEXT;
ALTER TABLE idempotency_deliveries ADD COLUMN IF NOT EXISTS copying_until BIGINT;
