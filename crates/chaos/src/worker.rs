//! The workers: take a row's lock, then read-modify-write the row as the run's [`Mode`]
//! prescribes, recording every lease and every try.
//!
//! A worker's loop ([`worker`]) handles leases, stalls, retries and releases; one try of a
//! write is a [`Try`], which runs the steps a [`Plan`] lists. The plan is what differs between
//! modes: a new mode is a new [`Plan::of`] arm, and a new kind of write a new [`WriteKind`].
//! The multi-statement modes (`fenced-multi`, `row-claim`, `batch`) draw a [`Script`] per unit
//! — which statements ([`Op`]s) run in which of the unit's transactions — and a try runs it.
//! A batch unit also draws its rows: 10–100 distinct rows of its lease's group, sent in
//! ascending order (so concurrent batches lock shared rows in one order).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use pgfence::{
    Error, Lease, Resource, effect::EffectOutcome, error::StaleTarget, issuer::ReleaseOutcome,
    repository::Claimed,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sqlx::{PgConnection, Postgres, Transaction};
use tokio::time::Instant;

use crate::faults::reset_counters;
use crate::harness::{Ctx, EffectsCtx};
use crate::schema::{Cell, ClaimCell, CounterTable, Kind, RECORD_MANY_SQL, WRITE_PLAIN};
use crate::util::millis;
use crate::{Attempt, BatchRows, LeaseRecord, LibraryCall, Mode, Outcome, RowResult, Stage};

/// How a mode's tries run.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Plan {
    /// The counter table read, written and recorded.
    pub(crate) table: CounterTable,
    /// Open the transaction before the read and [`pgfence::Fence::check`] the resource first
    /// in it, so the read is ordered by the check. Otherwise the read runs on its own and the
    /// transaction only holds the write and its history row.
    check_first: bool,
    /// How the row is written.
    write: WriteKind,
    /// One transaction per try (the plan's other fields apply), or a [`Script`] per unit.
    script: Option<ScriptKind>,
    /// The effects modes' job (claim, record the effect, call the provider, record the
    /// outcome and the increment), with the idempotency keys it sends; it replaces the plan's
    /// other steps.
    pub(crate) effects: Option<Keys>,
}

/// Where the effects modes' provider call takes its idempotency key from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Keys {
    /// [`pgfence::effect::Effect::idempotency_key`]: the same for every holder of the work item.
    Ledger,
    /// `<item>-<token>`: the classic mistake, a key per lease (a retry of the same lease
    /// reuses it; the holder that takes the work over does not).
    PerLease,
}

/// The multi-statement modes' unit shapes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ScriptKind {
    /// 2–3 transactions, each check, read, fenced increment.
    MultiCheck,
    /// Claim, then 2–4 fenced updates (the first increments), over 1–3 transactions.
    RowClaim,
    /// `claim_many` of the unit's rows, then one `update_many` of the claimed rows, in one
    /// transaction or two.
    Batch,
}

/// One statement of a multi-statement unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    /// `Fence::check` of the row's resource.
    Check,
    /// Read the value.
    Read,
    /// Fenced update to the value read plus one.
    Increment,
    /// `Repository::claim`: fence the row and read it.
    Claim,
    /// Fenced update number `n` (from 1) after the claim: the first one that finds the unit's
    /// increment not yet applied writes value + 1, the others rewrite the value with `step = n`.
    Update(i32),
    /// `Repository::claim_many` of the unit's rows: fences and reads each; rows a newer lease
    /// got first are rejected one by one (and audited), the others are claimed.
    ClaimMany,
    /// `Repository::update_many` of the claimed rows in one statement: value + 1 for each (a
    /// rewrite of the value for a row whose `last_unit` says this unit's increment already
    /// landed, in an earlier try whose acknowledgement was lost), one outcome per row.
    UpdateMany,
}

/// A unit's statements, grouped in its transactions.
#[derive(Clone, Debug)]
struct Script {
    txns: Vec<Vec<Op>>,
}

