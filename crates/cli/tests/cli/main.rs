//! The `pgfence` binary's integration tests: one test binary (one build, one link, one set of
//! throwaway servers), a module per command and a few for what cuts across commands.
//! `cargo test -p pgfence-cli --test cli doctor::` runs one module.
//!
//! * Per command (`crates/cli/src/commands/`): [`audit`], [`doctor`], [`effect`], [`grant`],
//!   [`guard`] (and `unguard`, `tables`; the guard modes in `guard::modes`, the emitted
//!   migrations in `guard::emit`), [`lock`],
//!   [`migrate`], [`reseed`], [`run`] (with `run::on_lease_lost`, `run::shell_path`,
//!   `run::zk_paused_process`), [`simulate`].
//! * Across commands: [`bad_input`] (hostile inputs to the library and the binary; garbage in
//!   every argument in `bad_input::every_argument`), [`connections`] (every command closes
//!   its PostgreSQL connections: nothing in the server's log), [`messages`] (what the user reads when
//!   something fails), [`issuer_url`] (`--issuer-url`, `--key-prefix`, each issuer),
//!   [`production`] (TLS-only PostgreSQL, PgBouncer, the application role, a hostile
//!   `search_path`).
//! * [`common`]: the helpers that run the binary, shared by the modules above.

use pgfence_test_support as support;

mod common;

mod audit;
mod bad_input;
mod connections;
mod doctor;
mod effect;
mod grant;
mod guard;
mod issuer_url;
mod lock;
mod messages;
mod migrate;
mod production;
mod reseed;
mod run;
mod simulate;
