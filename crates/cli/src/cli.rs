//! The command line, as clap derive structs: global options and one variant per command.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::util;

/// The whole command line: where the servers are, `--verbose`, and the command.
#[derive(Parser, Debug)]
#[command(
    name = "pgfence",
    version,
    // The library's one-line description (this package's describes the package).
    about = "Fencing tokens for lease-based locks: a lock service issues the numbers, Postgres enforces them.",
    propagate_version = true
)]
pub struct Cli {
    #[command(flatten)]
    pub conn: Conn,
    /// Show pgfence's own log events (INFO and above) on stderr.
    #[arg(long, short, global = true)]
    pub verbose: bool,
    #[command(subcommand)]
    pub command: Command,
}

/// Where the servers are.
#[derive(Args, Debug, Clone)]
pub struct Conn {
    /// PostgreSQL URL.
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    pub database_url: Option<String>,
    /// Redis URL (the issuer when --issuer-url is not given).
    #[arg(long, env = "REDIS_URL", global = true, hide_env_values = true)]
    pub redis_url: Option<String>,
    /// Token issuer URL: `redis://`, `rediss://`, `redis+sentinel://`, `etcd://host:2379`,
    /// `zk://host:2181` (etcd and ZooKeeper need the CLI built with the `etcd` / `zk` feature)
    /// or `postgres://...` (the PostgreSQL issuer: locks and counters in a migrated database,
    /// usually the one given by --database-url). Defaults to the Redis URL.
    #[arg(
        long,
        env = "PGFENCE_ISSUER_URL",
        global = true,
        hide_env_values = true
    )]
    pub issuer_url: Option<String>,
    /// Prefix of the issuer's keys (`PREFIX:{resource}:lock`, `PREFIX:{resource}:fence`);
    /// default `pgfence`. Applications sharing a Redis with different prefixes share no lock.
    #[arg(long, env = "PGFENCE_KEY_PREFIX", global = true)]
    pub key_prefix: Option<String>,
    /// Idle expiry of the issuer's per-resource state, in seconds (Redis and the PostgreSQL
    /// issuer; docs/issuers.md, "Idle expiry"): a counter no lease used for this long goes.
    /// Default: off (counters are kept for ever). Give every process of a key prefix the same.
    #[arg(
        long,
        env = "PGFENCE_IDLE_EXPIRY",
        global = true,
        value_name = "SECONDS"
    )]
    pub idle_expiry: Option<u64>,
}

