-- How a consumed message's deliveries went, shared by every instance: the
-- failed upstream attempts of one business key (so `max_deliveries` holds
-- across instances and restarts, and `X-Delivery-Count` is the real
-- count), and whether its dead-letter copy is stored (so a redelivery
-- after a lost ack is acknowledged without a second copy). Written only
-- when a delivery fails or is dead-lettered, read only on a redelivery:
-- a message that succeeds the first time never touches it.
CREATE TABLE IF NOT EXISTS idempotency_deliveries (
    route       TEXT    NOT NULL,   -- the consumer's name
    idem_key    TEXT    NOT NULL,   -- the business key
    failures    BIGINT  NOT NULL,
    dead_letter BOOLEAN NOT NULL,   -- its copy is stored
    updated_at  BIGINT  NOT NULL,   -- unix ms, the database's clock
    PRIMARY KEY (route, idem_key)
);
