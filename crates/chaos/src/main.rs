//! The race harness at any size, with faults, against real servers.
//!
//! ```text
//! cargo run --release -p pgfence-chaos -- --workers 16 --attempts 20000 \
//!     --reset-counter-at 8000 --kill-every-ms 200 --restart-redis-at 12000 \
//!     --restart-postgres-at 16000 --control
//! ```
//!
//! Without `--database-url` / `--redis-url` (or `DATABASE_URL` / `REDIS_URL`) it starts
//! throwaway PostgreSQL and Redis servers from the installed binaries, which the restart faults
//! need. Each run prints a readable summary and one JSON line (`--json` prints only the JSON).
//! The exit status is 1 when a protected run shows a violation or a lost update, or when the
//! unfenced control shows none (the harness would then prove nothing).
//!
//! Batch mode (`--mode batch`) splits the `--rows` counter rows into `--batch-groups` groups,
//! one lock each; a unit claims and writes 10–100 (`--batch-min-rows`, `--batch-max-rows`)
//! rows of its group in one statement each:
//!
//! ```text
//! cargo run --release -p pgfence-chaos -- --mode batch --workers 16 --attempts 2000 \
//!     --rows 256 --batch-groups 2 --reset-counter-at 600 --kill-every-ms 200 \
//!     --restart-redis-at 1000 --restart-postgres-at 1400
//! ```
#![allow(clippy::print_stdout)] // printing the report is this program's job

use std::str::FromStr;
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::Parser;
use pgfence_chaos::{Config, Control, Harness, Mode, Recovery, ReseedCounter, Summary, Target};
use pgfence_testkit::Server;
use sqlx::postgres::PgConnectOptions;

/// Race harness: N workers, K rows, stalls past the TTL, injected faults; checks token order,
/// lost updates and the audit trail afterwards.
#[derive(Parser, Debug)]
#[command(name = "pgfence-chaos")]
struct Args {
    /// Concurrent workers.
    #[arg(long, default_value_t = 16)]
    workers: usize,
    /// Work units (leases that go on to write); retries come on top.
    #[arg(long, default_value_t = 20_000)]
    attempts: u64,
    /// Counter rows (one resource each; in batch mode split into --batch-groups groups).
    #[arg(long, default_value_t = 16)]
    rows: usize,
    /// Lease TTL in milliseconds.
    #[arg(long, default_value_t = 40)]
    ttl_ms: u64,
    /// Probability that a unit stalls once (before its read or between read and write).
    #[arg(long, default_value_t = 0.05)]
    pause_prob: f64,
    /// Shortest stall, ms.
    #[arg(long, default_value_t = 60)]
    pause_min_ms: u64,
    /// Longest stall, ms.
    #[arg(long, default_value_t = 120)]
    pause_max_ms: u64,
    /// fenced (check + read + fenced write in one transaction), fenced-multi (the same in 2–3
    /// transactions of one lease), row-claim (claim, then 2–4 fenced updates over 1–3
    /// transactions), batch (claim_many, then update_many, of 10–100 rows of a group under
    /// one lease), row-fence, or unfenced.
    #[arg(long, default_value = "fenced")]
    mode: Mode,
    /// Also run the unfenced control with the same settings (and faults).
    #[arg(long)]
    control: bool,
    /// Run all six modes in turn.
    #[arg(long)]
    all_modes: bool,
    /// Delete every Redis counter when this unit starts (repeatable).
    #[arg(long)]
    reset_counter_at: Vec<u64>,
    /// Terminate a busy worker backend about this often (ms).
    #[arg(long)]
    kill_every_ms: Option<u64>,
    /// Restart the throwaway Redis (it comes back empty) when this many units have started.
    #[arg(long)]
    restart_redis_at: Option<u64>,
    /// Restart the throwaway PostgreSQL when this many units have started.
    #[arg(long)]
    restart_postgres_at: Option<u64>,
    /// Do not give the issuer a floor source (no automatic reseed after counter loss).
    #[arg(long)]
    no_floor_source: bool,
    /// Do not call `Issuer::recover_from` after a rejection.
    #[arg(long)]
    no_recover_from: bool,
    /// Batch mode: groups of rows, one resource (lock and token counter) each.
    #[arg(long, default_value_t = 1)]
    batch_groups: usize,
    /// Batch mode: fewest rows a unit writes (fewer if its group is smaller).
    #[arg(long, default_value_t = 10)]
    batch_min_rows: usize,
    /// Batch mode: most rows a unit writes.
    #[arg(long, default_value_t = 100)]
    batch_max_rows: usize,
    /// Retries of a unit after a retryable error.
    #[arg(long, default_value_t = 2)]
    retries: u32,
    /// Stop starting units after this many seconds.
    #[arg(long, default_value_t = 900)]
    max_seconds: u64,
    /// Seed of the workers' random choices.
    #[arg(long, default_value_t = 0x5eed)]
    seed: u64,
    /// PostgreSQL URL (default: a throwaway server).
    #[arg(long, env = "DATABASE_URL")]
    database_url: Option<String>,
    /// Redis URL (default: a throwaway server).
    #[arg(long, env = "REDIS_URL")]
    redis_url: Option<String>,
    /// Print only the JSON lines.
    #[arg(long)]
    json: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let reseeds = ReseedCounter::install_global()?;