/// `guard --emit-migration`'s help. clap turns every `{n}` of a help text into a line break
/// and has no escape for it; an ANSI reset between `{` and `n` (invisible on a terminal,
/// removed from help written to a pipe or file) keeps the file name intact.
const EMIT_MIGRATION_HELP: &str = "Write the guarding migration into this migrations folder instead of touching the database, as the folder's tool names it: sqlx-cli `<version>_guard_<table>.sql` (or `.up.sql` and `.down.sql`), refinery `V{\x1b[0mn}__guard_<table>.sql`; see --migration-format";

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Apply pgfence's schema (the `pgfence` schema and its own migration history).
    Migrate {
        /// Only show which migrations are applied.
        #[arg(long)]
        status: bool,
    },
    /// Guard existing tables: add `fence bigint NOT NULL DEFAULT 0` and the trigger. Several
    /// tables are guarded in one transaction: all of them, or none.
    Guard {
        /// `table` or `schema.table`, as in SQL: unquoted names fold to lower case; double-quote
        /// a part to keep its case or to contain dots. Several: one migration for all of them.
        #[arg(required = true, value_name = "TABLE")]
        tables: Vec<String>,
        // The help is not a doc comment: clap renders `{n}` in help text as a line break.
        #[arg(long, value_name = "DIR", help = EMIT_MIGRATION_HELP)]
        emit_migration: Option<PathBuf>,
        /// The migration tool --emit-migration writes for. By default the one whose files the
        /// folder holds (sqlx: reversible when its latest migration is); an empty folder gets
        /// `sqlx` (sqlx-cli's default: a simple migration, a timestamp version).
        #[arg(long, value_enum, value_name = "TOOL", requires = "emit_migration")]
        migration_format: Option<MigrationFormat>,
        /// Report-only mode: let updates that do not advance the fence through, recording
        /// each in `pgfence audit` (operation `observe`, role, application_name) with a
        /// PostgreSQL WARNING. For rolling pgfence out.
        #[arg(long, conflicts_with = "enforce")]
        observe: bool,
        /// Enforce (the default): reject updates that do not advance the fence; switches a
        /// table in observe mode to enforcing.
        #[arg(long)]
        enforce: bool,
        /// How long to wait, in all, for the table lock (an open transaction that wrote the
        /// table holds it off); tried a few times within this.
        #[arg(long, default_value = "5s", value_parser = util::parse_duration, allow_hyphen_values = true)]
        lock_timeout: Duration,
    },
    /// Remove the guard trigger from tables (several: in one transaction, all or none).
    Unguard {
        /// `table` or `schema.table` (unquoted names fold to lower case).
        #[arg(required = true, value_name = "TABLE")]
        tables: Vec<String>,
        /// Drop the `fence` column too.
        #[arg(long)]
        drop_column: bool,
        /// How long to wait, in all, for the table lock.
        #[arg(long, default_value = "5s", value_parser = util::parse_duration, allow_hyphen_values = true)]
        lock_timeout: Duration,
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
    /// Run a command under a lock: acquire, give the command the lease in `PGFENCE_*`
    /// environment variables, keep the lease alive while it runs, release, exit with its status.
    #[command(after_help = crate::commands::run::env_help())]
    Run(RunArgs),
    /// Raise a resource's Redis counter to Postgres's high-water mark (after a failover; a
    /// no-op with an etcd or ZooKeeper issuer, whose tokens never go backwards).
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
    /// Give an application role exactly the privileges on pgfence's schema that an
    /// application needs (run as the schema's owner, after `migrate`).
    Grant {
        /// The role, as in SQL: unquoted names fold to lower case; double-quote to keep case.
        role: String,
        /// Also set the role's default `idle_in_transaction_session_timeout` in this database
        /// (e.g. 30s, your longest lease TTL): PostgreSQL ends a transaction of the role that
        /// sits idle longer, so a worker paused inside one releases its row locks. `0s`
        /// removes the role's setting. Needs CREATEROLE (or superuser). docs/operations.md,
        /// "A paused lease's transaction".
        #[arg(long, value_parser = util::parse_duration, value_name = "DURATION")]
        idle_in_transaction_timeout: Option<std::time::Duration>,
    },
    /// The effect ledger, for calls outside PostgreSQL (a payment provider) from jobs under
    /// `pgfence run`: record a call and get its idempotency key, record its outcome.
    Effect {
        #[command(subcommand)]
        action: EffectAction,
    },
    /// Reproduce the lock-expiry race with real servers and show the stale write rejected.
    Simulate(SimulateArgs),
    /// Check the setup: schema migrated, guard triggers present and enabled, fence columns,
    /// Redis counters not below Postgres's marks, tokens near the limit, old audit rows.
    /// Exit 0 when clean, 1 when anything but info was found (or doctor could not run).
    Doctor(DoctorArgs),
}

/// `guard --migration-format`: the migration tool whose file `--emit-migration` writes.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum MigrationFormat {
    /// sqlx-cli (`sqlx migrate run`, `sqlx::migrate!`): one file, `<version>_guard_<table>.sql`.
    Sqlx,
    /// sqlx-cli, reversible: `<version>_guard_<table>.up.sql` and `.down.sql` (the down
    /// migration unguards and keeps the `fence` column).
    SqlxReversible,
    /// refinery: `V<n>__guard_<table>.sql`.
    Refinery,
}

