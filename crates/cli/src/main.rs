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
            let mut lines = text.lines();
            let mut first = lines.next().unwrap_or("invalid arguments").to_owned();
            // "the following required arguments were not provided:" names them below.
            if first.ends_with(':') {
                let named: Vec<&str> = lines
                    .take_while(|l| l.starts_with("  "))
                    .map(str::trim)
                    .collect();
                first = format!("{} {}", first, named.join(", "));
            }
            // Arguments are echoed back: hide URLs' secrets and escape control characters.
            eprintln!(
                "pgfence: {}; see --help",
                util::cell(&util::scrub(first.trim_start_matches("error: ").trim_end()))
            );
            return ExitCode::from(2);
        }
        Err(e) => e.exit(), // --help, --version
    };
    util::register_secrets(
        [
            &cli.conn.database_url,
            &cli.conn.redis_url,
            &cli.conn.issuer_url,
        ]
        .into_iter()
        .flatten()
        .map(String::as_str),
    );
    // A panic is a bug; still one line, with URLs and secrets hidden.
    std::panic::set_hook(Box::new(|info| {
        let what = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_default();
        // A `println!` left somewhere (a library's) on a stdout its reader closed: not a bug
        // of ours, and nothing to say; end as a closed pipe ends a command.
        if what.starts_with("failed printing to stdout") && what.contains("Broken pipe") {
            std::process::exit(i32::from(util::CLOSED_STDOUT_EXIT));
        }
        let at = info.location().map(ToString::to_string).unwrap_or_default();
        eprintln!(
            "pgfence: internal error (a bug, please report it): {} at {at}",
            util::cell(&util::scrub(&what))
        );
    }));
    util::init_logging(cli.verbose);
    let outcome = commands::run(cli).await;
    if util::stdout_closed() {
        // `pgfence audit | head`: the reader has what it wanted; nothing more to say.
        return ExitCode::from(util::CLOSED_STDOUT_EXIT);
    }
    match outcome {
        Ok(code) => {
            util::flush_warnings();
            code
        }
        Err(e) => {
            // Warnings held back while the command ran end the error's line.
            let warnings: String = util::take_warnings()
                .iter()
                .map(|w| format!("; warning: {}", util::cell(&util::scrub(w))))
                .collect();
            eprintln!(
                "pgfence: {}{}{warnings}",
                util::one_line(&e),
                util::hint(&e)
            );
            ExitCode::FAILURE
        }
    }
}
