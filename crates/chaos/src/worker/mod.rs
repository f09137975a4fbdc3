//! The workers: take a row's lock, then read-modify-write the row as the run's
//! [`Mode`](crate::Mode) prescribes, recording every lease and every try.
//!
//! A worker's loop ([`worker`]) handles leases, stalls, retries and releases; one try of a
//! write is a [`Try`], which runs the steps a [`Plan`] lists. The plan is what differs between
//! modes: a new mode is a new [`Plan::of`] arm, and a new kind of write a new
//! [`WriteKind`](plan::WriteKind). The multi-statement modes (`fenced-multi`, `row-claim`,
//! `batch`) draw a [`Script`](script::Script) per unit — which statements
//! ([`Op`](script::Op)s) run in which of the unit's transactions — and a try runs it. A batch
//! unit also draws its rows: 10–100 distinct rows of its lease's group, sent in ascending
//! order (so concurrent batches lock shared rows in one order).
//!
//! Where each part lives: [`plan`] (which mode runs what), [`unit`] (one lease: its tries,
//! retries and release), [`pause`] (the injected stalls); per mode, [`single`] (`fenced`,
//! `row-fence`, `unfenced`: one transaction per try), [`script`] (`fenced-multi`, `row-claim`
//! and the leaseless mode's leases), [`batch`] and [`effects`] (`effects`,
//! `effects-unkeyed`). This file has the worker's loop, the shared steps of a try (begin,
//! read, record) and the error classification.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use pgfence::{Error, Lease, Resource, issuer::ReleaseOutcome};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sqlx::{PgConnection, Postgres, Transaction};
use tokio::time::Instant;

use crate::harness::Ctx;
use crate::schema::{ClaimCell, Kind};
use crate::util::millis;
use crate::{Attempt, BatchRows, LeaseRecord, LibraryCall, Stage};

mod batch;
mod effects;
mod pause;
mod plan;
mod script;
mod single;
mod unit;

pub(crate) use effects::{BeginRecord, CHARGE_STEP, CallAnswer, CallRecord, Keys, invoice_item};
pub(crate) use plan::Plan;

use pause::Pause;

/// What the worker counted besides the attempts (merged over workers by the verification).
#[derive(Default)]
pub(crate) struct Stats {
    pub(crate) pauses: u64,
    pub(crate) retries: u64,
    pub(crate) counter_raises: u64,
    pub(crate) acquire_errors: u64,
    pub(crate) acquire_timeouts: u64,
    pub(crate) released_expired: u64,
    pub(crate) released_taken: u64,
    pub(crate) timed_out: bool,
    /// When each failed acquisition happened (ms since the run started).
    pub(crate) acquire_error_at: Vec<u64>,
    /// Failed acquisitions by (classification, retryable).
    pub(crate) acquire_error_kinds: BTreeMap<(String, bool), u64>,
    /// Effects modes: stalls placed between the ledger's begin and the provider call.
    pub(crate) stalls_before_call: u64,
    /// Effects modes: begins that found the charge already recorded as done (call skipped).
    pub(crate) done_skips: u64,
}

impl Stats {
    /// Adds `o`'s figures to these.
    pub(crate) fn add(&mut self, o: &Stats) {
        self.pauses += o.pauses;
        self.retries += o.retries;
        self.counter_raises += o.counter_raises;
        self.acquire_errors += o.acquire_errors;
        self.acquire_timeouts += o.acquire_timeouts;
        self.released_expired += o.released_expired;
        self.released_taken += o.released_taken;
        self.timed_out |= o.timed_out;
        self.acquire_error_at.extend(&o.acquire_error_at);
        self.stalls_before_call += o.stalls_before_call;
        self.done_skips += o.done_skips;
        for (k, v) in &o.acquire_error_kinds {
            *self.acquire_error_kinds.entry(k.clone()).or_default() += v;
        }
    }
}

/// Everything one worker recorded.
pub(crate) struct WorkerOut {
    pub(crate) attempts: Vec<Attempt>,
    pub(crate) leases: Vec<LeaseRecord>,
    pub(crate) stats: Stats,
    /// Effects modes: every ledger begin that went through.
    pub(crate) begins: Vec<BeginRecord>,
    /// Effects modes: every provider call.
    pub(crate) calls: Vec<CallRecord>,
    /// The library calls it made, timed.
    pub(crate) library: Vec<LibraryCall>,
}

/// Why a try did not commit, and where.
enum Failure {
    /// pgfence or the database refused or failed.
    Fence { stage: Stage, error: Error },
    /// The payment provider's call ([`Stage::Call`]) did not succeed.
    Provider {
        /// A short classification (`provider 409 conflict`, `provider io TimedOut`...).
        error: String,
        /// Whether calling again (with the same key) is safe and may succeed.
        retryable: bool,
    },
}