#[derive(Args, Debug)]
pub struct DoctorArgs {
    /// JSON output: `{"ok": bool, "findings": [...]}`.
    #[arg(long)]
    pub json: bool,
    /// Report audit rows older than this (`30d`).
    #[arg(long, value_parser = util::parse_duration, allow_hyphen_values = true)]
    pub audit_retention: Option<Duration>,
    /// Also compare this resource's Redis counter with its high-water mark (repeatable).
    #[arg(long = "resource", value_name = "RESOURCE")]
    pub resources: Vec<String>,
    /// Do not scan guarded tables for their highest fence (large tables).
    #[arg(long)]
    pub no_scan: bool,
    /// Only check PostgreSQL, even when an issuer (Redis) URL is configured.
    #[arg(long)]
    pub no_redis: bool,
    /// Acknowledge a failover of the database (a promotion doctor reports as `FailedOver`)
    /// once what it lost has been checked, then run the checks. Needs the owner of schema
    /// pgfence. Fencing does not depend on it: leases that wrote before the promotion stay
    /// fenced out.
    #[arg(long)]
    pub ack_failover: bool,
}

#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct AuditArgs {
    #[command(subcommand)]
    pub action: Option<AuditAction>,
    /// Only rejections newer than this: a duration (`1h`, `30m`) or an RFC 3339 time.
    #[arg(long)]
    pub since: Option<String>,
    /// Only rejections for this resource; a trailing `*` matches a prefix (`billing:*`).
    /// With a --key-prefix other than pgfence, that key prefix's rejections (its leases are
    /// audited as PREFIX{RESOURCE).
    #[arg(long)]
    pub resource: Option<String>,
    /// At most this many rows.
    #[arg(long, default_value_t = 50, allow_negative_numbers = true)]
    pub limit: i64,
    /// JSON output (one array; with --follow, one object per line).
    #[arg(long)]
    pub json: bool,
    /// Keep running and print new rejections as they are recorded (oldest first), like
    /// `tail -f`; stop with Ctrl-C.
    #[arg(long, short = 'f')]
    pub follow: bool,
}

#[derive(Subcommand, Debug)]
pub enum AuditAction {
    /// Delete audit rows older than a duration.
    Prune {
        /// e.g. `30d`, `12h`.
        #[arg(long, value_parser = util::parse_duration, allow_hyphen_values = true)]
        older_than: Duration,
    },
}

