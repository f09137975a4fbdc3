//! The client-side history of a run: every attempted write, every lease, every fault, as the
//! workers and the fault injectors recorded them.

use serde::Serialize;

/// Where in a write an error happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    /// Opening the transaction (or getting a connection).
    Begin,
    /// `Fence::check`.
    Check,
    /// `Repository::claim` (row-claim and effects modes) or `claim_many` (batch mode).
    Claim,
    /// Effects modes: [`pgfence::Effects::begin`], recording the charge before the call.
    Effect,
    /// Effects modes: the payment provider's HTTP call (a `409`: the same key in flight
    /// elsewhere; an I/O error or timeout: unknown whether it charged).
    Call,
    /// Effects modes: [`pgfence::Effects::finish`], recording the call's outcome.
    Finish,
    /// Reading the value.
    Read,
    /// A row update.
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
    /// Rejected with [`pgfence::Error::StaleToken`], [`pgfence::Error::DuplicateToken`],
    /// (the row was bypassed after this lease wrote it) [`pgfence::Error::RowSealed`] or (the
    /// lease is bound to a PostgreSQL timeline from before a promotion)
    /// [`pgfence::Error::FencedByFailover`].
    Rejected {
        /// The token of the fence (or high-water mark) the write met (the lease's own token
        /// when `sealed` or `failover`).
        current: i64,
        /// `check`, `claim`, `update`, or in the effects modes `effect` (the ledger's begin)
        /// or `effect_finish`.
        by: &'static str,
        /// True for [`pgfence::Error::DuplicateToken`]: another lease already presented this
        /// token (the counter went backwards).
        duplicate: bool,
        /// True for [`pgfence::Error::RowSealed`]: a lease-less writer bypassed the guard on
        /// the row after this lease wrote (claimed) it, so the lease's picture of the row is
        /// out of date; `current` is then the lease's own token.
        sealed: bool,
        /// True for [`pgfence::Error::FencedByFailover`]: the database was promoted (a new
        /// timeline) after this lease's first fenced statement, so whatever its rows say now
        /// (they may have lost newer leases' writes), the lease is fenced out.
        failover: bool,
    },
    /// Failed with another error.
    Failed {
        /// Where.
        stage: Stage,
        /// [`pgfence::Error::is_retryable`].
        retryable: bool,
        /// A short classification of the error.
        error: String,
    },
}

/// One try of a unit: one write in the single-transaction modes, the unit's statements (from
/// `first_txn` on) in the multi-statement modes.
#[derive(Clone, Debug, Serialize)]
pub struct Attempt {
    /// The work unit (one lease).
    pub unit: u64,
    /// 0 for the first try, then retries.
    pub try_no: u32,
    /// Worker index.
    pub worker: usize,
    /// Counter row (in batch mode: the group).
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
    /// The value written, if the write statement succeeded (the last one, in the
    /// multi-statement modes).
    pub value_written: Option<i64>,
    /// The first of the unit's transactions this try ran (0 except for a `fenced-multi` retry,
    /// which resumes at the transaction that failed).
    pub first_txn: u32,
    /// Transactions of this try whose `COMMIT` was acknowledged; the outcome (if not
    /// accepted) is that of transaction `first_txn + commits`.
    pub commits: u32,
    /// The outcome. In batch mode a try whose statements committed is
    /// [`Outcome::Accepted`] even when some of its rows were rejected (see `batch`), and
    /// [`Outcome::Rejected`] when a statement had no row left to write (all claimed rows
    /// rejected).
    pub outcome: Outcome,
    /// Batch mode: the try's rows and what happened to each; `None` in the other modes.
    pub batch: Option<BatchRows>,
}

/// A batch try's rows and each row's outcome, in the order sent (ascending row ids).
#[derive(Clone, Debug, Default, Serialize)]
pub struct BatchRows {
    /// The unit's rows.
    pub rows: Vec<i32>,
    /// `claim[i]` is row `i`'s `claim_many` outcome; empty if the claim did not return.
    pub claim: Vec<RowResult>,
    /// `write[i]` is row `i`'s `update_many` outcome ([`RowResult::Skipped`] for a row the
    /// claim did not get); empty if the update did not return.
    pub write: Vec<RowResult>,
}

