//! `pgfence`: migrate, guard tables, read the audit trail, take locks, run commands under a
//! lock, reseed after a failover, and `simulate` the lock-expiry race.

mod cli;
mod commands;
mod connect;
mod util;

use std::process::ExitCode;

use clap::Parser;

use crate::cli::Cli;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if e.use_stderr() => {
            // Usage errors in one line, like every other pgfence error.
            let text = e.to_string();
            let first = text.lines().next().unwrap_or("invalid arguments");
            eprintln!(
                "pgfence: {}; see --help",
                first.trim_start_matches("error: ")
            );
            return ExitCode::from(2);
        }
        Err(e) => e.exit(), // --help, --version
    };
    util::init_logging(cli.verbose);
    match commands::run(cli).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("pgfence: {}", util::one_line(&e));
            ExitCode::FAILURE
        }
    }
}