impl Script {
    /// Draws a unit's script.
    fn draw(kind: ScriptKind, rng: &mut StdRng) -> Self {
        match kind {
            ScriptKind::MultiCheck => {
                let n = rng.random_range(2..=3);
                Script {
                    txns: (0..n)
                        .map(|_| vec![Op::Check, Op::Read, Op::Increment])
                        .collect(),
                }
            }
            ScriptKind::RowClaim => {
                let writes = rng.random_range(2..=4);
                let mut ops = vec![Op::Claim];
                ops.extend((1..=writes).map(Op::Update));
                // 1–3 transactions: cut the statement list at distinct points.
                let txns = rng.random_range(1..=3usize);
                let mut cuts: Vec<usize> = Vec::new();
                while cuts.len() + 1 < txns {
                    let c = rng.random_range(1..ops.len());
                    if !cuts.contains(&c) {
                        cuts.push(c);
                    }
                }
                cuts.sort_unstable();
                let mut groups = Vec::new();
                let mut from = 0;
                for c in cuts.into_iter().chain([ops.len()]) {
                    groups.push(ops[from..c].to_vec());
                    from = c;
                }
                Script { txns: groups }
            }
            ScriptKind::Batch => {
                // The claim commits on its own half of the time, so a stall after it leaves a
                // zombie whose claimed rows newer leases can take over; otherwise a stall
                // inside the transaction holds the rows' locks and only delays the others.
                let txns = if rng.random_bool(0.5) {
                    vec![vec![Op::ClaimMany], vec![Op::UpdateMany]]
                } else {
                    vec![vec![Op::ClaimMany, Op::UpdateMany]]
                };
                Script { txns }
            }
        }
    }

    /// Statements in all.
    fn len(&self) -> usize {
        self.txns.iter().map(Vec::len).sum()
    }

    /// Transactions.
    fn txn_count(&self) -> u32 {
        u32::try_from(self.txns.len()).unwrap_or(u32::MAX)
    }
}

/// How a try writes the row.
#[derive(Clone, Copy, Debug)]
enum WriteKind {
    /// A plain `UPDATE ... SET value = $1` (no token).
    Plain,
    /// A fenced [`pgfence::Repository::update`] with the lease's token.
    Fenced,
}

impl Plan {
    /// The plan of `mode`.
    pub(crate) fn of(mode: Mode) -> Self {
        let table = CounterTable::of(mode);
        match mode {
            Mode::Fenced => Plan {
                table,
                check_first: true,
                write: WriteKind::Fenced,
                script: None,
                effects: None,
            },
            Mode::FencedMulti => Plan {
                table,
                check_first: true,
                write: WriteKind::Fenced,
                script: Some(ScriptKind::MultiCheck),
                effects: None,
            },
            // Leaseless mode: row-claim's leases; the lease-less writers run beside them.
            Mode::RowClaim | Mode::LeaselessMix => Plan {
                table,
                check_first: false,
                write: WriteKind::Fenced,
                script: Some(ScriptKind::RowClaim),
                effects: None,
            },
            Mode::Batch => Plan {
                table,
                check_first: false,
                write: WriteKind::Fenced,
                script: Some(ScriptKind::Batch),
                effects: None,
            },
            Mode::RowFence => Plan {
                table,
                check_first: false,
                write: WriteKind::Fenced,
                script: None,
                effects: None,
            },
            Mode::Unfenced => Plan {
                table,
                check_first: false,
                write: WriteKind::Plain,
                script: None,
                effects: None,
            },
            Mode::Effects | Mode::EffectsUnkeyed => Plan {
                table,
                check_first: false,
                write: WriteKind::Fenced,
                script: None,
                effects: Some(if mode == Mode::Effects {
                    Keys::Ledger
                } else {
                    Keys::PerLease
                }),
            },
        }
    }
}

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

/// Effects modes: a lease recorded the charge of `item` in the ledger ([`pgfence::Effects::begin`]
/// returned, so it had committed by `at_ms`).
pub(crate) struct BeginRecord {
    pub(crate) item: String,
    pub(crate) token: i64,
    /// When the begin returned (ms since the run started).
    pub(crate) at_ms: u64,
}

/// Effects modes: one provider call.
pub(crate) struct CallRecord {
    pub(crate) item: String,
    pub(crate) token: i64,
    /// When the request was sent (ms since the run started).
    pub(crate) started_ms: u64,
    pub(crate) answer: CallAnswer,
}

/// What a provider call came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum CallAnswer {
    /// `200`, a new charge.
    Charged,
    /// `200` replayed for a known key: no charge.
    Replayed,
    /// `409`: the key's first request was still in flight; no charge.
    Conflict,
    /// Another status (`422`: the key came with another body).
    Status(u16),
    /// No answer (connection error, timeout): it may have charged.
    NoAnswer,
}

/// The stall a unit injects into its first try.
#[derive(Clone, Copy)]
enum Pause {
    None,
    BeforeRead(Duration),
    BeforeWrite(Duration),
    /// Before statement `n` of a multi-statement unit (counted over the whole script): between
    /// two transactions when it starts one, inside one otherwise.
    BeforeOp(usize, Duration),
    /// Effects modes: before this step of the job.
    Effect(StallBefore, Duration),
}

