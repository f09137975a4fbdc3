//! Race harness: proof under faults.
//!
//! N workers repeatedly take the lock of one of K counter rows through the [`Issuer`], read
//! the row's value, sometimes pause past the lease's TTL (an injected stall, like a GC pause or
//! a frozen VM), then write `value + 1` with their fence token. Every attempted write is
//! recorded (row, token, value read, value written, outcome, timestamps), and after the run the
//! history is checked against what Postgres actually committed:
//!
//! * **token order** — on each row, accepted writes in commit order carry strictly increasing
//!   tokens;
//! * **no lost updates** — each row's final value equals its number of accepted writes, and
//!   every accepted write read the value the previous accepted write left;
//! * **every rejection is reported** — one `pgfence.audit` row and one `pgfence::audit` WARN
//!   event per [`Error::StaleToken`] a worker saw;
//! * **all or nothing** — a write's row update and its history row commit together.
//!
//! Faults can be injected while it runs: Redis counter loss (built in: `DEL` of every counter
//! at chosen points), killed Postgres backends (built in: `pg_terminate_backend` of a busy
//! worker connection at random intervals), and anything else the caller does between
//! [`Control::wait_for_units`] and [`Control::mark_fault`] (restarting Redis or Postgres). For
//! each fault the report measures recovery: how many leases, rejections and errors it took, and
//! how long, until every row accepted writes again.
//!
//! # What guarantees what
//!
//! Three [`Mode`]s run the same read-modify-write loop with different protection.
//!
//! * [`Mode::Unfenced`] — what an application without pgfence does: read the value, then
//!   `UPDATE ... SET value = $1` without a token, on a table that is not guarded. A worker
//!   whose lease expired during a pause overwrites newer work. The harness must report
//!   violations here, which proves that it can detect them.
//!
//! * [`Mode::RowFence`] — read the value, then a fenced [`Repository::update`]
//!   (`... WHERE fence < $token`). This guarantees **token order per row**: no accepted write
//!   carries a token lower than or equal to an earlier accepted write on the row (also for raw
//!   SQL, through the guard trigger). It does **not** make read-modify-write atomic. Take
//!   holder A with token 1 that pauses past its TTL *before writing*, and holder B that then
//!   gets token 2 and reads value `v`. If A wakes up and writes `v + 1` before B writes, A's
//!   write is accepted (the row's fence is still below 1) — and so is B's `v + 1` afterwards
//!   (2 is newer than 1). Tokens are in order, yet A's increment is lost: the fence compares
//!   tokens at write time, but B's *read* was never ordered against A's write.
//!
//! * [`Mode::Fenced`] (the default) — one transaction per write: [`Fence::check`] on the row's
//!   resource first, then the read, then the fenced update, committed together. The check
//!   raises the resource's high-water mark and holds that row lock until commit, so holders of
//!   one resource are serialised in token order: an older holder that has not checked yet fails
//!   its check later (the mark is already newer); an older holder that checked earlier makes
//!   this check wait until it commits or rolls back, and then this transaction's read — a later
//!   statement under READ COMMITTED — sees its committed write; a newer holder waits for this
//!   transaction. So no write can land between a holder's read and its write, which is exactly
//!   what rules out lost updates. The row fence stays as defence in depth (and is what stops
//!   raw SQL). A pause *inside* the transaction only delays the next holder; it cannot make an
//!   older write land after a newer one. (Under REPEATABLE READ or SERIALIZABLE the snapshot is
//!   taken by the check itself, before any wait, so a conflicting holder gets a serialization
//!   failure — still safe, and retryable.)
//!
//! # How commit order is observed
//!
//! Ordering accepted writes by client-side timestamps would be wrong: the commit a client
//! sees is not the order Postgres applied. Instead each counter row has a `version` column that
//! a trigger bumps on every update, and each write inserts its history row **in the same
//! transaction**, copying that version. Updates of one row are serialised by its row lock, so
//! versions `1, 2, 3, ...` are the commit order of the row's writes; the history row exists if
//! and only if the write committed, which also settles commits whose acknowledgement was lost
//! (a connection killed during `COMMIT`).
//!
//! # Counting log events
//!
//! The library emits rejection events through `tracing` but installs no subscriber (that is
//! the application's choice). The caller passes an [`AuditLogCounter`] to
//! [`Harness::with_log_counter`]; [`EventCounter`] is one, a `tracing_subscriber` layer that
//! counts `pgfence::audit` events per resource ([`EventCounter::install_global`] sets it up).
//! Every resource of a run starts with the run's prefix ([`Harness::resource_prefix`]), so
//! concurrent runs in one process do not mix.
//! Without a counter, `log_events` is reported as `null`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use redis::aio::ConnectionManager;
use serde::Serialize;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgPool, Row};
use tokio::time::Instant;
use tracing::subscriber::Interest;
use tracing::{Event, Metadata, Subscriber};
use tracing_subscriber::layer::{Context, Layer};

use crate::issuer::{check_ttl, counter_key};
use crate::{Error, Fence, Issuer, Lease, LeaseState, Repository, Resource, TableName};

/// The schema the harness creates its tables in.
pub const SCHEMA: &str = "pgfence_chaos";

/// Advisory lock key serialising the harness's schema setup ("chaos").
const SETUP_LOCK_KEY: i64 = 0x0063_6861_6f73;

const SETUP_SQL: &str = r"
CREATE SCHEMA IF NOT EXISTS pgfence_chaos;
CREATE TABLE IF NOT EXISTS pgfence_chaos.cell (
    run     text    NOT NULL,
    id      integer NOT NULL,
    value   bigint  NOT NULL DEFAULT 0,
    version bigint  NOT NULL DEFAULT 0,
    PRIMARY KEY (run, id)
);
CREATE TABLE IF NOT EXISTS pgfence_chaos.plain_cell (
    run     text    NOT NULL,
    id      integer NOT NULL,
    value   bigint  NOT NULL DEFAULT 0,
    version bigint  NOT NULL DEFAULT 0,
    PRIMARY KEY (run, id)
);
CREATE TABLE IF NOT EXISTS pgfence_chaos.history (
    run           text        NOT NULL,
    id            integer     NOT NULL,
    version       bigint      NOT NULL,
    token         bigint      NOT NULL,
    value_read    bigint      NOT NULL,
    value_written bigint      NOT NULL,
    unit          bigint      NOT NULL,
    try_no        integer     NOT NULL,
    worker        integer     NOT NULL,
    committed_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (run, id, version)
);
CREATE OR REPLACE FUNCTION pgfence_chaos.bump_version() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    NEW.version := OLD.version + 1;
    RETURN NEW;
END
$$;
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_trigger
                    WHERE tgname = 'chaos_version' AND tgrelid = 'pgfence_chaos.cell'::regclass) THEN
        CREATE TRIGGER chaos_version BEFORE UPDATE ON pgfence_chaos.cell
            FOR EACH ROW EXECUTE FUNCTION pgfence_chaos.bump_version();
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_trigger
                    WHERE tgname = 'chaos_version' AND tgrelid = 'pgfence_chaos.plain_cell'::regclass) THEN
        CREATE TRIGGER chaos_version BEFORE UPDATE ON pgfence_chaos.plain_cell
            FOR EACH ROW EXECUTE FUNCTION pgfence_chaos.bump_version();
    END IF;