#[derive(Subcommand, Debug)]
pub enum LockAction {
    /// Take a lock and print its token and owner id.
    Acquire {
        /// The resource.
        resource: String,
        /// Lease TTL (`30s`, `500ms`, `5m`).
        #[arg(long, value_parser = util::parse_ttl, allow_hyphen_values = true)]
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

/// The lease an effect is recorded under: what `pgfence run` exports to its command.
#[derive(Args, Debug)]
pub struct EffectLease {
    /// The lease's resource, or its name in PostgreSQL (what `pgfence run` exports: under a
    /// --key-prefix P, P{RESOURCE).
    #[arg(long, env = "PGFENCE_RESOURCE")]
    pub resource: String,
    /// The lease's token.
    #[arg(long, env = "PGFENCE_TOKEN")]
    pub token: String,
    /// The lease's owner id.
    #[arg(long, env = "PGFENCE_OWNER", hide_env_values = true)]
    pub owner: String,
}

#[derive(Subcommand, Debug)]
pub enum EffectAction {
    /// Record a call before making it, fenced like a row write, and print its idempotency
    /// key: the same for every holder of the work item. Exit 0: make the call with the key;
    /// exit 3: a holder already recorded its outcome (do not call; `--json` shows it); exit 1
    /// with "stale fence token": a newer lease holds the work item (do not call).
    Begin {
        /// The work item (e.g. `invoice:42`).
        #[arg(long)]
        work: String,
        /// The step of the work item (e.g. `charge`).
        #[arg(long)]
        step: String,
        #[command(flatten)]
        lease: EffectLease,
        /// JSON output: key, state, outcome, holders.
        #[arg(long)]
        json: bool,
    },
    /// Record a call's outcome after making it (fenced: an older lease cannot overwrite a
    /// newer holder's).
    Finish {
        /// The work item.
        #[arg(long)]
        work: String,
        /// The step.
        #[arg(long)]
        step: String,
        #[command(flatten)]
        lease: EffectLease,
        /// The outcome: JSON (e.g. the provider's answer), or text stored as a JSON string.
        #[arg(long, allow_hyphen_values = true)]
        outcome: String,
        /// The call definitely did not take effect (e.g. a declined card).
        #[arg(long)]
        failed: bool,
    },
    /// Show an effect as recorded (exit 2 when nothing is recorded).
    Status {
        /// The resource (or any resource of its fencing domain).
        resource: String,
        /// The work item.
        #[arg(long)]
        work: String,
        /// The step.
        #[arg(long)]
        step: String,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args, Debug)]
pub struct RunArgs {
    /// The resource to lock.
    #[arg(long)]
    pub resource: String,
    /// Lease TTL; renewed every TTL/3 while the command runs.
    #[arg(long, value_parser = util::parse_ttl, allow_hyphen_values = true)]
    pub ttl: Duration,
    /// Wait up to this long for the lock (default: fail at once if held).
    #[arg(long, value_parser = util::parse_duration, allow_hyphen_values = true)]
    pub wait: Option<Duration>,
    /// What to do when the lease is lost while the command runs: `kill` sends it SIGTERM
    /// (like `consul lock`), `wait` lets it finish (like `etcdctl lock`); its Postgres writes
    /// are fenced either way.
    #[arg(long, value_enum, default_value_t = OnLeaseLost::Kill)]
    pub on_lease_lost: OnLeaseLost,
    /// The command and its arguments.
    #[arg(last = true, required = true, value_name = "CMD")]
    pub command: Vec<String>,
}

/// `pgfence run --on-lease-lost`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnLeaseLost {
    /// Send the command SIGTERM: work outside Postgres (a payment provider, files) is not
    /// fenced, so a command that no longer holds the lock should stop.
    Kill,
    /// Let the command run to its end; only its fenced writes are protected.
    Wait,
}

#[derive(Args, Debug)]
pub struct SimulateArgs {
    /// Run the same race with plain, unfenced writes, to see the damage.
    #[arg(long)]
    pub no_fence: bool,
    /// Print a Mermaid sequence diagram of the run instead of the timeline.
    #[arg(long)]
    pub mermaid: bool,
    /// Lock TTL.
    #[arg(long, default_value = "300ms", value_parser = util::parse_ttl)]
    pub ttl: Duration,
    /// How long worker A pauses (must exceed the TTL for the race to happen).
    #[arg(long, default_value = "700ms", value_parser = util::parse_duration)]
    pub pause: Duration,
    /// Which issuer hands out the leases: `redis` (a Redis server), or `postgres` (the
    /// PostgreSQL issuer on the demo's own database: no Redis needed). `--issuer-url` picks any
    /// other.
    #[arg(long, value_enum, default_value_t = SimulateIssuer::Redis)]
    pub issuer: SimulateIssuer,
    /// Replay the race across a PostgreSQL failover: a throwaway primary and async standby
    /// (always its own, even with DATABASE_URL set); the standby is cut off, lease B's
    /// acknowledged write is lost by the promotion, and zombie A, whose fence the row shows
    /// again, must be refused (FencedByFailover) while a new lease writes.
    #[arg(long)]
    pub pg_failover: bool,
}

/// The issuers `pgfence simulate --issuer` starts by itself.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum SimulateIssuer {
    /// Redis (`--redis-url` / `REDIS_URL`, else a throwaway `redis-server`).
    Redis,
    /// The PostgreSQL issuer, on the demo's database.
    Postgres,
}
