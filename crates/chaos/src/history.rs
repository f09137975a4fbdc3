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
    /// `Repository::claim` (row-claim mode).
    Claim,
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
    /// Rejected with [`pgfence::Error::StaleToken`] or [`pgfence::Error::DuplicateToken`].
    Rejected {
        /// The token of the fence (or high-water mark) the write met.
        current: i64,
        /// `check` or `update`.
        by: &'static str,
        /// True for [`pgfence::Error::DuplicateToken`]: another lease already presented this
        /// token (the counter went backwards).
        duplicate: bool,
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
    /// The value written, if the write statement succeeded (the last one, in the
    /// multi-statement modes).
    pub value_written: Option<i64>,
    /// The first of the unit's transactions this try ran (0 except for a `fenced-multi` retry,
    /// which resumes at the transaction that failed).
    pub first_txn: u32,
    /// Transactions of this try whose `COMMIT` was acknowledged; the outcome (if not
    /// accepted) is that of transaction `first_txn + commits`.
    pub commits: u32,
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