END
$$;
";

const READ_CELL: &str = "SELECT value FROM pgfence_chaos.cell WHERE run = $1 AND id = $2";
const READ_PLAIN: &str = "SELECT value FROM pgfence_chaos.plain_cell WHERE run = $1 AND id = $2";
const WRITE_PLAIN: &str =
    "UPDATE pgfence_chaos.plain_cell SET value = $3 WHERE run = $1 AND id = $2";
const RECORD_CELL: &str = "INSERT INTO pgfence_chaos.history \
     (run, id, version, token, value_read, value_written, unit, try_no, worker) \
     SELECT run, id, version, $3, $4, value, $5, $6, $7 FROM pgfence_chaos.cell \
     WHERE run = $1 AND id = $2";
const RECORD_PLAIN: &str = "INSERT INTO pgfence_chaos.history \
     (run, id, version, token, value_read, value_written, unit, try_no, worker) \
     SELECT run, id, version, $3, $4, value, $5, $6, $7 FROM pgfence_chaos.plain_cell \
     WHERE run = $1 AND id = $2";

/// One counter row of the guarded table, as the fenced repository writes it.
#[derive(Clone, Debug)]
struct Cell {
    run: String,
    id: i32,
    value: i64,
}

crate::fenced_table!(Cell {
    schema: "pgfence_chaos",
    table: "cell",
    key: (run: String, id: i32),
    columns: [value],
});

/// How the workers protect their read-modify-write (see the module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// `Fence::check` + read + fenced update in one transaction: token order and no lost
    /// updates.
    Fenced,
    /// Read, then a fenced row update: token order per row, but lost updates remain possible.
    RowFence,
    /// Read, then a plain `UPDATE ... SET value = $1` on an unguarded table: the control.
    Unfenced,
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "fenced" | "tx" => Ok(Mode::Fenced),
            "row-fence" | "row_fence" | "row" => Ok(Mode::RowFence),
            "unfenced" | "none" => Ok(Mode::Unfenced),
            other => Err(format!(
                "unknown mode {other:?} (expected fenced, row-fence or unfenced)"
            )),
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Mode::Fenced => "fenced",
            Mode::RowFence => "row-fence",
            Mode::Unfenced => "unfenced",
        })
    }
}

/// How workers restore liveness after the Redis counter went backwards.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Recovery {
    /// Give the issuer a floor source ([`Issuer::with_floor_source`]): an acquire that finds
    /// the counter missing reseeds it from Postgres's high-water mark by itself.
    pub floor_source: bool,
    /// After a rejected write, call [`Issuer::recover_from`], which raises the counter to the
    /// fence the write met (a no-op when the rejection was an ordinary stale holder).
    pub recover_from: bool,
}

/// What a run does. [`Config::default`] is a CI-sized fenced run.
#[derive(Clone, Debug)]
pub struct Config {
    /// Protection used by the workers.
    pub mode: Mode,
    /// Concurrent workers.
    pub workers: usize,
    /// Counter rows (each with its own resource, lock and token counter).
    pub rows: usize,
    /// Work units: leases that go on to write (retries of a unit are extra attempts).
    pub units: u64,
    /// Lease TTL.
    pub ttl: Duration,
    /// How long a worker waits for a busy lock before giving up on that unit.
    pub acquire_wait: Duration,
    /// Probability that a unit stalls once, either before its read or between read and write.
    pub pause_probability: f64,
    /// Shortest injected stall (make it longer than `ttl` so the lease expires).
    pub pause_min: Duration,
    /// Longest injected stall.
    pub pause_max: Duration,
    /// Retries of a unit, with the same lease, after an error that
    /// [`Error::is_retryable`] calls safe to retry.
    pub retries: u32,
    /// Delete every row's Redis counter when the unit with this index starts (a failover that
    /// lost the counters).
    pub reset_counters_at: Vec<u64>,
    /// Terminate one busy worker backend (`pg_terminate_backend`) about this often.
    pub kill_every: Option<Duration>,
    /// Liveness recovery after counter loss.
    pub recovery: Recovery,
    /// Wall-clock bound: workers stop starting units after this long.
    pub max_duration: Duration,
    /// Seed of the workers' random choices.
    pub seed: u64,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            mode: Mode::Fenced,
            workers: 8,
            rows: 8,
            units: 2_000,
            ttl: Duration::from_millis(40),
            acquire_wait: Duration::from_secs(2),
            pause_probability: 0.05,
            pause_min: Duration::from_millis(60),
            pause_max: Duration::from_millis(120),
            retries: 2,
            reset_counters_at: Vec::new(),
            kill_every: None,
            recovery: Recovery {
                floor_source: true,
                recover_from: true,
            },
            max_duration: Duration::from_secs(120),
            seed: 0x5eed,
        }
    }
}

impl Config {
    fn validate(&self) -> Result<(), ChaosError> {
        let bad = |m: &str| Err(ChaosError::Config(m.to_owned()));
        if self.workers == 0 {
            return bad("workers must be at least 1");
        }
        if self.rows == 0 || i32::try_from(self.rows).is_err() {
            return bad("rows must be in 1..=i32::MAX");
        }
        if !(0.0..=1.0).contains(&self.pause_probability) {
            return bad("pause probability must be in 0..=1");
        }
        if self.pause_min > self.pause_max {
            return bad("pause_min must not exceed pause_max");
        }
        check_ttl(self.ttl)?;
        Ok(())
    }
}

/// Where the harness runs: a Postgres database (pgfence's migrations are applied if missing)
/// and a Redis server.
#[derive(Clone, Debug)]
pub struct Target {
    /// The database.
    pub database: PgConnectOptions,
    /// `redis://` URL.
    pub redis_url: String,
}

/// Why a run could not be set up or verified.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChaosError {
    /// The configuration is inconsistent.
    #[error("invalid harness configuration: {0}")]
    Config(String),
    /// Postgres or Redis failed during setup or verification.
    #[error(transparent)]
    Fence(#[from] Error),
}

impl From<sqlx::Error> for ChaosError {
    fn from(e: sqlx::Error) -> Self {
        ChaosError::Fence(e.into())
    }
}

impl From<redis::RedisError> for ChaosError {
    fn from(e: redis::RedisError) -> Self {
        ChaosError::Fence(e.into())
    }
}

/// Counts the `pgfence::audit` events emitted for a run's resources. Implement it on whatever
/// sees the `tracing` events (a `tracing_subscriber::Layer` in the tests and the example).
pub trait AuditLogCounter: Send + Sync {
    /// Events seen so far for resources whose name starts with `resource_prefix`.
    fn count(&self, resource_prefix: &str) -> LogTally;
}

/// Event counts for one run, as returned by an [`AuditLogCounter`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct LogTally {
    /// `pgfence::audit` WARN events (one per rejection).
    pub rejections: u64,
    /// `pgfence::audit` ERROR events (an audit row that could not be written).
    pub audit_failures: u64,
    /// `pgfence::issuer` INFO events saying a lost counter was reseeded from Postgres.
    pub reseeds: u64,
}

