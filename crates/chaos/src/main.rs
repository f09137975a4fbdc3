//! The race harness at any size, with faults, against real servers.
//!
//! ```text
//! cargo run --release -p pgfence-chaos -- --workers 16 --attempts 20000 \
//!     --reset-counter-at 8000 --kill-every-ms 200 --restart-redis-at 12000 \
//!     --restart-postgres-at 16000 --control
//! ```
//!
//! `--issuer redis|etcd|zk|postgres` picks the token issuer (default: from `--issuer-url`'s
//! scheme, else Redis). Without `--database-url` / `--issuer-url` / `--redis-url` (or
//! `DATABASE_URL` / `PGFENCE_ISSUER_URL` / `REDIS_URL`) it starts throwaway PostgreSQL and
//! issuer servers from the installed binaries, which the restart and failover faults need.
//! `--issuer postgres` is the [`pgfence::issuer::PgIssuer`] on the harness's own database (no other
//! server): `--restart-postgres-at` restarts the issuer with the database, and
//! `--kill-every-ms` terminates the issuer's backends along with the workers'. The Redis-only
//! faults and `--failover-at` are refused for it:
//!
//! ```text
//! cargo run --release -p pgfence-chaos -- --issuer postgres --workers 16 --attempts 10000 \
//!     --rows 16 --kill-every-ms 200 --restart-postgres-at 5000 --all-modes
//! ```
//!
//! Each run prints a readable summary and one JSON line (`--json` prints only the JSON). The
//! exit status is 1 when a protected run shows a violation or a lost update, when the
//! unfenced control shows none (the harness would then prove nothing), when an `effects` run
//! charged some invoice twice at the provider or `effects-unkeyed` (its control) charged none
//! twice, when a `leaseless` run had no `fence = fence + 1` refused or no bypass applied (its
//! lease-less writers did not interleave), when a requested failover did not happen or some
//! row never wrote again after it, or when etcd or ZooKeeper issued a token after a failover
//! that was not above every token accepted before it.
//!
//! `--failover-at N` fails the issuer over for real at unit N: etcd and ZooKeeper run as three
//! members and the leader is killed (`SIGKILL`); Redis runs as a master, a replica and three
//! sentinels, the replica is paused and cut off `--failover-lag` units earlier (it misses those
//! `INCR`s), then the master is killed and the replica promoted with counters that are behind.
//! A fresh deployment is started for each mode.
//!
//! ```text
//! cargo run --release -p pgfence-chaos -- --issuer etcd --workers 16 --attempts 4000 \
//!     --rows 16 --kill-every-ms 200 --failover-at 2000 --restart-postgres-at 3000
//! ```
//!
//! `--pg-failover-at N` fails the harness's own PostgreSQL over: it runs as a primary and an
//! asynchronous standby behind a stable address (a proxy, like a virtual IP); at unit N the
//! standby is cut off, the workers write on for `--pg-failover-lag-ms` (acknowledged commits
//! the standby never gets), then the primary is `SIGKILL`ed and the standby promoted behind
//! the same address. The report counts the writes the database lost apart from what fencing
//! let through: no violation and no lost update among the writes the new primary kept, and no
//! lease from before the promotion may write after it (a zombie write is a violation; pgfence
//! refuses it with `FencedByFailover`). Works with every issuer; the PostgreSQL issuer's
//! counters roll back with the database (the report says so). Needs the throwaway database:
//!
//! ```text
//! cargo run --release -p pgfence-chaos -- --workers 8 --attempts 2000 --rows 4 \
//!     --pause-prob 0.2 --pg-failover-at 1000
//! ```
//!
//! The effects modes run a job with a side effect outside PostgreSQL against a payment
//! provider on loopback (real HTTP, honouring `Idempotency-Key`): claim the row's next
//! invoice, record the charge in the effect ledger ([`pgfence::Effects`]), call the provider
//! with the ledger's key, then record the outcome and mark the invoice paid in one
//! transaction — with most stalls between the ledger and the call, so zombies call late.
//! `effects` must charge no invoice twice (counted at the provider); `effects-unkeyed` sends
//! `<item>-<token>` as the key instead (the classic mistake) and must charge some twice:
//!
//! ```text
//! cargo run --release -p pgfence-chaos -- --mode effects --control --workers 16 \
//!     --attempts 5000 --rows 16 --kill-every-ms 200 --restart-postgres-at 2500
//! ```
//!
//! Leaseless mode (`--mode leaseless`) runs row-claim's leases with `--leaseless-writers`
//! lease-less writers on the same rows (a write every 0–2 × `--leaseless-every-ms`;
//! `--bypass-share` of them audited bypasses, the others `fence = fence + 1`, which must be
//! refused): no violation and no lost update of either kind:
//!
//! ```text
//! cargo run --release -p pgfence-chaos -- --mode leaseless --workers 16 --attempts 20000 \
//!     --rows 16 --reset-counter-at 6000 --kill-every-ms 200 --restart-redis-at 10000 \
//!     --restart-postgres-at 14000
//! ```
//!
//! `--coalesce` (row-claim and leaseless) sends the updates a unit makes alone in a
//! transaction through one shared `pgfence::repository::Coalescer`, each write's history row inserted by a
//! trigger in the coalesced statement; the fenced modes refuse it, saying why:
//!
//! ```text
//! cargo run --release -p pgfence-chaos -- --mode row-claim --coalesce --control --workers 32 \
//!     --attempts 20000 --rows 64 --kill-every-ms 200 --reset-counter-at 6000
//! ```
//!
//! `--partition-groups N` splits the workers into N groups, each reaching PostgreSQL through
//! its own loopback proxy, and black-holes (`--black-hole-ms MIN MAX`; `--one-way-share` of
//! them in one direction only) or resets (`--reset-share`) one group about every
//! `--partition-every-ms`; `--history PATH` writes each
//! run's history as JSON lines (docs/proof.md, "History format"):
//!
//! ```sh
//! cargo run --release -p pgfence-chaos -- --workers 8 --rows 4 --attempts 3000 \
//!     --pause-prob 0 --partition-groups 2 --partition-every-ms 150 --black-hole-ms 100 250 \
//!     --control --history /tmp/partitions.jsonl
//! ```
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
use clap::parser::ValueSource;
use clap::{CommandFactory as _, FromArgMatches as _, Parser};
use pgfence::issuer::IssuerKind;
use pgfence_chaos::{
    Config, Control, Deployment, FailoverEvent, Harness, Mode, Partitions, PgFailoverEvent,
    Recovery, ReseedCounter, Summary, Target, issuer_of_url, parse_issuer, pg_failover_at,
};
use pgfence_testkit::{PgReplicaSet, Replication, Server};
use sqlx::postgres::PgConnectOptions;

