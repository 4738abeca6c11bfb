//! The end-to-end suite: real gateway processes and in-process gateways in
//! front of the demo upstream, against real Postgres, MariaDB, Redis,
//! RabbitMQ and NATS (started by `scripts/services.sh`; a missing one is skipped loudly,
//! or fails the run with `CI=true`). One binary for the whole suite, so the
//! workspace is linked once; `cargo test --test suite -- key_routes::`
//! runs one file.

mod support;

mod after_answer;
mod bounds;
mod callback_routes;
mod claim_life;
mod cli;
mod consumers;
mod demo_upstream;
mod edges;
mod failover;
mod faults;
mod galera;
mod grpc;
mod hostile;
mod ingress;
mod key_routes;
mod layering;
mod library;
mod mysql;
mod operations;
mod operators;
mod partitions;
mod principals;
mod protocols;
mod proxy;
mod redis_cluster;
mod reloads;
mod store;
mod store_faults;
mod token_routes;
mod traces;
mod upstream_h2;
mod upstream_wire;