/// Counts pgfence's `tracing` events per resource: an [`AuditLogCounter`] that is also a
/// `tracing_subscriber` layer. Install it with [`EventCounter::install_global`] (or add
/// [`EventCounter::layer`] to your own subscriber) and pass it to
/// [`Harness::with_log_counter`].
#[derive(Debug, Default)]
pub struct EventCounter(Mutex<HashMap<String, LogTally>>);

impl AuditLogCounter for EventCounter {
    fn count(&self, prefix: &str) -> LogTally {
        let map = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut total = LogTally::default();
        for t in map
            .iter()
            .filter(|(r, _)| r.starts_with(prefix))
            .map(|(_, t)| t)
        {
            total.rejections += t.rejections;
            total.audit_failures += t.audit_failures;
            total.reseeds += t.reseeds;
        }
        total
    }
}

/// The layer half of an [`EventCounter`].
#[derive(Debug)]
pub struct CountLayer(Arc<EventCounter>);

#[derive(Default)]
struct ResourceField(Option<String>);

impl tracing::field::Visit for ResourceField {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        if field.name() == "resource" {
            self.0 = Some(value.to_owned());
        }
    }
    fn record_debug(&mut self, _: &tracing::field::Field, _: &dyn std::fmt::Debug) {}
}

impl<S: Subscriber> Layer<S> for CountLayer {
    fn register_callsite(&self, meta: &'static Metadata<'static>) -> Interest {
        if meta.target().starts_with("pgfence::") {
            Interest::always()
        } else {
            Interest::never()
        }
    }

    fn enabled(&self, meta: &Metadata<'_>, _: Context<'_, S>) -> bool {
        meta.target().starts_with("pgfence::")
    }

    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        let meta = event.metadata();
        let level = *meta.level();
        let kind = match meta.target() {
            "pgfence::audit" if level == tracing::Level::WARN => 0,
            "pgfence::audit" if level == tracing::Level::ERROR => 1,
            "pgfence::issuer" if level == tracing::Level::INFO => 2,
            _ => return,
        };
        let mut field = ResourceField::default();
        event.record(&mut field);
        let mut map = self
            .0
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let tally = map.entry(field.0.unwrap_or_default()).or_default();
        match kind {
            0 => tally.rejections += 1,
            1 => tally.audit_failures += 1,
            _ => tally.reseeds += 1,
        }
    }
}

impl EventCounter {
    /// A layer that feeds this counter.
    #[must_use]
    pub fn layer(self: &Arc<Self>) -> CountLayer {
        CountLayer(self.clone())
    }

    /// Installs a global subscriber made of this counter's layer alone, once per process, and
    /// returns the counter (the same one on every call).
    ///
    /// # Panics
    /// If another global subscriber was installed first.
    #[must_use]
    pub fn install_global() -> Arc<Self> {
        static COUNTER: std::sync::OnceLock<Arc<EventCounter>> = std::sync::OnceLock::new();
        COUNTER
            .get_or_init(|| {
                use tracing_subscriber::layer::SubscriberExt;
                let counter = Arc::new(EventCounter::default());
                let subscriber = tracing_subscriber::registry().with(counter.layer());
                tracing::subscriber::set_global_default(subscriber)
                    .expect("no other global subscriber");
                counter
            })
            .clone()
    }
}

/// Where in a write an error happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    /// Opening the transaction (or getting a connection).
    Begin,
    /// `Fence::check`.
    Check,
    /// Reading the value.
    Read,
    /// The row update.
    Write,
    /// The history insert.
    Record,
    /// `COMMIT`: the outcome is unknown until the history is read back.
    Commit,
}

/// What one attempted write came to, as the worker saw it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Outcome {
    /// Committed and acknowledged.
    Accepted,
    /// Rejected with [`Error::StaleToken`].
    Rejected {
        /// The fence (or high-water mark) the token met.
        current: i64,
        /// `check` or `update`.
        by: &'static str,
    },
    /// Failed with another error.
    Failed {
        /// Where.
        stage: Stage,
        /// [`Error::is_retryable`].
        retryable: bool,
        /// A short classification of the error.
        error: String,
    },
}

/// One attempted write.
#[derive(Clone, Debug, Serialize)]
pub struct Attempt {
    /// The work unit (one lease).
    pub unit: u64,
    /// 0 for the first try, then retries.
    pub try_no: u32,
    /// Worker index.
    pub worker: usize,
    /// Counter row.
    pub row: i32,
    /// The lease's fence token.
    pub token: i64,
    /// When the lease was granted (ms since the run started).
    pub lease_at_ms: u64,
    /// When this try started.
    pub started_ms: u64,
    /// When it ended.
    pub finished_ms: u64,
    /// Injected stall before this try, in ms (0 when none).
    pub paused_ms: u64,
    /// The value read, if the read happened.
    pub value_read: Option<i64>,
    /// The value written, if the write statement succeeded.
    pub value_written: Option<i64>,
    /// The outcome.
    pub outcome: Outcome,
}

/// One granted lease.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct LeaseRecord {
    /// The work unit.
    pub unit: u64,
    /// Worker index.
    pub worker: usize,
    /// Counter row.
    pub row: i32,
    /// Token.
    pub token: i64,
    /// When it was granted (ms since the run started).
    pub at_ms: u64,
}

/// A fault the run went through.
#[derive(Clone, Debug, Serialize)]
pub struct FaultMark {
    /// What happened (`counter_reset`, `redis_restart`, `postgres_restart`...).
    pub name: String,
    /// When (ms since the run started).
    pub at_ms: u64,
    /// Units started when it happened.
    pub at_unit: u64,
}

/// How the run recovered from one fault. Only leases granted after the fault count.
#[derive(Clone, Debug, Serialize)]
pub struct FaultRecovery {
    /// The fault.
    pub name: String,
    /// When it happened (ms since the run started).
    pub at_ms: u64,
    /// Rows that accepted a write again (from a lease granted after the fault).
    pub rows_recovered: usize,
    /// Rows in the run.
    pub rows: usize,
    /// Leases granted after the fault, summed over rows, up to and including each row's first
    /// accepted write.
    pub leases_to_recover: u64,
    /// The most leases any single row needed.
    pub max_leases_one_row: u64,
    /// Stale rejections among those leases (the price of the lost counter).
    pub rejections_before_recovery: u64,
    /// Failed attempts (connection errors...) started after the fault and before the last row
    /// recovered.
    pub errors_before_recovery: u64,
    /// Failed acquisitions after the fault and before the last row recovered.
    pub acquire_errors_before_recovery: u64,
    /// From the fault to the first accepted write on any row.
    pub first_write_ms: Option<u64>,
    /// From the fault until every row had accepted a write again.
    pub recovery_ms: Option<u64>,
}

/// Errors the workers saw, by kind.
#[derive(Clone, Debug, Serialize)]
pub struct ErrorKind {
    /// Short classification (`database sqlstate 57P01`, `database io`, `redis io`...).
    pub kind: String,
    /// What [`Error::is_retryable`] said.
    pub retryable: bool,
    /// How many.
    pub count: u64,
}