/// Race harness: N workers, K rows, stalls past the TTL, injected faults (counter loss,
/// killed backends, restarts, a real issuer failover) against the Redis, etcd, ZooKeeper or
/// PostgreSQL issuer; checks token order, lost updates and the audit trail afterwards.
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
    /// The token issuer: redis, etcd, zk (ZooKeeper) or postgres (pgfence's PgIssuer on the
    /// harness's own database). Default: the scheme of --issuer-url, else redis.
    #[arg(long, value_parser = parse_issuer)]
    issuer: Option<IssuerKind>,
    /// Lease TTL in milliseconds [default: 40; etcd: 1000, its leases count whole seconds].
    #[arg(long)]
    ttl_ms: Option<u64>,
    /// Probability that a unit stalls once (before its read or between read and write).
    #[arg(long, default_value_t = 0.05)]
    pause_prob: f64,
    /// Shortest stall, ms [default: 60; etcd: 1600].
    #[arg(long)]
    pause_min_ms: Option<u64>,
    /// Longest stall, ms [default: 120; etcd: 2400].
    #[arg(long)]
    pause_max_ms: Option<u64>,
    /// fenced (check + read + fenced write in one transaction), fenced-multi (the same in 2–3
    /// transactions of one lease), row-claim (claim, then 2–4 fenced updates over 1–3
    /// transactions), batch (claim_many, then update_many, of 10–100 rows of a group under
    /// one lease), effects (claim the row's next invoice, record the charge in the effect
    /// ledger, call an HTTP payment provider with the ledger's idempotency key, record the
    /// outcome + mark the invoice paid), leaseless (row-claim's leases with lease-less writers
    /// on the same rows: `fence = fence + 1`, which must be refused, and audited bypasses,
    /// which seal the row), row-fence, unfenced (the database control) or effects-unkeyed
    /// (effects with a key per lease: the provider control).
    #[arg(long, default_value = "fenced")]
    mode: Mode,
    /// Also run the control with the same settings (and faults): unfenced, or for
    /// --mode effects effects-unkeyed.
    #[arg(long)]
    control: bool,
    /// Run all nine modes in turn (the controls last).
    #[arg(long)]
    all_modes: bool,
    /// Effects modes: how long the payment provider takes to answer a charge, ms.
    #[arg(long, default_value_t = 10)]
    provider_latency_ms: u64,
    /// Leaseless mode: lease-less writers next to the workers.
    #[arg(long, default_value_t = 2)]
    leaseless_writers: usize,
    /// Leaseless mode: mean pause between two writes of one lease-less writer, ms.
    #[arg(long, default_value_t = 4)]
    leaseless_every_ms: u64,
    /// Leaseless mode: share of lease-less writes that are bypasses (the others are
    /// `fence = fence + 1`).
    #[arg(long, default_value_t = 0.5)]
    bypass_share: f64,
    /// Write each run's history as JSON lines (format: docs/proof.md, "History format") to
    /// PATH; with several modes (--control, --all-modes) to PATH.<mode>, one file per run.
    #[arg(long, value_name = "PATH")]
    history: Option<std::path::PathBuf>,
    /// Partitions: split the workers into this many groups, each reaching PostgreSQL through
    /// its own loopback proxy, and black-hole or reset one group at a time (the database must
    /// be on 127.0.0.1).
    #[arg(long)]
    partition_groups: Option<usize>,
    /// Partitions: mean time between two partitions, ms.
    #[arg(long, default_value_t = 400)]
    partition_every_ms: u64,
    /// Partitions: shortest and longest black-hole, ms.
    #[arg(long, num_args = 2, value_names = ["MIN", "MAX"], default_values_t = [100, 300])]
    black_hole_ms: Vec<u64>,
    /// Partitions: share of partitions that reset the group's connections instead of
    /// black-holing them.
    #[arg(long, default_value_t = 0.3)]
    reset_share: f64,
    /// Partitions: share of black-holes that stop one direction only (requests to
    /// PostgreSQL, or its replies, drawn half and half): one-way partitions.
    #[arg(long, default_value_t = 0.0)]
    one_way_share: f64,
    /// Delete every Redis counter when this unit starts (repeatable). Redis only, through a
    /// redis:// URL.
    #[arg(long)]
    reset_counter_at: Vec<u64>,
    /// Terminate a busy worker backend about this often (ms); with --issuer postgres also one
    /// of the issuer's backends each time.
    #[arg(long)]
    kill_every_ms: Option<u64>,
    /// Restart the throwaway Redis (it comes back empty) when this many units have started.
    /// Redis only.
    #[arg(long)]
    restart_redis_at: Option<u64>,
    /// Restart the throwaway PostgreSQL when this many units have started (with --issuer
    /// postgres, the issuer's server too).
    #[arg(long)]
    restart_postgres_at: Option<u64>,
    /// Fail the issuer over for real when this many units have started: SIGKILL of the etcd or
    /// ZooKeeper leader (of three members), or of the Redis master once its replica has missed
    /// --failover-lag units' INCRs (then the sentinels promote the replica). Needs the
    /// throwaway deployment (no issuer URL). Not for --issuer postgres.
    #[arg(long)]
    failover_at: Option<u64>,
    /// Redis --failover-at: pause the replica and cut its link this many units before the
    /// master is killed, so the promoted replica's counters are behind.
    #[arg(long, default_value_t = 500)]
    failover_lag: u64,
    /// Fail the harness's own PostgreSQL over when this many units have started: it runs as a
    /// primary and an asynchronous standby behind a stable address (a proxy); the standby is
    /// cut off, the workers write on for --pg-failover-lag-ms (acknowledged commits the
    /// standby never gets), then the primary is SIGKILLed and the standby promoted. Units
    /// caught by the outage retry with their old leases. Needs the throwaway database (no
    /// --database-url / DATABASE_URL); a fresh pair per mode.
    #[arg(long)]
    pg_failover_at: Option<u64>,
    /// --pg-failover-at: how long the workers write after the standby is cut off, ms.
    #[arg(long, default_value_t = 300)]
    pg_failover_lag_ms: u64,
    /// Do not give the issuer a floor source (no automatic reseed after counter loss). Redis
    /// only.
    #[arg(long)]
    no_floor_source: bool,
    /// Do not call `recover_from` after a rejection. Redis only.
    #[arg(long)]
    no_recover_from: bool,
    /// Idle expiry of the issuer's counters, in ms (Redis and the PostgreSQL issuer; at least
    /// 1000): rows no lease used for this long past the last lease's TTL lose their counter
    /// while the other rows' leases run (docs/issuers.md, "Idle expiry").
    #[arg(long)]
    idle_expiry_ms: Option<u64>,
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
    /// Send each fenced update a unit makes outside a transaction through one shared
    /// pgfence::repository::Coalescer (row-claim and leaseless; half their units then give each update a
    /// transaction of its own): concurrent units' updates go as one statement when they queue
    /// up. With --control or --all-modes, the modes that cannot coalesce run without it.
    #[arg(long)]
    coalesce: bool,
    /// Stop starting units after this many seconds.
    #[arg(long, default_value_t = 900)]
    max_seconds: u64,
    /// Seed of the workers' random choices.
    #[arg(long, default_value_t = 0x5eed)]
    seed: u64,
    /// PostgreSQL URL (default: a throwaway server). With --issuer postgres, the issuer's too.
    #[arg(long, env = "DATABASE_URL")]
    database_url: Option<String>,
    /// Issuer URL: redis://, redis+sentinel://HOST:PORT,.../MASTER, etcd://HOST:PORT,... or
    /// zk://HOST:PORT,... (default: throwaway servers for --issuer). The postgres issuer
    /// always uses the database (a postgres:// URL here must be --database-url's).
    #[arg(long, env = "PGFENCE_ISSUER_URL")]
    issuer_url: Option<String>,
    /// Redis URL for --issuer redis (the same as --issuer-url; default: a throwaway server).
    #[arg(long, env = "REDIS_URL")]
    redis_url: Option<String>,
    /// Print only the JSON lines.
    #[arg(long)]
    json: bool,
}