/// Which step of the effects job a stall comes before.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum StallBefore {
    /// Before the claim (a zombie whose claim meets a newer lease's, or goes through).
    Claim,
    /// Between the committed claim and the ledger's begin (a zombie refused by the begin).
    Begin,
    /// Between the ledger's begin and the provider call: the dangerous spot, where the zombie
    /// calls late with the work item already taken over.
    Call,
    /// Between the provider's answer and the outcome's transaction (a zombie that charged
    /// and is refused by the finish; the holder that took over gets the replay).
    Finish,
}

impl Pause {
    fn before_op(self, n: usize) -> Option<Duration> {
        match self {
            Pause::BeforeOp(at, d) if at == n => Some(d),
            _ => None,
        }
    }

    fn before_read(self) -> Option<Duration> {
        match self {
            Pause::BeforeRead(d) => Some(d),
            _ => None,
        }
    }

    fn before_write(self) -> Option<Duration> {
        match self {
            Pause::BeforeWrite(d) => Some(d),
            _ => None,
        }
    }

    fn at(self, point: StallBefore) -> Option<Duration> {
        match self {
            Pause::Effect(p, d) if p == point => Some(d),
            _ => None,
        }
    }

    fn length(self) -> Duration {
        match self {
            Pause::None => Duration::ZERO,
            Pause::BeforeRead(d)
            | Pause::BeforeWrite(d)
            | Pause::BeforeOp(_, d)
            | Pause::Effect(_, d) => d,
        }
    }
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

    /// One work unit with `lease`: maybe a counter reset, maybe a stall, the tries, the
    /// release.
    async fn unit(&mut self, lease: &Lease, row: i32, unit: u64, asked_at_ms: u64) {
        let ctx = self.ctx.clone();
        let cfg = &ctx.cfg;
        let lease_at_ms = self.now();
        self.out.leases.push(LeaseRecord {
            unit,
            worker: self.id,
            row,
            token: lease.token().get(),
            asked_at_ms,
            at_ms: lease_at_ms,
        });
        if cfg.reset_counters_at.contains(&unit) {
            reset_counters(&ctx).await;
        }
        let script = ctx
            .plan
            .script
            .map(|kind| Script::draw(kind, &mut self.rng));
        let batch_rows = if ctx.plan.script == Some(ScriptKind::Batch) {
            self.draw_batch_rows(row)
        } else {
            Vec::new()
        };
        let pause = self.pick_pause(script.as_ref().map(Script::len));
        let mut try_no = 0u32;
        let mut first_txn = 0u32;
        loop {
            let started_ms = self.now();
            let mut t = Try {
                ctx: &ctx,
                lease,
                row,
                unit,
                try_no,
                worker: self.id,
                pause: if try_no == 0 { pause } else { Pause::None },
                read: None,
                written: None,
                first_txn,
                commits: 0,
                believed: 0,
                applied: false,
                batch: BatchRows {
                    rows: batch_rows.clone(),
                    ..BatchRows::default()
                },
                claimed: Vec::new(),
                clock: self.started,
                begins: Vec::new(),
                calls: Vec::new(),
                library: Vec::new(),
                done_skip: false,
            };
            let result = match (&script, ctx.plan.effects) {
                (_, Some(keys)) => t.run_effects(keys).await,
                (Some(script), None) => t.run_script(script).await,
                (None, None) => t.run().await,
            };
            self.out.begins.append(&mut t.begins);
            self.out.calls.append(&mut t.calls);
            self.out.library.append(&mut t.library);
            self.out.stats.done_skips += u64::from(t.done_skip);
            let (outcome, stale) = outcome(result);
            // A batch try that went on with the rows it got may still have met a lost counter.
            let stale = stale.or_else(|| t.batch_rejection(None));
            // Through an outage (a database failover), a unit keeps retrying past `retries`.
            let outage = cfg
                .outage_retry
                .is_some_and(|d| self.now().saturating_sub(lease_at_ms) < millis(d));
            let retry = matches!(
                outcome,
                Outcome::Failed {
                    retryable: true,
                    ..
                }
            ) && (try_no < cfg.retries || outage)
                && !ctx.shared.done.load(Ordering::SeqCst);
            self.out.attempts.push(Attempt {
                unit,
                try_no,
                worker: self.id,
                row,
                token: lease.token().get(),
                lease_at_ms,
                started_ms,
                finished_ms: self.now(),
                paused_ms: millis(t.pause.length()),
                value_read: t.read,
                value_written: t.written,
                first_txn: t.first_txn,
                commits: t.commits,
                outcome,
                batch: (ctx.plan.script == Some(ScriptKind::Batch))
                    .then(|| std::mem::take(&mut t.batch)),
            });
            if let Some(err) = stale
                && cfg.recovery.recover_from
                && let Ok(true) = ctx.issuer.recover_from(&err).await
            {
                self.out.stats.counter_raises += 1;
            }
            if !retry {
                break;
            }
            self.out.stats.retries += 1;
            // A fenced-multi retry resumes at the transaction that failed (each one checks and
            // reads afresh); a row-claim retry claims again from the start (the claim reads
            // back whether the unit's increment landed).
            if ctx.plan.script == Some(ScriptKind::MultiCheck) {
                first_txn = t.first_txn + t.commits;
            }
            try_no += 1;
            let backoff = if try_no > cfg.retries {
                self.rng.random_range(20..60)
            } else {
                self.rng.random_range(5..25)
            };
            tokio::time::sleep(Duration::from_millis(backoff)).await;
        }
        match self.release(lease).await {
            Ok(ReleaseOutcome::AlreadyExpired) => self.out.stats.released_expired += 1,
            Ok(ReleaseOutcome::TakenByOther) => self.out.stats.released_taken += 1,
            Ok(ReleaseOutcome::Released) | Err(_) => {}
        }
    }