/// The run's figures; [`Summary::json`] is the one-line form.
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    /// Run id (resources are `chaos:<run>:<row>`).
    pub run: String,
    /// Protection used.
    pub mode: Mode,
    /// Workers.
    pub workers: usize,
    /// Rows.
    pub rows: usize,
    /// Work units started (leases that went on to write).
    pub units: u64,
    /// Attempted writes, retries included.
    pub attempts: u64,
    /// Writes Postgres committed (from the history written in the same transactions).
    pub accepted: u64,
    /// Committed writes whose acknowledgement the worker received.
    pub acknowledged: u64,
    /// Writes rejected as stale.
    pub rejected: u64,
    /// Writes that failed with other errors.
    pub errors: u64,
    /// ... of which [`Error::is_retryable`] said retryable.
    pub retryable_errors: u64,
    /// Retries made.
    pub retries: u64,
    /// All safety violations: token order + acknowledgement mismatches + torn writes.
    pub violations: u64,
    /// Accepted writes whose token was not newer than the previous accepted write on the row.
    pub token_order_violations: u64,
    /// Writes reported accepted but not committed, or reported rejected/failed before commit
    /// but committed.
    pub ack_mismatches: u64,
    /// Row updates and history rows that did not commit together (version gaps).
    pub torn_writes: u64,
    /// Sum over rows of accepted writes minus the final value.
    pub lost_updates: u64,
    /// Accepted writes that read a value other than the previous accepted write's.
    pub stale_reads: u64,
    /// `pgfence.audit` rows for the run's resources.
    pub audit_rows: u64,
    /// `pgfence::audit` WARN events for the run (`null` without a counter).
    pub log_events: Option<u64>,
    /// `pgfence::audit` ERROR events (audit row not written), `null` without a counter.
    pub audit_failures: Option<u64>,
    /// Automatic reseeds from the floor source (`null` without a counter).
    pub reseed_events: Option<u64>,
    /// Counter raises by [`Issuer::recover_from`].
    pub counter_raises: u64,
    /// Injected stalls.
    pub pauses: u64,
    /// Backends terminated.
    pub backend_kills: u64,
    /// Acquisitions that failed (Redis errors).
    pub acquire_errors: u64,
    /// Acquisitions that gave up waiting for the lock.
    pub acquire_timeouts: u64,
    /// Releases that found the lease expired.
    pub released_expired: u64,
    /// Releases that found another holder.
    pub released_taken: u64,
    /// Wall-clock duration of the run.
    pub duration_ms: u64,
    /// True when `max_duration` stopped the run early.
    pub timed_out: bool,
    /// Recovery figures, one per fault.
    pub faults: Vec<FaultRecovery>,
    /// Errors by kind.
    pub error_kinds: Vec<ErrorKind>,
}

impl Summary {
    /// The summary as one JSON line.
    #[must_use]
    pub fn json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }

    /// True when the run showed no violation and no lost update.
    #[must_use]
    pub fn is_safe(&self) -> bool {
        self.violations == 0 && self.lost_updates == 0 && self.stale_reads == 0
    }
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let opt = |v: Option<u64>| v.map_or_else(|| "n/a".to_owned(), |v| v.to_string());
        writeln!(
            f,
            "run {} ({} mode): {} workers on {} rows, {} units in {} ms{}",
            self.run,
            self.mode,
            self.workers,
            self.rows,
            self.units,
            self.duration_ms,
            if self.timed_out {
                " (time limit hit)"
            } else {
                ""
            }
        )?;
        writeln!(
            f,
            "  writes:     {} attempted, {} accepted ({} acknowledged), {} rejected as stale, {} failed ({} retryable), {} retries",
            self.attempts,
            self.accepted,
            self.acknowledged,
            self.rejected,
            self.errors,
            self.retryable_errors,
            self.retries
        )?;
        writeln!(
            f,
            "  safety:     {} violations ({} token order, {} ack mismatches, {} torn), {} lost updates, {} stale reads => {}",
            self.violations,
            self.token_order_violations,
            self.ack_mismatches,
            self.torn_writes,
            self.lost_updates,
            self.stale_reads,
            if self.is_safe() { "SAFE" } else { "UNSAFE" }
        )?;
        writeln!(
            f,
            "  reporting:  {} rejections, {} audit rows, {} log events, {} audit failures",
            self.rejected,
            self.audit_rows,
            opt(self.log_events),
            opt(self.audit_failures)
        )?;
        writeln!(
            f,
            "  faults:     {} stalls, {} backends killed, {} acquire errors, {} acquire timeouts, {} counter raises, {} auto-reseeds",
            self.pauses,
            self.backend_kills,
            self.acquire_errors,
            self.acquire_timeouts,
            self.counter_raises,
            opt(self.reseed_events)
        )?;
        for r in &self.faults {
            writeln!(
                f,
                "  recovery:   {} at {} ms: {}/{} rows writing again after {} (first write after {}), {} leases ({} max on one row), {} rejections, {} errors, {} acquire errors",
                r.name,
                r.at_ms,
                r.rows_recovered,
                r.rows,
                r.recovery_ms
                    .map_or_else(|| "never".to_owned(), |v| format!("{v} ms")),
                r.first_write_ms
                    .map_or_else(|| "never".to_owned(), |v| format!("{v} ms")),
                r.leases_to_recover,
                r.max_leases_one_row,
                r.rejections_before_recovery,
                r.errors_before_recovery,
                r.acquire_errors_before_recovery
            )?;
        }
        for k in &self.error_kinds {
            writeln!(
                f,
                "  error:      {} x {} ({})",
                k.count,
                k.kind,
                if k.retryable {
                    "retryable"
                } else {
                    "not retryable"
                }
            )?;
        }
        Ok(())
    }
}

/// Everything a run produced: the summary and the full client-side history.
#[derive(Clone, Debug)]
pub struct Report {
    /// Figures and verdicts.
    pub summary: Summary,
    /// Every attempted write, in no particular order.
    pub attempts: Vec<Attempt>,
    /// Every granted lease that went on to write.
    pub leases: Vec<LeaseRecord>,
    /// Faults, in order.
    pub faults: Vec<FaultMark>,
}

struct Shared {
    started: Mutex<Instant>,
    units: AtomicU64,
    done: AtomicBool,
    faults: Mutex<Vec<FaultMark>>,
}

impl Shared {
    fn now_ms(&self) -> u64 {
        millis(lock(&self.started).elapsed())
    }
}

/// A handle for injecting faults from outside while a run goes on.
#[derive(Clone)]
pub struct Control(Arc<Shared>);

impl Control {
    /// Work units started so far.
    #[must_use]
    pub fn units_started(&self) -> u64 {
        self.0.units.load(Ordering::SeqCst)
    }

    /// True once the workers have stopped.
    #[must_use]
    pub fn is_done(&self) -> bool {
        self.0.done.load(Ordering::SeqCst)
    }