/// The issuer to run against, and its URL (`None`: throwaway servers; for PostgreSQL always
/// `None`: the issuer is the harness's database, whatever URL that has).
struct IssuerChoice {
    kind: IssuerKind,
    url: Option<String>,
}

impl IssuerChoice {
    /// Picks the issuer from `--issuer` and the URLs, and refuses what it cannot do.
    /// `on_cli(id)`: whether the argument was given on the command line (not from the
    /// environment).
    fn resolve(args: &Args, on_cli: impl Fn(&str) -> bool) -> anyhow::Result<Self> {
        let url_name = if on_cli("issuer_url") {
            "--issuer-url"
        } else {
            "PGFENCE_ISSUER_URL"
        };
        let url_kind = match &args.issuer_url {
            Some(url) => Some(issuer_of_url(url).with_context(|| {
                format!(
                    "{url_name} {url:?}: unknown scheme (expected redis://, rediss://, \
                     redis+sentinel://, etcd://, zk://, postgres:// or postgresql://)"
                )
            })?),
            None => None,
        };
        let kind = match (args.issuer, url_kind) {
            (Some(k), Some(u)) if k != u => {
                bail!("--issuer {k}, but {url_name} is a {u} URL")
            }
            (Some(k), _) => k,
            (None, Some(u)) => u,
            (None, None) => IssuerKind::Redis,
        };
        if on_cli("redis_url") {
            if kind == IssuerKind::Postgres {
                bail!(
                    "--redis-url is for --issuer redis; the postgres issuer runs on the \
                     harness's database (--database-url)"
                );
            }
            if kind != IssuerKind::Redis {
                bail!("--redis-url is for --issuer redis; give the {kind} URL with --issuer-url");
            }
            if on_cli("issuer_url") {
                bail!("give the Redis URL once: --issuer-url or --redis-url");
            }
        }
        let url = match (&args.issuer_url, kind) {
            // The issuer is the harness's database: a URL for it must be the database's.
            (Some(url), IssuerKind::Postgres) => {
                if args.database_url.as_deref() != Some(url.as_str()) {
                    bail!(
                        "the postgres issuer runs on the harness's own database: give that with \
                         --database-url (or DATABASE_URL) and drop {url_name}, or make them \
                         the same URL"
                    );
                }
                None
            }
            (Some(url), _) => Some(url.clone()),
            (None, IssuerKind::Redis) => args.redis_url.clone(),
            (None, _) => None,
        };
        let choice = Self { kind, url };
        choice.check(args)?;
        Ok(choice)
    }