    /// Batch mode: the rows a unit of `group` writes — between `batch_min_rows` and
    /// `batch_max_rows` distinct rows of the group (all of them if it is smaller), ascending.
    fn draw_batch_rows(&mut self, group: i32) -> Vec<i32> {
        let cfg = &self.ctx.cfg;
        let range = cfg.group_rows(usize::try_from(group).unwrap_or(0));
        let len = usize::try_from(range.end - range.start).unwrap_or(0);
        let lo = cfg.batch_min_rows.min(len);
        let hi = cfg.batch_max_rows.min(len).max(lo);
        let n = self.rng.random_range(lo..=hi);
        let mut rows: Vec<i32> = rand::seq::index::sample(&mut self.rng, len, n)
            .into_iter()
            .map(|i| range.start + i32::try_from(i).unwrap_or(0))
            .collect();
        rows.sort_unstable();
        rows
    }

    /// Decides whether this unit stalls, for how long, and where (`ops`: the statements of a
    /// multi-statement unit).
    fn pick_pause(&mut self, ops: Option<usize>) -> Pause {
        let cfg = &self.ctx.cfg;
        if !self.rng.random_bool(cfg.pause_probability) {
            return Pause::None;
        }
        let lo = millis(cfg.pause_min);
        let hi = millis(cfg.pause_max).max(lo);
        let d = Duration::from_millis(self.rng.random_range(lo..=hi));
        self.out.stats.pauses += 1;
        if self.ctx.plan.effects.is_some() {
            // Most stalls at the dangerous spot, between recording the effect and the call.
            let point = match self.rng.random_range(0..10) {
                0 => StallBefore::Claim,
                1 | 2 => StallBefore::Begin,
                3 | 4 => StallBefore::Finish,
                _ => StallBefore::Call,
            };
            self.out.stats.stalls_before_call += u64::from(point == StallBefore::Call);
            return Pause::Effect(point, d);
        }
        if let Some(ops) = ops {
            return Pause::BeforeOp(self.rng.random_range(0..ops.max(1)), d);
        }
        if self.rng.random_bool(0.5) {
            Pause::BeforeRead(d)
        } else {
            Pause::BeforeWrite(d)
        }
    }
}

