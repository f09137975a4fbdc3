//! `pgfence`: migrate, guard tables, read the audit trail, take locks, run commands under a
//! lock, reseed after a failover, and `simulate` the lock-expiry race.

// A command-line tool: printing to stdout is its job.
#![allow(clippy::print_stdout)]

mod commands;
mod run;
mod simulate;
mod util;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

/// Fencing tokens for lease-based locks: Redis issues the numbers, Postgres enforces them.
#[derive(Parser, Debug)]
#[command(name = "pgfence", version, about, propagate_version = true)]
struct Cli {
    #[command(flatten)]
    conn: Conn,
    /// Show pgfence's own log events (INFO and above) on stderr.
    #[arg(long, short, global = true)]
    verbose: bool,
    #[command(subcommand)]
    command: Command,
}

/// Where the servers are.
#[derive(Args, Debug, Clone)]
struct Conn {
    /// PostgreSQL URL.
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    database_url: Option<String>,
    /// Redis URL.
    #[arg(long, env = "REDIS_URL", global = true, hide_env_values = true)]
    redis_url: Option<String>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Apply pgfence's schema (the `pgfence` schema and its own migration history).
    Migrate {
        /// Only show which migrations are applied.
        #[arg(long)]
        status: bool,
    },
    /// Guard an existing table: add `fence bigint NOT NULL DEFAULT 0` and the trigger.
    Guard {
        /// `table` or `schema.table` (names as stored; double-quote parts containing dots).
        table: String,
        /// Write `V{n}__guard_<table>.sql` into this refinery migrations folder instead of
        /// touching the database.
        #[arg(long, value_name = "DIR")]
        emit_migration: Option<PathBuf>,
    },
    /// Remove the guard trigger from a table.
    Unguard {
        /// `table` or `schema.table`.
        table: String,
        /// Drop the `fence` column too.
        #[arg(long)]
        drop_column: bool,
    },
    /// List guarded tables.
    Tables {
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// List rejected writes (newest first), or prune old ones.
    Audit(AuditArgs),
    /// Manual lock operations.
    Lock {
        #[command(subcommand)]
        action: LockAction,
    },
    /// Run a command under a lock: acquire, export PGFENCE_TOKEN / PGFENCE_RESOURCE, keep the
    /// lease alive while it runs, release, exit with its status.
    Run(RunArgs),
    /// Raise a resource's Redis counter to Postgres's high-water mark (after a failover).
    Reseed {
        /// The resource.
        resource: String,
        /// Raise to this value instead of the high-water mark.
        #[arg(long, allow_negative_numbers = true)]
        floor: Option<i64>,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// Reproduce the lock-expiry race with real servers and show the stale write rejected.
    Simulate(SimulateArgs),
}

#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
struct AuditArgs {
    #[command(subcommand)]
    action: Option<AuditAction>,
    /// Only rejections newer than this: a duration (`1h`, `30m`) or an RFC 3339 time.
    #[arg(long)]
    since: Option<String>,
    /// Only rejections for this resource.
    #[arg(long)]
    resource: Option<String>,
    /// At most this many rows.
    #[arg(long, default_value_t = 50)]
    limit: i64,
    /// JSON output (one array).
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand, Debug)]
enum AuditAction {
    /// Delete audit rows older than a duration.
    Prune {
        /// e.g. `30d`, `12h`.
        #[arg(long, value_parser = util::parse_duration, allow_hyphen_values = true)]
        older_than: Duration,
    },
}

#[derive(Subcommand, Debug)]
enum LockAction {
    /// Take a lock and print its token and owner id.
    Acquire {
        /// The resource.
        resource: String,
        /// Lease TTL (`30s`, `500ms`, `5m`).
        #[arg(long, value_parser = util::parse_duration, allow_hyphen_values = true)]
        ttl: Duration,
        /// Wait up to this long for the lock instead of failing at once.
        #[arg(long, value_parser = util::parse_duration, allow_hyphen_values = true)]
        wait: Option<Duration>,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// Release a lock taken by `lock acquire` (needs its owner id and token).
    Release {
        /// The resource.
        resource: String,
        /// Owner id printed by `lock acquire`.
        #[arg(long)]
        owner: String,
        /// Token printed by `lock acquire`.
        #[arg(long)]
        token: String,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// Show a lock's holder, token, TTL and counter.
    Status {
        /// The resource.
        resource: String,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args, Debug)]
struct RunArgs {
    /// The resource to lock.
    #[arg(long)]
    resource: String,
    /// Lease TTL; renewed every TTL/3 while the command runs.
    #[arg(long, value_parser = util::parse_duration, allow_hyphen_values = true)]
    ttl: Duration,
    /// Wait up to this long for the lock (default: fail at once if held).
    #[arg(long, value_parser = util::parse_duration, allow_hyphen_values = true)]
    wait: Option<Duration>,
    /// The command and its arguments.
    #[arg(last = true, required = true, value_name = "CMD")]
    command: Vec<String>,
}

#[derive(Args, Debug)]
struct SimulateArgs {
    /// Run the same race with plain, unfenced writes, to see the damage.
    #[arg(long)]
    no_fence: bool,
    /// Print a Mermaid sequence diagram of the run instead of the timeline.
    #[arg(long)]
    mermaid: bool,
    /// Lock TTL.
    #[arg(long, default_value = "300ms", value_parser = util::parse_duration)]
    ttl: Duration,
    /// How long worker A pauses (must exceed the TTL for the race to happen).
    #[arg(long, default_value = "700ms", value_parser = util::parse_duration)]
    pause: Duration,
}

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
    let outcome = if matches!(cli.command, Command::Run(_)) {
        // `run` handles signals itself: it must release the lock after the command exits.
        dispatch(cli).await
    } else {
        tokio::select! {
            outcome = dispatch(cli) => outcome,
            // Dropping the command's future drops any throwaway servers, which stops them.
            _ = tokio::signal::ctrl_c() => {
                eprintln!("pgfence: interrupted");
                return ExitCode::from(130);
            }
        }
    };
    match outcome {
        Ok(code) => code,
        Err(e) => {
            eprintln!("pgfence: {}", util::one_line(&e));
            ExitCode::FAILURE
        }
    }
}

async fn dispatch(cli: Cli) -> anyhow::Result<ExitCode> {
    let conn = cli.conn;
    match cli.command {
        Command::Migrate { status } => commands::migrate(&conn, status).await,
        Command::Guard {
            table,
            emit_migration,
        } => commands::guard(&conn, &table, emit_migration.as_deref()).await,
        Command::Unguard { table, drop_column } => {
            commands::unguard(&conn, &table, drop_column).await
        }
        Command::Tables { json } => commands::tables(&conn, json).await,
        Command::Audit(args) => match args.action {
            Some(AuditAction::Prune { older_than }) => {
                commands::audit_prune(&conn, older_than).await
            }
            None => {
                commands::audit(
                    &conn,
                    args.since.as_deref(),
                    args.resource,
                    args.limit,
                    args.json,
                )
                .await
            }
        },
        Command::Lock { action } => match action {
            LockAction::Acquire {
                resource,
                ttl,
                wait,
                json,
            } => commands::lock_acquire(&conn, &resource, ttl, wait, json).await,
            LockAction::Release {
                resource,
                owner,
                token,
                json,
            } => commands::lock_release(&conn, &resource, &owner, &token, json).await,
            LockAction::Status { resource, json } => {
                commands::lock_status(&conn, &resource, json).await
            }
        },
        Command::Run(args) => {
            run::run(&conn, &args.resource, args.ttl, args.wait, &args.command).await
        }
        Command::Reseed {
            resource,
            floor,
            json,
        } => commands::reseed(&conn, &resource, floor, json).await,
        Command::Simulate(args) => simulate::simulate(&conn, &args).await,
    }
}