    /// Refuses the faults and settings this issuer (or deployment) cannot do.
    fn check(&self, args: &Args) -> anyhow::Result<()> {
        let kind = self.kind;
        if kind != IssuerKind::Redis {
            let (tokens, instead) = match kind {
                IssuerKind::Etcd => ("revisions", "--failover-at"),
                IssuerKind::Postgres => (
                    "counter rows that commit with the fences",
                    "--restart-postgres-at or --kill-every-ms",
                ),
                _ => ("zxids", "--failover-at"),
            };
            if !args.reset_counter_at.is_empty() {
                bail!(
                    "--reset-counter-at deletes Redis counter keys: the {kind} issuer has none \
                     (its tokens are {tokens}, which never go backwards); use {instead}"
                );
            }
            if args.restart_redis_at.is_some() {
                bail!(
                    "--restart-redis-at restarts the throwaway Redis; with --issuer {kind} use {instead}"
                );
            }
            if args.no_floor_source || args.no_recover_from {
                bail!(
                    "--no-floor-source and --no-recover-from are Redis settings: {kind} {tokens} \
                     never go backwards, there is nothing to reseed or recover"
                );
            }
        }
        if args.failover_at.is_some() {
            if kind == IssuerKind::Postgres {
                bail!(
                    "--failover-at with --issuer postgres: the issuer lives in the harness's \
                     database and has no leader of its own to kill; fail the database over \
                     with --pg-failover-at (or use --restart-postgres-at and --kill-every-ms)"
                );
            }
            if self.url.is_some() {
                bail!(
                    "--failover-at kills the issuer's leader, so it needs the throwaway \
                     deployment: drop --issuer-url / --redis-url (and unset PGFENCE_ISSUER_URL \
                     / REDIS_URL)"
                );
            }
            if args.restart_redis_at.is_some() {
                bail!(
                    "--restart-redis-at with --failover-at: the failover runs Redis as master, \
                     replica and sentinels, with no single server to restart; pick one"
                );
            }
            if !args.reset_counter_at.is_empty() {
                bail!(
                    "--reset-counter-at with --failover-at: the issuer then connects through \
                     the sentinels (redis+sentinel://), and counter resets need one redis:// \
                     server; pick one"
                );
            }
        }
        if args.pg_failover_at.is_some() {
            check_pg_failover(args)?;
        }
        if args.coalesce && !args.all_modes && !args.mode.can_coalesce() {
            bail!(
                "--coalesce with --mode {}: {}",
                args.mode,
                args.mode.why_not_coalesced()
            );
        }
        if args.restart_redis_at.is_some() && self.url.is_some() {
            bail!("--restart-redis-at needs the throwaway Redis (no --redis-url / --issuer-url)");
        }
        Ok(())
    }
}