    /// Waits until `n` units have started. Returns `false` if the run ended first.
    pub async fn wait_for_units(&self, n: u64) -> bool {
        loop {
            if self.units_started() >= n {
                return true;
            }
            if self.is_done() {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// Records that a fault starts now; recovery is measured from this point.
    pub fn mark_fault(&self, name: &str) {
        let mark = FaultMark {
            name: name.to_owned(),
            at_ms: self.0.now_ms(),
            at_unit: self.units_started(),
        };
        lock(&self.0.faults).push(mark);
    }
}

/// A prepared run. Build it with [`Harness::new`], take a [`Control`] if faults are injected
/// from outside, then [`Harness::run`].
pub struct Harness {
    ctx: Arc<Ctx>,
    admin: PgPool,
    log_counter: Option<Arc<dyn AuditLogCounter>>,
    worker_app: String,
}

struct Ctx {
    cfg: Config,
    run: String,
    resources: Vec<Resource>,
    pool: PgPool,
    fence: Fence,
    repo: Repository<Cell>,
    issuer: Issuer,
    redis: ConnectionManager,
    shared: Arc<Shared>,
}

impl Harness {
    /// Connects, applies pgfence's migrations if needed, creates the harness's tables (schema
    /// [`SCHEMA`], the fenced one guarded) and this run's counter rows.
    ///
    /// Three pools are opened: the workers' (whose backends may be killed), an audit pool
    /// (used for audit rows and as the issuer's floor source, never killed) and an admin pool.
    /// Each run gets fresh rows keyed by its run id; the tables (and the run's audit rows) stay
    /// for inspection afterwards — `DROP SCHEMA pgfence_chaos CASCADE` removes them.
    ///
    /// # Errors
    /// [`ChaosError::Config`] for an inconsistent configuration; [`ChaosError::Fence`] when
    /// Postgres or Redis cannot be reached or set up.
    pub async fn new(cfg: Config, target: &Target) -> Result<Self, ChaosError> {
        cfg.validate()?;
        let run = format!("{:016x}", rand::random::<u64>());
        let worker_app = format!("pgfence-chaos-worker-{run}");
        let workers = u32::try_from(cfg.workers).unwrap_or(u32::MAX);
        let pool = PgPoolOptions::new()
            .max_connections(workers.saturating_add(2))
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(target.database.clone().application_name(&worker_app))
            .await?;
        let audit = PgPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(
                target
                    .database
                    .clone()
                    .application_name("pgfence-chaos-audit"),
            )
            .await?;
        let admin = PgPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(
                target
                    .database
                    .clone()
                    .application_name("pgfence-chaos-admin"),
            )
            .await?;

        crate::migrate(&admin).await?;
        let mut tx = admin.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(SETUP_LOCK_KEY)
            .execute(&mut *tx)
            .await?;
        sqlx::raw_sql(SETUP_SQL).execute(&mut *tx).await?;
        crate::guard(&mut *tx, &TableName::new(SCHEMA, "cell")?).await?;
        let rows = i32::try_from(cfg.rows).map_err(|_| ChaosError::Config("rows".into()))?;
        for table in [
            "INSERT INTO pgfence_chaos.cell (run, id) SELECT $1, g FROM generate_series(0, $2 - 1) g",
            "INSERT INTO pgfence_chaos.plain_cell (run, id) SELECT $1, g FROM generate_series(0, $2 - 1) g",
        ] {
            sqlx::query(table)
                .bind(&run)
                .bind(rows)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;

        let mut issuer = Issuer::connect(&target.redis_url).await?;
        if cfg.recovery.floor_source {
            issuer = issuer.with_floor_source(audit.clone());
        }
        let redis = ConnectionManager::new(redis::Client::open(target.redis_url.as_str())?).await?;
        let resources = (0..rows)
            .map(|row| Resource::new(format!("chaos:{run}:{row}")))
            .collect::<Result<Vec<_>, _>>()?;
        let fence = Fence::new(audit);
        let repo = fence.repository::<Cell>()?;
        let shared = Arc::new(Shared {
            started: Mutex::new(Instant::now()),
            units: AtomicU64::new(0),
            done: AtomicBool::new(false),
            faults: Mutex::new(Vec::new()),
        });
        Ok(Self {
            ctx: Arc::new(Ctx {
                cfg,
                run,
                resources,
                pool,
                fence,
                repo,
                issuer,
                redis,
                shared,
            }),
            admin,
            log_counter: None,
            worker_app,
        })
    }

    /// Counts the run's `tracing` events with `counter` (see [`AuditLogCounter`]).
    #[must_use]
    pub fn with_log_counter(mut self, counter: Arc<dyn AuditLogCounter>) -> Self {
        self.log_counter = Some(counter);
        self
    }

    /// A handle for injecting faults while the run goes on.
    #[must_use]
    pub fn control(&self) -> Control {
        Control(self.ctx.shared.clone())
    }

    /// The run's id.
    #[must_use]
    pub fn run_id(&self) -> &str {
        &self.ctx.run
    }

    /// The prefix of every resource name of this run (`chaos:<run>:`).
    #[must_use]
    pub fn resource_prefix(&self) -> String {
        format!("chaos:{}:", self.ctx.run)
    }

    /// Runs the workers (and the backend killer, if configured) to completion, then checks the
    /// history against what Postgres committed.
    ///
    /// # Errors
    /// [`ChaosError::Fence`] when the verification queries fail. Errors during the run are
    /// data, recorded in the report.
    pub async fn run(self) -> Result<Report, ChaosError> {
        let ctx = self.ctx.clone();
        let prefix = self.resource_prefix();
        let logs_before = self.log_counter.as_ref().map(|c| c.count(&prefix));
        // Restart the clock: setup time is not part of the run.
        let started = Instant::now();
        *lock(&ctx.shared.started) = started;
        let killer = ctx.cfg.kill_every.map(|every| {
            let admin = self.admin.clone();
            let app = self.worker_app.clone();
            let shared = ctx.shared.clone();
            let seed = ctx.cfg.seed;
            tokio::spawn(kill_backends(admin, app, shared, every, seed))
        });
        let handles: Vec<_> = (0..ctx.cfg.workers)
            .map(|w| tokio::spawn(worker(w, ctx.clone(), started)))
            .collect();
        let mut outs = Vec::with_capacity(handles.len());
        for h in handles {
            match h.await {
                Ok(out) => outs.push(out),
                Err(e) => {
                    ctx.shared.done.store(true, Ordering::SeqCst);
                    return Err(ChaosError::Config(format!("a worker panicked: {e}")));
                }
            }
        }
        ctx.shared.done.store(true, Ordering::SeqCst);
        let kills = match killer {
            Some(k) => k.await.unwrap_or(0),
            None => 0,
        };
        let duration_ms = millis(started.elapsed());
        // Let audit writes that raced the end of the run land (each is bounded by its timeout).
        tokio::time::sleep(Duration::from_millis(50)).await;
        let logs = match (&self.log_counter, logs_before) {
            (Some(c), Some(before)) => {
                let after = c.count(&prefix);
                Some(LogTally {
                    rejections: after.rejections - before.rejections,
                    audit_failures: after.audit_failures - before.audit_failures,
                    reseeds: after.reseeds - before.reseeds,
                })
            }
            _ => None,
        };
        let faults = lock(&ctx.shared.faults).clone();
        self.verify(outs, faults, kills, duration_ms, logs).await
    }

    async fn verify(
        &self,
        outs: Vec<WorkerOut>,
        faults: Vec<FaultMark>,
        kills: u64,
        duration_ms: u64,
        logs: Option<LogTally>,
    ) -> Result<Report, ChaosError> {
        let ctx = &self.ctx;
        let cfg = &ctx.cfg;
        let cell_table = match cfg.mode {
            Mode::Unfenced => "pgfence_chaos.plain_cell",
            Mode::Fenced | Mode::RowFence => "pgfence_chaos.cell",
        };
        let history = sqlx::query(
            "SELECT id, version, token, value_read, value_written, unit, try_no \
             FROM pgfence_chaos.history WHERE run = $1 ORDER BY id, version",
        )
        .bind(&ctx.run)
        .fetch_all(&self.admin)
        .await?;
        let cells = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT id, value, version FROM {cell_table} WHERE run = $1"
        )))
        .bind(&ctx.run)
        .fetch_all(&self.admin)
        .await?;
        let prefix = self.resource_prefix();
        let audit_rows: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pgfence.audit WHERE left(resource, length($1)) = $1",
        )
        .bind(&prefix)
        .fetch_one(&self.admin)
        .await?;

        // Ground truth: committed writes per row, in commit (version) order.
        let mut committed: BTreeMap<i32, Vec<Committed>> = BTreeMap::new();
        for r in &history {
            committed
                .entry(r.try_get("id")?)
                .or_default()
                .push(Committed {
                    version: r.try_get("version")?,
                    token: r.try_get("token")?,
                    value_read: r.try_get("value_read")?,
                    value_written: r.try_get("value_written")?,
                    unit: u64::try_from(r.try_get::<i64, _>("unit")?).unwrap_or(u64::MAX),
                    try_no: u32::try_from(r.try_get::<i32, _>("try_no")?).unwrap_or(u32::MAX),
                });
        }
        let mut token_order = 0u64;
        let mut torn = 0u64;
        let mut lost = 0u64;
        let mut stale_reads = 0u64;
        for cell in &cells {
            let id: i32 = cell.try_get("id")?;
            let value: i64 = cell.try_get("value")?;
            let version: i64 = cell.try_get("version")?;
            let writes = committed.get(&id).map(Vec::as_slice).unwrap_or_default();
            let n = i64::try_from(writes.len()).unwrap_or(i64::MAX);
            // Version gaps or a row version without its history row: not all-or-nothing.
            torn += u64::try_from((version - n).abs()).unwrap_or(u64::MAX);
            let mut prev_token = None;
            let mut prev_value = 0i64;
            for (i, w) in writes.iter().enumerate() {
                if w.version != i64::try_from(i).unwrap_or(i64::MAX) + 1 {
                    torn += 1;
                }
                if prev_token.is_some_and(|p| w.token <= p) {
                    token_order += 1;
                }
                if w.value_read != prev_value || w.value_written != w.value_read + 1 {
                    stale_reads += 1;
                }
                prev_token = Some(w.token);
                prev_value = w.value_written;
            }
            lost += u64::try_from(n - value).unwrap_or(0);
        }

        let in_history: HashSet<(u64, u32)> = committed
            .values()
            .flatten()
            .map(|w| (w.unit, w.try_no))
            .collect();
        let mut attempts = Vec::new();
        let mut leases = Vec::new();
        let mut stats = Stats::default();
        for out in outs {
            attempts.extend(out.attempts);
            leases.extend(out.leases);
            stats.add(&out.stats);
        }
        let mut ack_mismatches = 0u64;
        let mut acknowledged = 0u64;
        let mut rejected = 0u64;
        let mut errors = 0u64;
        let mut retryable_errors = 0u64;
        let mut kinds: BTreeMap<(String, bool), u64> = BTreeMap::new();
        for a in &attempts {
            let committed = in_history.contains(&(a.unit, a.try_no));
            match &a.outcome {
                Outcome::Accepted => {
                    acknowledged += 1;
                    if !committed {
                        ack_mismatches += 1;
                    }
                }
                Outcome::Rejected { .. } => {
                    rejected += 1;
                    if committed {
                        ack_mismatches += 1;
                    }
                }
                Outcome::Failed {
                    stage,
                    retryable,
                    error,
                } => {
                    errors += 1;
                    if *retryable {
                        retryable_errors += 1;
                    }
                    *kinds.entry((error.clone(), *retryable)).or_default() += 1;
                    // Only a failed COMMIT may have committed.
                    if committed && *stage != Stage::Commit {
                        ack_mismatches += 1;
                    }
                }
            }
        }
        for ((kind, retryable), count) in &stats.acquire_error_kinds {
            *kinds
                .entry((format!("acquire: {kind}"), *retryable))
                .or_default() += count;
        }
        let accepted = u64::try_from(history.len()).unwrap_or(u64::MAX);
        let fault_recovery = faults
            .iter()
            .map(|f| recovery(f, cfg.rows, &attempts, &leases, &in_history, &stats))
            .collect();

        let summary = Summary {
            run: ctx.run.clone(),
            mode: cfg.mode,
            workers: cfg.workers,
            rows: cfg.rows,
            units: u64::try_from(leases.len()).unwrap_or(u64::MAX),
            attempts: u64::try_from(attempts.len()).unwrap_or(u64::MAX),
            accepted,
            acknowledged,
            rejected,
            errors,
            retryable_errors,
            retries: stats.retries,
            violations: token_order + ack_mismatches + torn,
            token_order_violations: token_order,
            ack_mismatches,
            torn_writes: torn,
            lost_updates: lost,
            stale_reads,
            audit_rows: u64::try_from(audit_rows).unwrap_or(0),
            log_events: logs.map(|l| l.rejections),
            audit_failures: logs.map(|l| l.audit_failures),
            reseed_events: logs.map(|l| l.reseeds),
            counter_raises: stats.counter_raises,
            pauses: stats.pauses,
            backend_kills: kills,
            acquire_errors: stats.acquire_errors,
            acquire_timeouts: stats.acquire_timeouts,
            released_expired: stats.released_expired,
            released_taken: stats.released_taken,
            duration_ms,
            timed_out: stats.timed_out,
            faults: fault_recovery,
            error_kinds: kinds
                .into_iter()
                .map(|((kind, retryable), count)| ErrorKind {
                    kind,
                    retryable,
                    count,
                })
                .collect(),
        };
        Ok(Report {
            summary,
            attempts,
            leases,
            faults,
        })
    }
}