    let mut pg = match &args.database_url {
        Some(_) => None,
        None => Some(Server::postgres().await.context("throwaway PostgreSQL")?),
    };
    let mut redis = match &args.redis_url {
        Some(_) => None,
        None => Some(Server::redis().await.context("throwaway Redis")?),
    };
    if args.restart_postgres_at.is_some() && pg.is_none() {
        bail!("--restart-postgres-at needs the throwaway PostgreSQL (no --database-url)");
    }
    if args.restart_redis_at.is_some() && redis.is_none() {
        bail!("--restart-redis-at needs the throwaway Redis (no --redis-url)");
    }
    let database_url = args
        .database_url
        .clone()
        .or_else(|| pg.as_ref().map(Server::url))
        .context("no database")?;
    let target = Target {
        database: PgConnectOptions::from_str(&database_url).context("database URL")?,
        redis_url: args
            .redis_url
            .clone()
            .or_else(|| redis.as_ref().map(Server::url))
            .context("no Redis")?,
    };

    let modes: Vec<Mode> = if args.all_modes {
        Mode::ALL.to_vec()
    } else if args.control && args.mode != Mode::Unfenced {
        vec![args.mode, Mode::Unfenced]
    } else {
        vec![args.mode]
    };

    let mut ok = true;
    for mode in modes {
        let cfg = Config {
            mode,
            workers: args.workers,
            rows: args.rows,
            units: args.attempts,
            ttl: Duration::from_millis(args.ttl_ms),
            pause_probability: args.pause_prob,
            pause_min: Duration::from_millis(args.pause_min_ms),
            pause_max: Duration::from_millis(args.pause_max_ms),
            retries: args.retries,
            reset_counters_at: args.reset_counter_at.clone(),
            kill_every: args.kill_every_ms.map(Duration::from_millis),
            recovery: Recovery {
                floor_source: !args.no_floor_source,
                recover_from: !args.no_recover_from,
            },
            max_duration: Duration::from_secs(args.max_seconds),
            seed: args.seed,
            batch_groups: args.batch_groups,
            batch_min_rows: args.batch_min_rows,
            batch_max_rows: args.batch_max_rows,
            ..Config::default()
        };
        let harness = Harness::new(cfg, &target)
            .await?
            .with_reseed_counter(reseeds.clone());
        let ctl = harness.control();
        // One task per server: a restart that is slow to be seen going down (the testkit
        // waits up to 30 s for that) must not hold back the other server's restart.
        let pg_restart = tokio::spawn(restart_at(
            ctl.clone(),
            pg.take(),
            args.restart_postgres_at,
            "postgres_restart",
        ));
        let redis_restart = tokio::spawn(restart_at(
            ctl.clone(),
            redis.take(),
            args.restart_redis_at,
            "redis_restart",
        ));
        let report = harness.run().await?;
        pg = pg_restart.await.context("restart task")?;
        redis = redis_restart.await.context("restart task")?;
        print(&report.summary, args.json);
        let proves = match mode {
            Mode::Unfenced => !report.summary.is_safe(),
            // The row fence alone guarantees token order, not read-modify-write atomicity.
            Mode::RowFence => report.summary.violations == 0,
            _ => report.summary.is_safe(),
        };
        ok &= proves;
    }
    if let Some(s) = pg {
        s.stop();
    }
    if let Some(s) = redis {
        s.stop();
    }
    if !ok {
        std::process::exit(1);
    }
    Ok(())
}

/// Restarts `server` (if any) once `unit` units have started, recording the fault as
/// `name`; hands the server back when done (or when the run ended first).
async fn restart_at(
    ctl: Control,
    mut server: Option<Server>,
    unit: Option<u64>,
    name: &'static str,
) -> Option<Server> {
    if let (Some(unit), Some(s)) = (unit, server.as_mut())
        && ctl.wait_for_units(unit).await
    {
        ctl.mark_fault(name);
        if let Err(e) = s.restart().await {
            eprintln!("restart failed: {e}");
        }
    }
    server
}

fn print(summary: &Summary, json_only: bool) {
    if !json_only {
        print!("{summary}");
    }
    println!("{}", summary.json());
}