/// Refuses what a database failover (`--pg-failover-at`) cannot be combined with.
fn check_pg_failover(args: &Args) -> anyhow::Result<()> {
    if args.database_url.is_some() {
        bail!(
            "--pg-failover-at kills the database's primary and promotes its standby, so it needs \
             its own throwaway primary and standby: drop --database-url (and unset DATABASE_URL); \
             an existing server cannot be failed over from here"
        );
    }
    if args.restart_postgres_at.is_some() {
        bail!(
            "--restart-postgres-at with --pg-failover-at: the database is a primary and a \
             standby, with no single server to restart; pick one"
        );
    }
    if args.failover_at.is_some() {
        bail!(
            "--failover-at with --pg-failover-at: fail over the issuer or the database in one \
             run, not both (their figures would mix); pick one"
        );
    }
    let modes: Vec<Mode> = if args.all_modes {
        Mode::ALL.to_vec()
    } else {
        vec![args.mode]
    };
    for mode in modes {
        if mode.calls_provider() || mode == Mode::LeaselessMix {
            bail!(
                "--pg-failover-at with --mode {mode}: its provider charges and lease-less writes \
                 are not checked against a database that lost commits; use fenced, \
                 fenced-multi, row-claim, batch, row-fence or unfenced"
            );
        }
    }
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let matches = Args::command().get_matches();
    let args = Args::from_arg_matches(&matches)?;
    let on_cli = |id: &str| matches.value_source(id) == Some(ValueSource::CommandLine);
    let issuer = IssuerChoice::resolve(&args, on_cli)?;
    let reseeds = ReseedCounter::install_global()?;

    // With --pg-failover-at each mode gets its own replica set (below).
    let mut pg = match (&args.database_url, args.pg_failover_at) {
        (None, None) => Some(Server::postgres().await.context("throwaway PostgreSQL")?),
        _ => None,
    };
    if args.restart_postgres_at.is_some() && pg.is_none() {
        bail!("--restart-postgres-at needs the throwaway PostgreSQL (no --database-url)");
    }
    // One deployment for every mode, unless each mode gets a fresh one to fail over (the
    // postgres issuer has none: it is the database).
    let mut shared = match (&issuer.url, args.failover_at) {
        (None, None) if issuer.kind != IssuerKind::Postgres => Some(
            Deployment::start(issuer.kind, false)
                .await
                .with_context(|| format!("throwaway {} server", issuer.kind))?,
        ),
        _ => None,
    };
    let shared_database_url = args
        .database_url
        .clone()
        .or_else(|| pg.as_ref().map(Server::url));

    let modes: Vec<Mode> = if args.all_modes {
        Mode::ALL.to_vec()
    } else if let Some(control) = args.mode.control().filter(|_| args.control) {
        vec![args.mode, control]
    } else {
        vec![args.mode]
    };

    let mut ok = true;
    let several = modes.len() > 1;
    for mode in modes {
        let fresh = match args.failover_at {
            Some(_) => Some(
                Deployment::start(issuer.kind, true)
                    .await
                    .with_context(|| {
                        format!("throwaway {} deployment to fail over", issuer.kind)
                    })?,
            ),
            None => None,
        };
        let mut pair = match args.pg_failover_at {
            Some(_) => Some(
                PgReplicaSet::start(Replication::Async)
                    .await
                    .context("throwaway PostgreSQL primary and standby to fail over")?,
            ),
            None => None,
        };
        let database_url = match &pair {
            Some(set) => set.url(),
            None => shared_database_url.clone().context("no database")?,
        };
        let database = PgConnectOptions::from_str(&database_url).context("database URL")?;
        let issuer_url = if issuer.kind == IssuerKind::Postgres {
            database_url.clone()
        } else {
            issuer
                .url
                .clone()
                .or_else(|| fresh.as_ref().or(shared.as_ref()).map(Deployment::url))
                .context("no issuer")?
        };
        let target = Target {
            database: database.clone(),
            issuer_url,
        };
        let mut cfg = config(&args, issuer.kind, mode);
        cfg.history = args.history.as_ref().map(|p| {
            if several {
                let mut name = p.clone().into_os_string();
                name.push(format!(".{mode}"));
                std::path::PathBuf::from(name)
            } else {
                p.clone()
            }
        });
        let mut harness = Harness::new(cfg, &target).await?;
        if harness.issuer_kind().can_reseed() {
            harness = harness.with_reseed_counter(reseeds.clone())?;
        }
        let ctl = harness.control();
        // One task per fault: a restart that is slow to be seen going down (the testkit waits
        // up to 30 s for that) must not hold back the other faults.
        let pg_restart = tokio::spawn(restart_postgres_at(
            ctl.clone(),
            pg.take(),
            args.restart_postgres_at,
        ));
        let redis_restart = tokio::spawn(restart_redis_at(
            ctl.clone(),
            shared.take(),
            args.restart_redis_at,
        ));
        let failover = tokio::spawn(failover_at(
            ctl.clone(),
            fresh,
            args.failover_at,
            args.failover_lag,
        ));
        let pg_failover = tokio::spawn(pg_failover_task(
            ctl.clone(),
            pair.take(),
            args.pg_failover_at,
            Duration::from_millis(args.pg_failover_lag_ms),
        ));
        let report = harness.run().await?;
        let (pair, pg_event) = pg_failover.await.context("database failover task")?;
        drop(pair);
        pg = pg_restart.await.context("restart task")?;
        shared = redis_restart.await.context("restart task")?;
        let (fresh, event) = failover.await.context("failover task")?;
        drop(fresh);
        print(&report.summary, args.json);
        let mut proves = match mode {
            Mode::Unfenced => !report.summary.is_safe(),
            // The row fence alone guarantees token order, not read-modify-write atomicity.
            Mode::RowFence => report.summary.violations == 0,
            Mode::Effects | Mode::EffectsUnkeyed => effects_prove(&report.summary),
            Mode::LeaselessMix => leaseless_prove(&report.summary),
            _ => report.summary.is_safe(),
        };
        if let Some(at) = args.pg_failover_at {
            proves &= pg_failover_proves(&report.summary, at, pg_event);
        }
        if let Some(at) = args.failover_at {
            match event {
                Ok(Some(_)) => {}
                Ok(None) => {
                    eprintln!("no failover: the run ended before unit {at}");
                    proves = false;
                }
                Err(e) => {
                    eprintln!("the failover failed: {e:#}");
                    proves = false;
                }
            }
            if let Some(f) = &report.summary.failover {
                // etcd revisions and ZooKeeper zxids never go backwards, failover or not.
                if issuer.kind != IssuerKind::Redis
                    && (f.tokens_increased == Some(false) || f.resources_backwards > 0)
                {
                    eprintln!("{} tokens went backwards across the failover", issuer.kind);
                    proves = false;
                }
                // Liveness: every row must write again after it.
                if f.rows_recovered < f.rows {
                    eprintln!(
                        "only {}/{} rows wrote again after the failover",
                        f.rows_recovered, f.rows
                    );
                    proves = false;
                }
            }
        }
        ok &= proves;
    }
    if let Some(s) = pg {
        s.stop();
    }
    if let Some(d) = shared {
        d.stop();
    }
    if !ok {
        std::process::exit(1);
    }
    Ok(())
}