struct Committed {
    version: i64,
    token: i64,
    value_read: i64,
    value_written: i64,
    unit: u64,
    try_no: u32,
}

#[derive(Default)]
struct Stats {
    pauses: u64,
    retries: u64,
    counter_raises: u64,
    acquire_errors: u64,
    acquire_timeouts: u64,
    released_expired: u64,
    released_taken: u64,
    timed_out: bool,
    acquire_error_at: Vec<u64>,
    acquire_error_kinds: BTreeMap<(String, bool), u64>,
}

impl Stats {
    fn add(&mut self, o: &Stats) {
        self.pauses += o.pauses;
        self.retries += o.retries;
        self.counter_raises += o.counter_raises;
        self.acquire_errors += o.acquire_errors;
        self.acquire_timeouts += o.acquire_timeouts;
        self.released_expired += o.released_expired;
        self.released_taken += o.released_taken;
        self.timed_out |= o.timed_out;
        self.acquire_error_at.extend(&o.acquire_error_at);
        for (k, v) in &o.acquire_error_kinds {
            *self.acquire_error_kinds.entry(k.clone()).or_default() += v;
        }
    }
}

struct WorkerOut {
    attempts: Vec<Attempt>,
    leases: Vec<LeaseRecord>,
    stats: Stats,
}