type Step<T> = std::result::Result<T, Failure>;

/// Tags an error with the stage it happened in.
fn at(stage: Stage) -> impl FnOnce(Error) -> Failure {
    move |error| Failure::Fence { stage, error }
}

/// Tags a database error with the stage it happened in.
fn db_at(stage: Stage) -> impl FnOnce(sqlx::Error) -> Failure {
    move |error| Failure::Fence {
        stage,
        error: error.into(),
    }
}

/// One worker: takes leases and writes until the run's units are used up, the run is stopped,
/// or `max_duration` passed.
pub(crate) async fn worker(id: usize, ctx: Arc<Ctx>, started: Instant) -> WorkerOut {
    let salt = u64::try_from(id)
        .unwrap_or(0)
        .wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut w = Worker {
        id,
        rng: StdRng::seed_from_u64(ctx.cfg.seed ^ salt),
        ctx,
        started,
        out: WorkerOut {
            attempts: Vec::new(),
            leases: Vec::new(),
            stats: Stats::default(),
            begins: Vec::new(),
            calls: Vec::new(),
            library: Vec::new(),
        },
    };
    let ctx = w.ctx.clone();
    // What a lease covers: a row, or in batch mode a group of rows.
    let rows = i32::try_from(ctx.cfg.resource_count()).unwrap_or(i32::MAX);
    loop {
        if ctx.shared.done.load(Ordering::SeqCst)
            || ctx.shared.units.load(Ordering::SeqCst) >= ctx.cfg.units
        {
            break;
        }
        if started.elapsed() >= ctx.cfg.max_duration {
            w.out.stats.timed_out = true;
            ctx.shared.done.store(true, Ordering::SeqCst);
            break;
        }
        let row = w.rng.random_range(0..rows);
        let Some(resource) = usize::try_from(row).ok().and_then(|i| ctx.resources.get(i)) else {
            break; // cannot happen: there is one resource per row (per group in batch mode)
        };
        let asked_at_ms = w.now();
        let Some(lease) = w.acquire(resource).await else {
            continue;
        };
        let unit = ctx.shared.units.fetch_add(1, Ordering::SeqCst);
        if unit >= ctx.cfg.units {
            let _ = w.release(&lease).await;
            break;
        }
        w.unit(&lease, row, unit, asked_at_ms).await;
    }
    w.out
}

/// The bound of the issuer's calls: the harness leaves the default.
const ISSUER_BOUND: Duration = pgfence::issuer::DEFAULT_CALL_TIMEOUT;

/// A worker's state.
struct Worker {
    id: usize,
    ctx: Arc<Ctx>,
    started: Instant,
    rng: StdRng,
    out: WorkerOut,
}

impl Worker {
    /// Milliseconds since the run started.
    fn now(&self) -> u64 {
        millis(self.started.elapsed())
    }

    /// Records a library call `op` made at `at` (with bound `bound`) that returned `ok`.
    fn timed(&mut self, op: &'static str, at: Instant, bound: Duration, ok: bool) {
        self.out.library.push(LibraryCall {
            op,
            worker: self.id,
            at_ms: millis(at.duration_since(self.started)),
            duration_us: u64::try_from(at.elapsed().as_micros()).unwrap_or(u64::MAX),
            bound_ms: millis(bound),
            ok,
        });
    }

    /// Releases `lease`, timed.
    async fn release(&mut self, lease: &Lease) -> pgfence::Result<ReleaseOutcome> {
        let at = Instant::now();
        let released = self.ctx.issuer.release(lease).await;
        self.timed("release", at, ISSUER_BOUND, released.is_ok());
        released
    }

    /// Waits for `resource`'s lock. `None` (counted) when the wait ran out or the issuer
    /// failed.
    async fn acquire(&mut self, resource: &Resource) -> Option<Lease> {
        let cfg = &self.ctx.cfg;
        let at = Instant::now();
        let got = self
            .ctx
            .issuer
            .acquire_wait(resource, cfg.ttl, cfg.acquire_wait)
            .await;
        let bound = cfg.acquire_wait + ISSUER_BOUND;
        self.timed("acquire_wait", at, bound, got.is_ok());
        match got {
            Ok(Some(lease)) => Some(lease),
            Ok(None) => {
                self.out.stats.acquire_timeouts += 1;
                None
            }
            Err(e) => {
                let now = self.now();
                let stats = &mut self.out.stats;
                stats.acquire_errors += 1;
                stats.acquire_error_at.push(now);
                *stats
                    .acquire_error_kinds
                    .entry((classify(&e), e.is_retryable()))
                    .or_default() += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
                None
            }
        }
    }
}