/// Whether an effects run proves what it is for: its database writes are fenced (safe) either
/// way; with the ledger's keys no invoice is charged twice at the provider (and every paid
/// one was charged); with a key per lease (the control) some invoice must be charged twice,
/// or the run could not have caught a duplicate.
fn effects_prove(summary: &Summary) -> bool {
    let Some(e) = &summary.effects else {
        eprintln!("{} run without effect figures", summary.mode);
        return false;
    };
    let mut ok = summary.is_safe();
    if !ok {
        eprintln!("{}: the fenced database writes are not safe", summary.mode);
    }
    if summary.mode == Mode::Effects {
        if !e.exactly_once() {
            eprintln!(
                "effects: {} items charged more than once, {} paid but never charged, {} stray \
                 charges at the provider",
                e.duplicate_effects, e.paid_uncharged, e.stray_charges
            );
            ok = false;
        }
    } else if e.duplicate_effects == 0 {
        eprintln!(
            "effects-unkeyed: no item was charged twice ({} late calls): the control proves \
             nothing (more stalls or units?)",
            e.late_calls
        );
        ok = false;
    }
    ok
}

/// Whether a leaseless run proves what it is for: safe (no violation — no `fence + 1` went
/// through, no sealed lease wrote — and no lost update of either kind), and the lease-less
/// writes really interleaved: some `fence + 1` refused, some bypass applied.
fn leaseless_prove(summary: &Summary) -> bool {
    let Some(l) = &summary.leaseless else {
        eprintln!("{} run without lease-less figures", summary.mode);
        return false;
    };
    let mut ok = summary.is_safe();
    if !ok {
        eprintln!(
            "leaseless: not safe ({} fence + 1 accepted, {} writes by sealed leases, {} lease \
             increments and {} bypass increments lost)",
            l.fence_plus_one_accepted,
            l.sealed_writes,
            l.lost_lease_increments,
            l.lost_bypass_increments
        );
    }
    if l.fence_plus_one_refused == 0 || l.bypass_applied == 0 {
        eprintln!(
            "leaseless: {} fence + 1 refused, {} bypasses applied: the lease-less writers did \
             not interleave (more writers, or a shorter --leaseless-every-ms?)",
            l.fence_plus_one_refused, l.bypass_applied
        );
        ok = false;
    }
    ok
}