fn recovery(
    fault: &FaultMark,
    rows: usize,
    attempts: &[Attempt],
    leases: &[LeaseRecord],
    in_history: &HashSet<(u64, u32)>,
    stats: &Stats,
) -> FaultRecovery {
    // First committed try per unit, and rejections per unit.
    let mut success_at: HashMap<u64, u64> = HashMap::new();
    let mut rejections: HashMap<u64, u64> = HashMap::new();
    for a in attempts {
        if in_history.contains(&(a.unit, a.try_no)) {
            let t = success_at.entry(a.unit).or_insert(a.finished_ms);
            *t = (*t).min(a.finished_ms);
        }
        if matches!(a.outcome, Outcome::Rejected { .. }) {
            *rejections.entry(a.unit).or_default() += 1;
        }
    }
    let mut after: Vec<&LeaseRecord> = leases.iter().filter(|l| l.at_ms >= fault.at_ms).collect();
    after.sort_by_key(|l| (l.at_ms, l.unit));
    let mut per_row: BTreeMap<i32, (u64, u64, Option<u64>)> = BTreeMap::new();
    for l in after {
        let e = per_row.entry(l.row).or_default();
        if e.2.is_some() {
            continue;
        }
        e.0 += 1;
        e.1 += rejections.get(&l.unit).copied().unwrap_or(0);
        if let Some(&t) = success_at.get(&l.unit) {
            e.2 = Some(t);
        }
    }
    let recovered: Vec<u64> = per_row.values().filter_map(|e| e.2).collect();
    let rows_recovered = recovered.len();
    let last = (rows_recovered == rows)
        .then(|| recovered.iter().copied().max())
        .flatten();
    let first = recovered.iter().copied().min();
    let until = last.unwrap_or(u64::MAX);
    let errors_before = attempts
        .iter()
        .filter(|a| a.started_ms >= fault.at_ms && a.started_ms <= until)
        .filter(|a| matches!(a.outcome, Outcome::Failed { .. }))
        .count();
    let acquire_errors_before = stats
        .acquire_error_at
        .iter()
        .filter(|&&t| t >= fault.at_ms && t <= until)
        .count();
    FaultRecovery {
        name: fault.name.clone(),
        at_ms: fault.at_ms,
        rows_recovered,
        rows,
        leases_to_recover: per_row.values().map(|e| e.0).sum(),
        max_leases_one_row: per_row.values().map(|e| e.0).max().unwrap_or(0),
        rejections_before_recovery: per_row.values().map(|e| e.1).sum(),
        errors_before_recovery: u64::try_from(errors_before).unwrap_or(u64::MAX),
        acquire_errors_before_recovery: u64::try_from(acquire_errors_before).unwrap_or(u64::MAX),
        first_write_ms: first.map(|t| t.saturating_sub(fault.at_ms)),
        recovery_ms: last.map(|t| t.saturating_sub(fault.at_ms)),
    }
}

enum Pause {
    None,
    BeforeRead(Duration),
    BeforeWrite(Duration),
}

struct Failure {
    stage: Stage,
    error: Error,
}

type Step<T> = std::result::Result<T, Failure>;

fn at(stage: Stage) -> impl FnOnce(Error) -> Failure {
    move |error| Failure { stage, error }
}