impl BatchRows {
    /// Rows the claim or the update rejected (stale or duplicate token): each has one audit
    /// row and one audit event.
    #[must_use]
    pub fn rejected(&self) -> usize {
        self.claim
            .iter()
            .chain(&self.write)
            .filter(|r| r.is_rejection())
            .count()
    }
}

/// One row's outcome in a batch statement (pgfence's [`pgfence::repository::RowOutcome`], recorded).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum RowResult {
    /// Claimed or written.
    Applied,
    /// A newer lease had claimed or written the row (audited).
    Stale {
        /// That lease's token.
        current: i64,
    },
    /// Another lease had presented the same token (audited).
    Duplicate,
    /// No such row.
    NotFound,
    /// The row was sealed (changed outside the protocol) after the lease wrote it.
    Sealed,
    /// The row changed while the statement ran (not written; not audited).
    Contended,
    /// Not sent: the claim did not get the row.
    Skipped,
}

impl RowResult {
    /// Whether pgfence audited this row as a rejection.
    #[must_use]
    pub fn is_rejection(self) -> bool {
        matches!(self, RowResult::Stale { .. } | RowResult::Duplicate)
    }
}

impl From<pgfence::repository::RowOutcome> for RowResult {
    fn from(o: pgfence::repository::RowOutcome) -> Self {
        use pgfence::repository::RowOutcome as O;
        match o {
            O::Stale { current, .. } => RowResult::Stale { current },
            O::DuplicateToken => RowResult::Duplicate,
            O::NotFound => RowResult::NotFound,
            O::Sealed => RowResult::Sealed,
            O::Applied | O::Inserted | O::Updated => RowResult::Applied,
            _ => RowResult::Contended,
        }
    }
}

/// One granted lease.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct LeaseRecord {
    /// The work unit.
    pub unit: u64,
    /// Worker index.
    pub worker: usize,
    /// Counter row (in batch mode: the group).
    pub row: i32,
    /// Token.
    pub token: i64,
    /// When the worker asked for it (ms since the run started; it may have waited for the
    /// lock, and through issuer errors, since).
    pub asked_at_ms: u64,
    /// When it was granted (ms since the run started).
    pub at_ms: u64,
}

/// One call of the library a worker made — an issuer's `acquire_wait` or `release`, a
/// repository `update` — timed from before it to after it returned, with the bound it was
/// configured with (`docs/proof.md`, "History format": `call` lines).
#[derive(Clone, Debug, Serialize)]
pub struct LibraryCall {
    /// What was called: `acquire_wait`, `release` or `update`.
    pub op: &'static str,
    /// The worker that made it.
    pub worker: usize,
    /// When it was made (ms since the run started).
    pub at_ms: u64,
    /// How long it took, in microseconds.
    pub duration_us: u64,
    /// What it may take: the call bound (`acquire_wait`: the wait plus one call bound).
    pub bound_ms: u64,
    /// Whether it returned `Ok`.
    pub ok: bool,
}

/// A fault the run went through.
#[derive(Clone, Debug, Serialize)]
pub struct FaultMark {
    /// What happened (`counter_reset`, `redis_restart`, `postgres_restart`, `failover`...).
    pub name: String,
    /// When (ms since the run started).
    pub at_ms: u64,
    /// Units started when it happened.
    pub at_unit: u64,
}

/// An issuer failover as the one who caused it saw it (see
/// [`Deployment::failover_at`](crate::Deployment::failover_at)); recorded with
/// [`Control::record_failover`](crate::Control::record_failover) after the fault mark named
/// `failover`, it becomes the report's [`FailoverFigures`](crate::FailoverFigures).
#[derive(Clone, Debug, Serialize)]
pub struct FailoverEvent {
    /// The issuer (`redis`, `etcd`, `zk`).
    pub issuer: String,
    /// The leader (etcd member, ZooKeeper server) or master (Redis) killed.
    pub old_leader: String,
    /// How long the kill took: from `SIGKILL` until the process was gone and its client port
    /// closed, in ms. The `failover` fault is marked at the end of it.
    pub kill_ms: u64,
    /// The one that took over, once the survivors named one.
    pub new_leader: Option<String>,
    /// From the `SIGKILL` until the survivors named the new leader (or the sentinels promoted
    /// the replica), in ms.
    pub new_leader_after_ms: Option<u64>,
    /// Redis: the unit at which the replica was paused (`SIGSTOP`) and its replication link
    /// cut, so that it missed every `INCR` from there to the kill.
    pub replica_paused_at_unit: Option<u64>,
}