/// What a try's result comes to, and the rejection to recover from if it was one.
fn outcome(result: Step<()>) -> (Outcome, Option<Error>) {
    let (stage, error) = match result {
        Ok(()) => return (Outcome::Accepted, None),
        Err(Failure::Provider { error, retryable }) => {
            let failed = Outcome::Failed {
                stage: Stage::Call,
                retryable,
                error,
            };
            return (failed, None);
        }
        Err(Failure::Fence { stage, error }) => (stage, error),
    };
    // The rejections are fencing at work (and audited): a newer lease got there first, or
    // the counter went backwards and another lease already presented this token, or a
    // lease-less writer bypassed the guard on the row after this lease wrote it (sealed: it
    // must not write its stale picture of the row back; nothing to recover).
    // Or the database failed over since the lease's first statement (fenced out whatever
    // its rows say; nothing to recover either: the counter is not behind).
    let rejected = match &error {
        Error::StaleToken { current, .. } => Some((*current, false, false, false)),
        Error::DuplicateToken { token, .. } => Some((*token, true, false, false)),
        Error::RowSealed { token, .. } => Some((*token, false, true, false)),
        Error::FencedByFailover { presented, .. } => Some((*presented, false, false, true)),
        _ => None,
    };
    match rejected {
        Some((current, duplicate, sealed, failover)) => {
            let by = match stage {
                Stage::Check => "check",
                Stage::Claim => "claim",
                Stage::Effect => "effect",
                Stage::Finish => "effect_finish",
                _ => "update",
            };
            let rejected = Outcome::Rejected {
                current,
                by,
                duplicate,
                sealed,
                failover,
            };
            (rejected, (!sealed && !failover).then_some(error))
        }
        None => {
            let failed = Outcome::Failed {
                stage,
                retryable: error.is_retryable(),
                error: classify(&error),
            };
            (failed, None)
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
    /// Runs the plan's steps: (check,) read, write, record, commit.
    async fn run(&mut self) -> Step<()> {
        let plan = self.ctx.plan;
        stall(self.pause.before_read()).await;
        let mut early_tx = None;
        if plan.check_first {
            let mut tx = self.begin().await?;
            self.ctx
                .fence
                .check(&mut *tx, self.lease.resource(), self.lease)
                .await
                .map_err(at(Stage::Check))?;
            early_tx = Some(tx);
        }
        let value = self.read_value(early_tx.as_deref_mut()).await?;
        self.read = Some(value);
        stall(self.pause.before_write()).await;
        let mut tx = match early_tx {
            Some(tx) => tx,
            None => self.begin().await?,
        };
        self.write_value(&mut tx, value + 1).await?;
        self.written = Some(value + 1);
        self.record(&mut tx, value, 0, 0, Kind::Increment).await?;
        tx.commit().await.map_err(db_at(Stage::Commit))?;
        self.commits = 1;
        Ok(())
    }

    /// The effects modes' job, a try of it: claim the row in its own transaction (the value
    /// read is the number of the row's invoices paid, so the next one is the work item) —
    /// or, when the claim reads back that this unit's payment already committed (its
    /// acknowledgement lost), stop; record the charge in the ledger (committed at once, on the
    /// pool: a holder that takes over sees the key); unless a holder recorded it done, call
    /// the provider with the key `keys` says; then, in one transaction, record the outcome,
    /// mark the invoice paid (fenced increment) and record the history row. Stalls may fall
    /// at any [`StallBefore`]. A `409` (the key in flight elsewhere) or a call without answer
    /// fails the try, retryable: a retry (or a later holder) calls again with the same key.
    async fn run_effects(&mut self, keys: Keys) -> Step<()> {
        let ctx = self.ctx;
        let Some(fx) = ctx.effects.as_ref() else {
            return Err(Failure::Provider {
                error: "no provider".into(),
                retryable: false,
            });
        };
        stall(self.pause.at(StallBefore::Claim)).await;
        let mut tx = self.begin().await?;
        let key = (ctx.run.clone(), self.row);
        let claimed: ClaimCell = ctx
            .claim_repo
            .claim(&mut *tx, self.lease, &key)
            .await
            .map_err(at(Stage::Claim))?;
        self.read = Some(claimed.value);
        self.believed = claimed.value;
        self.applied = claimed.last_unit == self.unit_id();
        self.record(&mut tx, claimed.value, 0, 0, Kind::Claim)
            .await?;
        tx.commit().await.map_err(db_at(Stage::Commit))?;
        self.commits = 1;
        if self.applied {
            // An earlier try's payment committed; only its acknowledgement was lost.
            return Ok(());
        }
        let invoice = claimed.value;
        let item = invoice_item(self.row, invoice);

        stall(self.pause.at(StallBefore::Begin)).await;
        let effect = fx
            .ledger
            .begin(ctx.pool_of(self.worker), self.lease, &item, CHARGE_STEP)
            .await
            .map_err(at(Stage::Effect))?;
        self.begins.push(BeginRecord {
            item: item.clone(),
            token: self.lease.token().get(),
            at_ms: millis(self.clock.elapsed()),
        });
        let outcome = match effect.recorded() {
            Some(recorded @ EffectOutcome::Succeeded(_)) => {
                self.done_skip = true;
                recorded.clone()
            }
            _ => {
                stall(self.pause.at(StallBefore::Call)).await;
                let key = match keys {
                    Keys::Ledger => effect.idempotency_key().to_owned(),
                    Keys::PerLease => format!("{item}-{}", self.lease.token().get()),
                };
                self.call(fx, &item, key, invoice).await?
            }
        };

        stall(self.pause.at(StallBefore::Finish)).await;
        let mut tx = self.begin().await?;
        fx.ledger
            .finish(&mut *tx, self.lease, &effect, outcome)
            .await
            .map_err(at(Stage::Finish))?;
        let cell = ClaimCell {
            run: ctx.run.clone(),
            id: self.row,
            value: invoice + 1,
            step: 1,
            last_unit: self.unit_id(),
        };
        ctx.claim_repo
            .update(&mut *tx, self.lease, &cell)
            .await
            .map_err(at(Stage::Write))?;
        self.written = Some(invoice + 1);
        self.believed = invoice + 1;
        self.record(&mut tx, invoice, 1, 1, Kind::Increment).await?;
        tx.commit().await.map_err(db_at(Stage::Commit))?;
        self.commits = 2;
        self.applied = true;
        Ok(())
    }

    /// Effects modes: charges `item` (invoice number `invoice` of the row) at the provider with
    /// idempotency key `key`, and records the call. A `200` (a charge, or the replay of an
    /// earlier one) is the outcome to record; anything else fails the try.
    async fn call(
        &mut self,
        fx: &EffectsCtx,
        item: &str,
        key: String,
        invoice: i64,
    ) -> Step<EffectOutcome> {
        let url = fx.url.clone();
        let body_item = item.to_owned();
        let amount = 100 + invoice;
        let timeout = self.ctx.cfg.provider_latency + Duration::from_secs(2);
        let started_ms = millis(self.clock.elapsed());
        let answer = tokio::task::spawn_blocking(move || {
            pgfence_testkit::provider::charge(&url, Some(&key), &body_item, amount, timeout)
        })
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
        let (kind, result) = match answer {
            Ok(a) if a.status == 200 => {
                let detail = serde_json::json!({
                    "answer": serde_json::from_str::<serde_json::Value>(&a.body)
                        .unwrap_or(serde_json::Value::String(a.body)),
                    "replayed": a.replayed,
                });
                let kind = if a.replayed {
                    CallAnswer::Replayed
                } else {
                    CallAnswer::Charged
                };
                (kind, Ok(EffectOutcome::Succeeded(detail)))
            }
            Ok(a) if a.status == 409 => (
                CallAnswer::Conflict,
                Err(Failure::Provider {
                    error: "provider 409 conflict (the key is in flight elsewhere)".into(),
                    retryable: true,
                }),
            ),
            Ok(a) => (
                CallAnswer::Status(a.status),
                Err(Failure::Provider {
                    error: format!("provider status {}", a.status),
                    retryable: false,
                }),
            ),
            Err(e) => (
                CallAnswer::NoAnswer,
                Err(Failure::Provider {
                    error: format!("provider io {:?}", e.kind()),
                    retryable: true,
                }),
            ),
        };
        self.calls.push(CallRecord {
            item: item.to_owned(),
            token: self.lease.token().get(),
            started_ms,
            answer: kind,
        });
        result
    }

    /// Runs a multi-statement unit's script from transaction `first_txn` on: each transaction
    /// begins (after a stall placed before its first statement), runs its statements (a stall
    /// may fall between two of them) and commits.
    async fn run_script(&mut self, script: &Script) -> Step<()> {
        let mut n = 0usize;
        for (txn, ops) in script.txns.iter().enumerate() {
            let first = n;
            n += ops.len();
            let txn = u32::try_from(txn).unwrap_or(u32::MAX);
            if txn < self.first_txn {
                continue;
            }
            stall(self.pause.before_op(first)).await;
            let mut tx = self.begin().await?;
            for (i, op) in ops.iter().enumerate() {
                if i > 0 {
                    stall(self.pause.before_op(first + i)).await;
                }
                self.op(&mut tx, *op, txn, first + i).await?;
            }
            tx.commit().await.map_err(db_at(Stage::Commit))?;
            self.commits += 1;
        }
        debug_assert_eq!(self.first_txn + self.commits, script.txn_count());
        Ok(())
    }

    /// Runs one statement of a script (and records it, if it changed the row) in `conn`'s
    /// transaction.
    async fn op(&mut self, conn: &mut PgConnection, op: Op, txn: u32, n: usize) -> Step<()> {
        let step = i32::try_from(n).unwrap_or(i32::MAX);
        match op {
            Op::Check => self
                .ctx
                .fence
                .check(&mut *conn, self.lease.resource(), self.lease)
                .await
                .map_err(at(Stage::Check)),
            Op::Read => {
                let value = self.read_value(Some(conn)).await?;
                self.read.get_or_insert(value);
                self.believed = value;
                Ok(())
            }
            Op::Increment => {
                let read = self.believed;
                self.write_value(&mut *conn, read + 1).await?;
                self.written = Some(read + 1);
                self.believed = read + 1;
                self.record(conn, read, txn, step, Kind::Increment).await
            }
            Op::Claim => {
                let key = (self.ctx.run.clone(), self.row);
                let claimed: ClaimCell = self
                    .ctx
                    .claim_repo
                    .claim(&mut *conn, self.lease, &key)
                    .await
                    .map_err(at(Stage::Claim))?;
                self.read.get_or_insert(claimed.value);
                self.believed = claimed.value;
                self.applied = claimed.last_unit == self.unit_id();
                self.record(conn, claimed.value, txn, step, Kind::Claim)
                    .await
            }
            Op::Update(k) => {
                let read = self.believed;
                let (value, kind) = if self.applied {
                    (read, Kind::Rewrite)
                } else {
                    (read + 1, Kind::Increment)
                };
                let cell = ClaimCell {
                    run: self.ctx.run.clone(),
                    id: self.row,
                    value,
                    step: k,
                    last_unit: self.unit_id(),
                };
                self.ctx
                    .claim_repo
                    .update(&mut *conn, self.lease, &cell)
                    .await
                    .map_err(at(Stage::Write))?;
                self.written = Some(value);
                self.believed = value;
                self.applied = true;
                self.record(conn, read, txn, step, kind).await
            }
            Op::ClaimMany => self.claim_many(conn, txn, step).await,
            Op::UpdateMany => self.update_many(conn, txn, step).await,
        }
    }

    /// Batch mode: claims the unit's rows in one statement and records the claimed ones. Fails
    /// (rejected) only when no row was claimed; the others go on to the update.
    async fn claim_many(&mut self, conn: &mut PgConnection, txn: u32, step: i32) -> Step<()> {
        let keys: Vec<(String, i32)> = self
            .batch
            .rows
            .iter()
            .map(|&row| (self.ctx.run.clone(), row))
            .collect();
        let claimed: Claimed<ClaimCell> = self
            .ctx
            .claim_repo
            .claim_many(&mut *conn, self.lease, &keys)
            .await
            .map_err(at(Stage::Claim))?;
        self.batch.claim = claimed.outcome.rows.iter().map(|&o| o.into()).collect();
        self.claimed = claimed.rows;
        let mut recorded = Recorded::default();
        for cell in self.claimed.iter().flatten() {
            recorded.push(cell.id, cell.value, Kind::Claim);
        }
        if recorded.ids.is_empty() {
            return Err(self.no_rows_left(Stage::Claim));
        }
        self.record_many(conn, recorded, txn, step).await
    }

    /// Batch mode: writes value + 1 to every claimed row in one statement (a rewrite where
    /// `last_unit` shows this unit's increment already landed) and records the applied ones.
    /// Fails (rejected) only when no row was applied.
    async fn update_many(&mut self, conn: &mut PgConnection, txn: u32, step: i32) -> Step<()> {
        let unit = self.unit_id();
        let mut positions = Vec::new();
        let mut cells = Vec::new();
        for (i, claimed) in self.claimed.iter().enumerate() {
            if let Some(c) = claimed {
                let done = c.last_unit == unit;
                positions.push((i, c.value, done));
                cells.push(ClaimCell {
                    run: self.ctx.run.clone(),
                    id: c.id,
                    value: if done { c.value } else { c.value + 1 },
                    step: 1,
                    last_unit: unit,
                });
            }
        }
        let outcome = self
            .ctx
            .claim_repo
            .update_many(&mut *conn, self.lease, &cells)
            .await
            .map_err(at(Stage::Write))?;
        let mut write = vec![RowResult::Skipped; self.batch.rows.len()];
        let mut recorded = Recorded::default();
        for (k, &(i, read, done)) in positions.iter().enumerate() {
            let result = outcome
                .rows
                .get(k)
                .map_or(RowResult::Contended, |&o| o.into());
            write[i] = result;
            if result == RowResult::Applied {
                let kind = if done { Kind::Rewrite } else { Kind::Increment };
                recorded.push(cells[k].id, read, kind);
            }
        }
        self.batch.write = write;
        if recorded.ids.is_empty() {
            return Err(self.no_rows_left(Stage::Write));
        }
        self.record_many(conn, recorded, txn, step).await
    }

    /// Batch mode: why a statement left no row to go on with — the rejection its rows met
    /// (the newest stale token, else a duplicate token), or, if none was rejected, contention
    /// (retryable).
    fn no_rows_left(&self, stage: Stage) -> Failure {
        let rows = match stage {
            Stage::Claim => &self.batch.claim,
            _ => &self.batch.write,
        };
        let error = self
            .batch_rejection(Some(rows))
            .unwrap_or(Error::Contended {
                table: CounterTable::Guarded.name().to_owned(),
                operation: if stage == Stage::Claim {
                    "claim"
                } else {
                    "update"
                },
            });
        Failure::Fence { stage, error }
    }

    /// Batch mode: the rejection `rows` (by default every row outcome of this try) met, as the
    /// error a single write would have returned: [`Error::StaleToken`] with the newest token
    /// met, else [`Error::DuplicateToken`]; `None` when no row was rejected. It names the
    /// lease's resource, so [`pgfence::RedisIssuer::recover_from`] can raise its counter.
    fn batch_rejection(&self, rows: Option<&[RowResult]>) -> Option<Error> {
        let all: Vec<RowResult>;
        let rows = match rows {
            Some(rows) => rows,
            None => {
                all = self
                    .batch
                    .claim
                    .iter()
                    .chain(&self.batch.write)
                    .copied()
                    .collect();
                &all
            }
        };
        let target = || StaleTarget::Resource(self.lease.resource().to_string());
        let token = self.lease.token().get();
        let newest = rows
            .iter()
            .filter_map(|r| match r {
                RowResult::Stale { current } => Some(*current),
                _ => None,
            })
            .max();
        match newest {
            Some(current) => Some(Error::StaleToken {
                target: target(),
                presented: token,
                current,
                other_counter: false,
            }),
            None if rows.contains(&RowResult::Duplicate) => Some(Error::DuplicateToken {
                target: target(),
                token,
            }),
            None => None,
        }
    }

    /// Batch mode: inserts the history rows of a batch statement's rows in one statement.
    async fn record_many(
        &self,
        conn: &mut PgConnection,
        recorded: Recorded,
        txn: u32,
        step: i32,
    ) -> Step<()> {
        sqlx::query(RECORD_MANY_SQL)
            .bind(self.ctx.run.as_str())
            .bind(recorded.ids)
            .bind(self.lease.token().get())
            .bind(recorded.reads)
            .bind(self.unit_id())
            .bind(i32::try_from(self.try_no).unwrap_or(i32::MAX))
            .bind(i32::try_from(self.worker).unwrap_or(i32::MAX))
            .bind(i32::try_from(txn).unwrap_or(i32::MAX))
            .bind(step)
            .bind(recorded.kinds)
            .execute(conn)
            .await
            .map_err(db_at(Stage::Record))?;
        Ok(())
    }

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

    /// Writes `value` to the row as the plan says.
    async fn write_value(&mut self, conn: &mut PgConnection, value: i64) -> Step<()> {
        let run = self.ctx.run.as_str();
        match self.ctx.plan.write {
            WriteKind::Plain => {
                sqlx::query(WRITE_PLAIN)
                    .bind(run)
                    .bind(self.row)
                    .bind(value)
                    .execute(conn)
                    .await
                    .map_err(db_at(Stage::Write))?;
            }
            WriteKind::Fenced => {
                let cell = Cell {
                    run: run.to_owned(),
                    id: self.row,
                    value,
                };
                let started = Instant::now();
                let written = self.ctx.repo.update(conn, self.lease, &cell).await;
                self.library.push(LibraryCall {
                    op: "update",
                    worker: self.worker,
                    at_ms: millis(started.duration_since(self.clock)),
                    duration_us: u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX),
                    bound_ms: millis(self.ctx.repo.call_timeout()),
                    ok: written.is_ok(),
                });
                written.map_err(at(Stage::Write))?;
            }
        }
        Ok(())
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

/// Batch mode: the rows a batch statement changed, for the history.
#[derive(Default)]
struct Recorded {
    ids: Vec<i32>,
    reads: Vec<i64>,
    kinds: Vec<&'static str>,
}

impl Recorded {
    fn push(&mut self, id: i32, read: i64, kind: Kind) {
        self.ids.push(id);
        self.reads.push(read);
        self.kinds.push(kind.as_str());
    }
}

/// The effects modes' ledger step.
pub(crate) const CHARGE_STEP: &str = "charge";

/// The effects modes' work item: invoice number `invoice` (from 0) of counter row `row`; a
/// row's value is its number of invoices paid, so its next one is `invoice_item(row, value)`.
pub(crate) fn invoice_item(row: i32, invoice: i64) -> String {
    format!("row{row}-inv{invoice}")
}

/// Sleeps for the injected stall, if any.
async fn stall(pause: Option<Duration>) {
    if let Some(d) = pause {
        tokio::time::sleep(d).await;
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
