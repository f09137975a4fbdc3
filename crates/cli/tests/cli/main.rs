//! The `pgfence` binary's integration tests: one test binary (one build, one link, one set of
//! throwaway servers), a module per area. `cargo test -p pgfence-cli --test cli doctor::` runs
//! one module.

use pgfence_test_support as support;

mod audit_follow;
mod bad_input;
mod basics;
mod cli_gaps;
mod doctor;
mod effect;
mod hardening;
mod issuer_url;
mod messages;
mod on_lease_lost;
mod production;
mod shell_path;
mod simulate_pg_failover;
mod zk_paused_process;
