//! The token issuers (Redis, PostgreSQL, etcd, ZooKeeper) and the leases they hand out: the
//! suite every issuer passes (`issuer_suite`), each issuer's own behaviour, TLS, failovers,
//! refused acquisitions and keep-alive. One test binary; a new issuer is a new module here
//! that invokes `issuer_suite::lease_tests!`.
//!
//! Run one module's tests with `cargo test --test issuers <module>::`, e.g.
//! `cargo test --test issuers etcd_issuer::`.

use pgfence_test_support as support;

mod issuer_suite;

mod etcd_issuer;
mod idle_expiry;
mod issuer;
mod issuer_tls;
mod issuer_trait;
mod lease_resilience;
mod lease_session;
mod pg_issuer;
mod redis_failover;
mod refused_acquire;
mod time_bounds;
mod zk_issuer;
