-- Dead letters made once across instances. A message's dead-letter copy
-- is published by the one instance that holds its row's copy lease
-- (`copying_until`, the database's clock): another instance deciding the
-- same message's end meanwhile (a broker's redelivery after its ack
-- deadline, a Redis Streams claim of an idle entry) waits instead of
-- publishing a second copy, and acknowledges once `dead_letter` says the
-- copy is stored. A holder that dies leaves the lease to lapse; whoever
-- takes it next publishes under the same `copy_id`, so the one case that
-- can still make two copies (a holder dead between the broker's confirm
-- and the mark) makes two copies with one id, which a reader of the dead
-- letters can tell apart from two messages.
ALTER TABLE idempotency_deliveries ADD COLUMN IF NOT EXISTS copy_id TEXT;
ALTER TABLE idempotency_deliveries ADD COLUMN IF NOT EXISTS copying_until BIGINT;