async fn worker(id: usize, ctx: Arc<Ctx>, started: Instant) -> WorkerOut {
    let cfg = &ctx.cfg;
    let salt = u64::try_from(id)
        .unwrap_or(0)
        .wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut rng = StdRng::seed_from_u64(cfg.seed ^ salt);
    let rows = i32::try_from(cfg.rows).unwrap_or(i32::MAX);
    let now = || millis(started.elapsed());
    let mut out = WorkerOut {
        attempts: Vec::new(),
        leases: Vec::new(),
        stats: Stats::default(),
    };
    loop {
        if ctx.shared.done.load(Ordering::SeqCst)
            || ctx.shared.units.load(Ordering::SeqCst) >= cfg.units
        {
            break;
        }
        if started.elapsed() >= cfg.max_duration {
            out.stats.timed_out = true;
            ctx.shared.done.store(true, Ordering::SeqCst);
            break;
        }
        let row = rng.random_range(0..rows);
        let resource = &ctx.resources[usize::try_from(row).unwrap_or(0)];
        let lease = match ctx
            .issuer
            .acquire_wait(resource, cfg.ttl, cfg.acquire_wait)
            .await
        {
            Ok(Some(lease)) => lease,
            Ok(None) => {
                out.stats.acquire_timeouts += 1;
                continue;
            }
            Err(e) => {
                out.stats.acquire_errors += 1;
                out.stats.acquire_error_at.push(now());
                *out.stats
                    .acquire_error_kinds
                    .entry((classify(&e), e.is_retryable()))
                    .or_default() += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        let unit = ctx.shared.units.fetch_add(1, Ordering::SeqCst);
        if unit >= cfg.units {
            let _ = ctx.issuer.release(&lease).await;
            break;
        }
        let lease_at_ms = now();
        out.leases.push(LeaseRecord {
            unit,
            worker: id,
            row,
            token: lease.token().get(),
            at_ms: lease_at_ms,
        });
        if cfg.reset_counters_at.contains(&unit) {
            reset_counters(&ctx).await;
        }
        let mut pause = Pause::None;
        if rng.random_bool(cfg.pause_probability) {
            let lo = millis(cfg.pause_min);
            let hi = millis(cfg.pause_max).max(lo);
            let d = Duration::from_millis(rng.random_range(lo..=hi));
            pause = if rng.random_bool(0.5) {
                Pause::BeforeRead(d)
            } else {
                Pause::BeforeWrite(d)
            };
            out.stats.pauses += 1;
        }
        let mut try_no = 0u32;
        loop {
            let started_ms = now();
            let (before_read, before_write) = match (&pause, try_no) {
                (Pause::BeforeRead(d), 0) => (Some(*d), None),
                (Pause::BeforeWrite(d), 0) => (None, Some(*d)),
                _ => (None, None),
            };
            let mut read = None;
            let mut written = None;
            let result = write_once(
                &ctx,
                &lease,
                row,
                unit,
                try_no,
                id,
                before_read,
                before_write,
                &mut read,
                &mut written,
            )
            .await;
            let paused_ms = millis(before_read.or(before_write).unwrap_or_default());
            let (outcome, stale) = match result {
                Ok(()) => (Outcome::Accepted, None),
                Err(Failure { stage, error }) => {
                    if let Error::StaleToken { current, .. } = error {
                        let by = if stage == Stage::Check {
                            "check"
                        } else {
                            "update"
                        };
                        (Outcome::Rejected { current, by }, Some(error))
                    } else {
                        let failed = Outcome::Failed {
                            stage,
                            retryable: error.is_retryable(),
                            error: classify(&error),
                        };
                        (failed, None)
                    }
                }
            };
            let retry = matches!(
                outcome,
                Outcome::Failed {
                    retryable: true,
                    ..
                }
            ) && try_no < cfg.retries
                && !ctx.shared.done.load(Ordering::SeqCst);
            out.attempts.push(Attempt {
                unit,
                try_no,
                worker: id,
                row,
                token: lease.token().get(),
                lease_at_ms,
                started_ms,
                finished_ms: now(),
                paused_ms,
                value_read: read,
                value_written: written,
                outcome,
            });
            if let Some(err) = stale
                && cfg.recovery.recover_from
                && let Ok(true) = ctx.issuer.recover_from(resource, &err).await
            {
                out.stats.counter_raises += 1;
            }
            if !retry {
                break;
            }
            out.stats.retries += 1;
            try_no += 1;
            tokio::time::sleep(Duration::from_millis(rng.random_range(5..25))).await;
        }
        match ctx.issuer.release(&lease).await {
            Ok(LeaseState::Expired) => out.stats.released_expired += 1,
            Ok(LeaseState::Taken) => out.stats.released_taken += 1,
            Ok(LeaseState::Held) | Err(_) => {}
        }
    }
    out
}

#[allow(clippy::too_many_arguments)]
async fn write_once(
    ctx: &Ctx,
    lease: &Lease,
    row: i32,
    unit: u64,
    try_no: u32,
    worker: usize,
    before_read: Option<Duration>,
    before_write: Option<Duration>,
    read: &mut Option<i64>,
    written: &mut Option<i64>,
) -> Step<()> {
    let run = ctx.run.as_str();
    let resource = lease.resource();
    if let Some(d) = before_read {
        tokio::time::sleep(d).await;
    }
    let record = |q: &'static str, value_read: i64| {
        sqlx::query(q)
            .bind(run.to_owned())
            .bind(row)
            .bind(lease.token().get())
            .bind(value_read)
            .bind(i64::try_from(unit).unwrap_or(i64::MAX))
            .bind(i32::try_from(try_no).unwrap_or(i32::MAX))
            .bind(i32::try_from(worker).unwrap_or(i32::MAX))
    };
    let begin = || async {
        ctx.pool
            .begin()
            .await
            .map_err(Error::from)
            .map_err(at(Stage::Begin))
    };
    let (read_sql, record_sql) = match ctx.cfg.mode {
        Mode::Unfenced => (READ_PLAIN, RECORD_PLAIN),
        Mode::RowFence | Mode::Fenced => (READ_CELL, RECORD_CELL),
    };
    // Fenced: check, read and write in one transaction (the check orders the read). The other
    // modes read on their own and open the transaction only for the write.
    let mut early_tx = None;
    if ctx.cfg.mode == Mode::Fenced {
        let mut tx = begin().await?;
        ctx.fence
            .check(&mut *tx, resource, lease)
            .await
            .map_err(at(Stage::Check))?;
        early_tx = Some(tx);
    }
    let read_query = sqlx::query_scalar(read_sql).bind(run).bind(row);
    let v: i64 = match early_tx.as_mut() {
        Some(tx) => read_query.fetch_one(&mut **tx).await,
        None => read_query.fetch_one(&ctx.pool).await,
    }
    .map_err(Error::from)
    .map_err(at(Stage::Read))?;
    *read = Some(v);
    if let Some(d) = before_write {
        tokio::time::sleep(d).await;
    }
    let mut tx = match early_tx {
        Some(tx) => tx,
        None => begin().await?,
    };
    if ctx.cfg.mode == Mode::Unfenced {
        sqlx::query(WRITE_PLAIN)
            .bind(run)
            .bind(row)
            .bind(v + 1)
            .execute(&mut *tx)
            .await
            .map_err(Error::from)
            .map_err(at(Stage::Write))?;
    } else {
        let cell = Cell {
            run: run.to_owned(),
            id: row,
            value: v + 1,
        };
        ctx.repo
            .update(&mut *tx, lease, &cell)
            .await
            .map_err(at(Stage::Write))?;
    }
    *written = Some(v + 1);
    record(record_sql, v)
        .execute(&mut *tx)
        .await
        .map_err(Error::from)
        .map_err(at(Stage::Record))?;
    tx.commit()
        .await
        .map_err(Error::from)
        .map_err(at(Stage::Commit))
}

/// Deletes every row's counter (a failover that lost them). Lock keys are left alone: holders
/// keep their leases, only the numbering restarts.
async fn reset_counters(ctx: &Ctx) {
    let keys: Vec<String> = ctx.resources.iter().map(counter_key).collect();
    let mut conn = ctx.redis.clone();
    let mark = FaultMark {
        name: "counter_reset".into(),
        at_ms: ctx.shared.now_ms(),
        at_unit: ctx.shared.units.load(Ordering::SeqCst),
    };
    let deleted: redis::RedisResult<i64> =
        redis::cmd("DEL").arg(&keys).query_async(&mut conn).await;
    if deleted.is_ok() {
        lock(&ctx.shared.faults).push(mark);
    }
}

/// Terminates one busy worker backend about every `every` until the run ends.
async fn kill_backends(
    admin: PgPool,
    app: String,
    shared: Arc<Shared>,
    every: Duration,
    seed: u64,
) -> u64 {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x6b69_6c6c);
    let mut kills = 0u64;
    let base = millis(every).max(1);
    while !shared.done.load(Ordering::SeqCst) {
        let nap = rng.random_range(base / 2..=base + base / 2);
        tokio::time::sleep(Duration::from_millis(nap.max(1))).await;
        if shared.done.load(Ordering::SeqCst) {
            break;
        }
        let killed: Result<i64, sqlx::Error> = sqlx::query_scalar(
            "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) AS gone \
               FROM pg_stat_activity \
              WHERE application_name = $1 AND pid <> pg_backend_pid() \
                AND state IN ('active', 'idle in transaction') \
              ORDER BY random() LIMIT 1) k WHERE gone",
        )
        .bind(&app)
        .fetch_one(&admin)
        .await;
        if let Ok(n) = killed {
            kills += u64::try_from(n).unwrap_or(0);
        }
    }
    kills
}

/// A short, stable description of an error, for grouping.
fn classify(e: &Error) -> String {
    match e {
        Error::Database(sqlx::Error::Database(db)) => {
            format!("database sqlstate {}", db.code().as_deref().unwrap_or("?"))
        }
        Error::Database(sqlx::Error::Io(io)) => format!("database io {:?}", io.kind()),
        Error::Database(sqlx::Error::PoolTimedOut) => "database pool timed out".into(),
        Error::Database(sqlx::Error::PoolClosed) => "database pool closed".into(),
        Error::Database(other) => {
            let text = other.to_string();
            format!("database {}", text.chars().take(80).collect::<String>())
        }
        Error::Redis(r) => format!("redis {:?}", r.kind()),
        other => {
            let text = other.to_string();
            text.chars().take(80).collect()
        }
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