/// A PostgreSQL failover of the harness's own database (see
/// [`pg_failover_at`](crate::pg_failover_at)), as the one who caused it saw it; recorded with
/// [`Control::record_pg_failover`](crate::Control::record_pg_failover), it becomes the
/// report's [`PgFailoverFigures`](crate::PgFailoverFigures). Times are ms since the run
/// started.
#[derive(Clone, Debug, Serialize)]
pub struct PgFailoverEvent {
    /// When the standby was cut off (it receives no WAL from then on).
    pub cut_off_at_ms: u64,
    /// Units started by then.
    pub cut_off_at_unit: u64,
    /// When the primary was sent `SIGKILL`: every commit acknowledged from the cut-off to here
    /// is lost by the promotion.
    pub kill_at_ms: u64,
    /// When the old primary's processes were all gone and its port closed: no statement of a
    /// try started from here on can have run on it.
    pub dead_at_ms: u64,
    /// When the promoted standby accepted writes behind the stable address: the fault's mark
    /// (named `pg_failover`), from which recovery is measured.
    pub promoted_at_ms: u64,
    /// From the `SIGKILL` until the promoted standby was behind the stable address, in ms.
    pub failover_ms: u64,
    /// The old primary's timeline.
    pub old_timeline: i64,
    /// The new primary's.
    pub new_timeline: i64,
}

/// A lease-less writer's kind of write ([`Mode::LeaselessMix`](crate::Mode::LeaselessMix)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LeaselessKind {
    /// `UPDATE ... SET value = value + 1, fence = fence + 1`: what a hand-written script
    /// without a lease does. The guard must refuse it every time
    /// ([`pgfence::Error::LeaselessWrite`], SQLSTATE `PF007`).
    FencePlusOne,
    /// `BEGIN; SELECT pgfence.bypass('chaos'); UPDATE ... SET value = value + 1; COMMIT` as a
    /// role allowed with [`pgfence::guard::allow_bypass`]: goes through (audited) and seals the row
    /// against the lease that wrote it before.
    Bypass,
}

impl LeaselessKind {
    /// The `kind` of its history row (written only when the write committed).
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            LeaselessKind::FencePlusOne => "fence_plus_one",
            LeaselessKind::Bypass => "bypass",
        }
    }
}

/// What a lease-less write came to, as its writer saw it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum LeaselessOutcome {
    /// Committed and acknowledged (for a `fence + 1`: a violation).
    Applied,
    /// Refused by the guard trigger: [`pgfence::Error::LeaselessWrite`] (`PF007`),
    /// [`pgfence::Error::StaleToken`] (`PF001`) or [`pgfence::Error::BypassRefused`]
    /// (`PF006`); nothing was written.
    Refused {
        /// The SQLSTATE.
        code: String,
    },
    /// Failed with another error (a killed backend...).
    Failed {
        /// Where: `begin`, `write`, `record` or `commit` (only a failed `commit` may have
        /// committed: the history says).
        stage: &'static str,
        /// [`pgfence::Error::is_retryable`].
        retryable: bool,
        /// A short classification of the error.
        error: String,
    },
}

/// One write of a lease-less writer ([`Mode::LeaselessMix`](crate::Mode::LeaselessMix)).
#[derive(Clone, Debug, Serialize)]
pub struct LeaselessAttempt {
    /// Its id: the `unit` of its history row (above every lease's unit).
    pub id: u64,
    /// Lease-less writer index.
    pub writer: usize,
    /// Counter row.
    pub row: i32,
    /// What it sent.
    pub kind: LeaselessKind,
    /// When it started (ms since the run started).
    pub started_ms: u64,
    /// When it ended.
    pub finished_ms: u64,
    /// What it came to.
    pub outcome: LeaselessOutcome,
}