/// One try of a unit's write, and how far it got.
struct Try<'a> {
    ctx: &'a Ctx,
    lease: &'a Lease,
    row: i32,
    unit: u64,
    try_no: u32,
    worker: usize,
    /// The stall injected into this try.
    pause: Pause,
    /// The value read, once read.
    read: Option<i64>,
    /// The value written, once the write statement succeeded.
    written: Option<i64>,
    /// The script transaction this try starts at.
    first_txn: u32,
    /// Transactions committed (acknowledged) so far.
    commits: u32,
    /// Multi-statement modes: the value the unit believes the row holds (read, claimed, or
    /// written last).
    believed: i64,
    /// Row-claim mode: whether the unit's increment is known to have been applied (by this try
    /// or, as its claim read back from `last_unit`, by an earlier one).
    applied: bool,
    /// Batch mode: the unit's rows and each row's outcomes in this try.
    batch: BatchRows,
    /// Batch mode: the rows this try's claim got, by position in `batch.rows`.
    claimed: Vec<Option<ClaimCell>>,
    /// The run's clock (for the effect records' times).
    clock: Instant,
    /// Effects modes: this try's ledger begins and provider calls.
    begins: Vec<BeginRecord>,
    calls: Vec<CallRecord>,
    /// The library calls of this try, timed.
    library: Vec<LibraryCall>,
    /// Effects modes: the begin found the charge recorded as done, and the call was skipped.
    done_skip: bool,
}

impl Try<'_> {
    /// The unit as stored in `last_unit` and the history.
    fn unit_id(&self) -> i64 {
        i64::try_from(self.unit).unwrap_or(i64::MAX)
    }

    async fn begin(&self) -> Step<Transaction<'static, Postgres>> {
        self.ctx
            .pool_of(self.worker)
            .begin()
            .await
            .map_err(db_at(Stage::Begin))
    }

    /// Reads the row's value, in `tx` if given, else on the pool.
    async fn read_value(&self, tx: Option<&mut PgConnection>) -> Step<i64> {
        let query = sqlx::query_scalar(self.ctx.plan.table.read_sql())
            .bind(self.ctx.run.as_str())
            .bind(self.row);
        match tx {
            Some(conn) => query.fetch_one(conn).await,
            None => query.fetch_one(self.ctx.pool_of(self.worker)).await,
        }
        .map_err(db_at(Stage::Read))
    }

    /// Inserts the history row, copying the row's new version and value.
    async fn record(
        &self,
        conn: &mut PgConnection,
        value_read: i64,
        txn: u32,
        step: i32,
        kind: Kind,
    ) -> Step<()> {
        sqlx::query(self.ctx.plan.table.record_sql())
            .bind(self.ctx.run.as_str())
            .bind(self.row)
            .bind(self.lease.token().get())
            .bind(value_read)
            .bind(self.unit_id())
            .bind(i32::try_from(self.try_no).unwrap_or(i32::MAX))
            .bind(i32::try_from(self.worker).unwrap_or(i32::MAX))
            .bind(i32::try_from(txn).unwrap_or(i32::MAX))
            .bind(step)
            .bind(kind.as_str())
            .execute(conn)
            .await
            .map_err(db_at(Stage::Record))?;
        Ok(())
    }
}

/// A short, stable description of an error, for grouping.
pub(crate) fn classify(e: &Error) -> String {
    use pgfence::error::BackendKind;
    let Error::Backend(b) = e else {
        let text = e.to_string();
        return text.chars().take(80).collect();
    };
    match (b.kind(), b.as_sqlx()) {
        (_, Some(sqlx::Error::Database(db))) => {
            format!("database sqlstate {}", db.code().as_deref().unwrap_or("?"))
        }
        (_, Some(sqlx::Error::Io(io))) => format!("database io {:?}", io.kind()),
        (_, Some(sqlx::Error::PoolTimedOut)) => "database pool timed out".into(),
        (_, Some(sqlx::Error::PoolClosed)) => "database pool closed".into(),
        (_, Some(other)) => {
            let text = other.to_string();
            format!("database {}", text.chars().take(80).collect::<String>())
        }
        (BackendKind::Redis, _) => match b.as_redis() {
            Some(r) => format!("redis {:?}", r.kind()),
            None => "redis".into(),
        },
        // etcd's gRPC statuses carry a free-text message (addresses, ids): group by the status.
        _ => {
            let text = e.to_string();
            let head = text.split(", message").next().unwrap_or_default();
            head.chars().take(80).collect()
        }
    }
}