/// Whether a database failover run proves what it is for: the failover happened, nothing
/// unsafe among the writes the new primary kept (no zombie write: those are violations),
/// every rejection reported as far as the promotion left audit rows, every row writing again.
/// The unfenced control writes without leases' fences, so zombie writes are what it shows:
/// for it only the failover and the recovery count.
fn pg_failover_proves(
    summary: &Summary,
    at: u64,
    event: anyhow::Result<Option<PgFailoverEvent>>,
) -> bool {
    match event {
        Ok(Some(_)) => {}
        Ok(None) => {
            eprintln!("no database failover: the run ended before unit {at} (or before the kill)");
            return false;
        }
        Err(e) => {
            eprintln!("the database failover failed: {e:#}");
            return false;
        }
    }
    let Some(p) = &summary.pg_failover else {
        eprintln!("database failover run without its figures");
        return false;
    };
    let mut ok = true;
    if summary.mode == Mode::Unfenced {
        if p.rows_recovered < p.rows {
            eprintln!(
                "only {}/{} rows wrote again after the promotion",
                p.rows_recovered, p.rows
            );
            ok = false;
        }
        return ok;
    }
    if p.zombie_writes > 0 {
        eprintln!(
            "{} writes by leases from before the promotion got in after it (zombies)",
            p.zombie_writes
        );
        ok = false;
    }
    if !p.rejections_reported() || summary.log_events != summary.rejected {
        eprintln!(
            "rejections not all reported: {} rejected, {} audit rows ({} lost with the promotion, \
             at most {} could be), {} log events",
            summary.rejected,
            summary.audit_rows,
            p.audit_rows_lost,
            p.rejected_before,
            summary.log_events
        );
        ok = false;
    }
    if p.rows_recovered < p.rows {
        eprintln!(
            "only {}/{} rows wrote again after the promotion",
            p.rows_recovered, p.rows
        );
        ok = false;
    }
    if p.acknowledged_lost == 0 {
        eprintln!(
            "note: the promotion lost no acknowledged write (a longer --pg-failover-lag-ms \
             makes it lose some)"
        );
    }
    ok
}

