//! What pgfence does in PostgreSQL: fenced writes and their audit trail, guarded tables,
//! migrations, privileges, doctor and verify, failover, poolers. One test binary, one module
//! per feature; a new feature's tests are a new module here.
//!
//! Run one feature's tests with `cargo test --test postgres <module>::`, e.g.
//! `cargo test --test postgres pg_failover::`.

use pgfence_test_support as support;

mod audit;
mod batch;
mod check;
mod coalesce;
mod conditional;
mod decode;
mod derive;
mod doctor;
mod effects;
mod examples;
mod first_deploy;
mod guard;
mod guard_under_load;
mod idle_bound;
mod late_statement;
mod managed;
mod messages;
#[cfg(feature = "metrics")]
mod metrics;
mod migrate;
mod observe;
mod one_refusal;
mod patroni;
mod pg_failover;
mod poolers;
mod prefix_isolation;
mod privileges;
mod raw_sql;
mod repository;
mod security;
mod squash;
mod surface;
mod unbreakable;
mod verify;