/// Fails the database `pair` over at `unit` ([`pg_failover_at`]); hands the pair back with what
/// happened.
async fn pg_failover_task(
    ctl: Control,
    mut pair: Option<PgReplicaSet>,
    unit: Option<u64>,
    write_for: Duration,
) -> (
    Option<PgReplicaSet>,
    anyhow::Result<Option<PgFailoverEvent>>,
) {
    let event = match (unit, pair.as_mut()) {
        (Some(unit), Some(set)) => pg_failover_at(set, &ctl, unit, write_for)
            .await
            .map_err(Into::into),
        _ => Ok(None),
    };
    (pair, event)
}

/// The run's configuration: the issuer's timing ([`Config::for_issuer`]) unless given.
fn config(args: &Args, issuer: IssuerKind, mode: Mode) -> Config {
    let timing = Config::for_issuer(issuer);
    let ms = |v: Option<u64>, default: Duration| v.map_or(default, Duration::from_millis);
    Config {
        mode,
        workers: args.workers,
        rows: args.rows,
        units: args.attempts,
        ttl: ms(args.ttl_ms, timing.ttl),
        pause_probability: args.pause_prob,
        pause_min: ms(args.pause_min_ms, timing.pause_min),
        pause_max: ms(args.pause_max_ms, timing.pause_max),
        retries: args.retries,
        reset_counters_at: args.reset_counter_at.clone(),
        idle_expiry: args.idle_expiry_ms.map(Duration::from_millis),
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
        provider_latency: Duration::from_millis(args.provider_latency_ms),
        leaseless_writers: args.leaseless_writers,
        leaseless_every: Duration::from_millis(args.leaseless_every_ms),
        bypass_share: args.bypass_share,
        coalesce: args.coalesce && mode.can_coalesce(),
        // Units caught by a database failover retry through it, as jobs do.
        outage_retry: args.pg_failover_at.map(|_| Duration::from_secs(10)),
        partitions: args.partition_groups.map(|groups| Partitions {
            groups,
            every: Duration::from_millis(args.partition_every_ms),
            black_hole_min: Duration::from_millis(args.black_hole_ms[0]),
            black_hole_max: Duration::from_millis(args.black_hole_ms[1]),
            reset_share: args.reset_share,
            one_way_share: args.one_way_share,
        }),
        ..timing
    }
}

/// Restarts `server` (if any) once `unit` units have started, recording the fault as
/// `postgres_restart`; hands the server back when done (or when the run ended first).
async fn restart_postgres_at(
    ctl: Control,
    mut server: Option<Server>,
    unit: Option<u64>,
) -> Option<Server> {
    if let (Some(unit), Some(s)) = (unit, server.as_mut())
        && ctl.wait_for_units(unit).await
    {
        ctl.mark_fault("postgres_restart");
        if let Err(e) = s.restart().await {
            eprintln!("restart failed: {e}");
        }
    }
    server
}

/// Restarts the deployment's single Redis server (if it is one) once `unit` units have
/// started, recording the fault as `redis_restart`; hands the deployment back.
async fn restart_redis_at(
    ctl: Control,
    mut deployment: Option<Deployment>,
    unit: Option<u64>,
) -> Option<Deployment> {
    if let (Some(unit), Some(s)) = (unit, deployment.as_mut().and_then(Deployment::redis_server))
        && ctl.wait_for_units(unit).await
    {
        ctl.mark_fault("redis_restart");
        if let Err(e) = s.restart().await {
            eprintln!("restart failed: {e}");
        }
    }
    deployment
}

/// Fails `deployment` over at `unit` (see [`Deployment::failover_at`]); hands it back with
/// what happened.
async fn failover_at(
    ctl: Control,
    mut deployment: Option<Deployment>,
    unit: Option<u64>,
    lag: u64,
) -> (Option<Deployment>, anyhow::Result<Option<FailoverEvent>>) {
    let event = match (unit, deployment.as_mut()) {
        (Some(unit), Some(d)) => d.failover_at(&ctl, unit, lag).await.map_err(Into::into),
        _ => Ok(None),
    };
    (deployment, event)
}

fn print(summary: &Summary, json_only: bool) {
    if !json_only {
        print!("{summary}");
    }
    println!("{}", summary.json());
}
