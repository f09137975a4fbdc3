//! What a write runs on: [`WriteExecutor`], sealed, implemented for `&PgPool` and
//! `&mut PgConnection`, and the connection a write's statements share ([`Lent`]). Used by the
//! repository, the resource check, the effect ledger and `verify`; the module is private, so
//! [`WriteTarget`] cannot be named outside the crate.

use crate::audit::{Auditor, Rejection};
use crate::error::InvalidInput;
use sqlx::{PgPool, Postgres};

/// What a repository write runs on: `&PgPool` (each statement is a transaction of its own)
/// or `&mut PgConnection` (a connection, or `&mut *tx` inside a transaction).
///
/// A write that is rejected needs a second statement on the same connection, to tell stale
/// from not found; and its audit row must outlive the caller's transaction: on a pool that
/// second statement writes it itself, on a connection — which may be inside a transaction
/// that later rolls back — the [`Auditor`](crate::audit::Auditor)'s own pool writes it. Sealed: implemented for
/// sqlx's pool and connection only.
///
/// A pool is trusted to hand out connections outside any transaction, as sqlx-managed
/// transactions guarantee; a pooled connection left inside a raw `BEGIN` would take the
/// audit row into that dangling transaction.
pub trait WriteExecutor<'c>: sealed::Sealed + Send {
    /// What the write runs on.
    #[doc(hidden)]
    fn into_target(self) -> WriteTarget<'c>;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for &sqlx::PgPool {}
    impl Sealed for &mut sqlx::PgConnection {}
}

/// What a [`WriteExecutor`] is (not exported: the trait is sealed).
#[derive(Debug)]
pub enum WriteTarget<'c> {
    /// A pool: the write takes one connection for all its statements.
    Pool(&'c PgPool),
    /// The caller's connection, maybe inside its transaction.
    Connection(&'c mut sqlx::PgConnection),
}

impl<'c> WriteExecutor<'c> for &'c PgPool {
    fn into_target(self) -> WriteTarget<'c> {
        WriteTarget::Pool(self)
    }
}

impl<'c> WriteExecutor<'c> for &'c mut sqlx::PgConnection {
    fn into_target(self) -> WriteTarget<'c> {
        WriteTarget::Connection(self)
    }
}

/// Where a bounded call is when its bound fires ([`Stage`]): what the caller may conclude.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Step {
    /// Nothing sent yet, or statements of the write's own transaction (the gate) whose
    /// COMMIT was not sent: nothing applied, and nothing can apply later.
    Uncommitted = 0,
    /// The gate's COMMIT was sent and its answer is missing: the write applied or not.
    Committing = 1,
    /// Statements inside the caller's transaction: whatever reached the server is part of
    /// that transaction, which the caller must roll back.
    CallerTransaction = 2,
}

/// Shared between a bounded call and the timer that may cut it off: how far the call got,
/// and the rejections whose audit rows sit in the write's own transaction.
#[derive(Clone, Debug, Default)]
pub(crate) struct Stage(std::sync::Arc<StageState>);

#[derive(Debug, Default)]
struct StageState {
    step: std::sync::atomic::AtomicU8,
    /// Rejections whose audit row was written in the gate: it persists only if the gate's
    /// `COMMIT` does ([`Lent::settle`] writes it again, or reports it missing).
    held: std::sync::Mutex<Vec<(Auditor, Rejection)>>,
}

impl Stage {
    fn set(&self, step: Step) {
        self.0
            .step
            .store(step as u8, std::sync::atomic::Ordering::Release);
    }

    pub(crate) fn get(&self) -> Step {
        match self.0.step.load(std::sync::atomic::Ordering::Acquire) {
            1 => Step::Committing,
            2 => Step::CallerTransaction,
            _ => Step::Uncommitted,
        }
    }

    fn held(&self) -> std::sync::MutexGuard<'_, Vec<(Auditor, Rejection)>> {
        // Nothing panics while holding it; a poisoned list is still the list.
        self.0
            .held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The gate committed: its audit rows are in.
    fn clear_held(&self) {
        self.held().clear();
    }

    /// The gate did not commit, or may not have (`loss` says which): writes each held rejection's
    /// audit row again through its auditor's pool. One at a time, each taken off the list only
    /// once written, so a call cut off meanwhile still reports the rest ([`Stage::report_held`]).
    async fn rewrite_held(&self, loss: &AuditLoss) {
        loop {
            let Some((auditor, rejection)) = self.held().first().cloned() else {
                return;
            };
            auditor.rewrite(&rejection, loss).await;
            let mut held = self.held();
            if !held.is_empty() {
                held.remove(0);
            }
        }
    }

    /// The call was cut off before its gate's `COMMIT` answered: reports each held
    /// rejection's audit row as missing (or maybe missing), without another round trip (the
    /// call's bound is spent).
    fn report_held(&self, loss: &AuditLoss) {
        for (auditor, rejection) in std::mem::take(&mut *self.held()) {
            auditor.report_missing(&rejection, &loss.to_string());
        }
    }
}

/// Why audit rows written in a write's own transaction may be missing.
#[derive(Clone, Debug)]
pub(crate) enum AuditLoss {
    /// The transaction rolled back: the rows are gone.
    RolledBack(String),
    /// Its `COMMIT` got no answer: the rows may be in or not.
    InDoubt(String),
}

impl std::fmt::Display for AuditLoss {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::RolledBack(why) => write!(
                f,
                "the write's own transaction, which held the audit row, rolled back ({why})"
            ),
            Self::InDoubt(why) => write!(
                f,
                "the COMMIT of the write's own transaction, which held the audit row, got no answer ({why})"
            ),
        }
    }
}

/// Whether a failed `COMMIT`'s error is the server's answer that the transaction rolled back
/// (an error answer that is not the server ending the connection: SQLSTATE classes 08 and
/// 57, e.g. a terminated backend, may come after the commit). Anything else — a connection
/// that failed, no answer — leaves the commit in doubt.
pub(crate) fn commit_rolled_back(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db)
        if !db.code().is_some_and(|c| c.starts_with("08") || c.starts_with("57")))
}

/// The `BEGIN` of a write's own transaction (its "gate"): the write's statements run in it
/// and `COMMIT` is sent only once their answers arrived within the call's bound. A statement
/// held up in the network that reaches the server after the client gave up therefore runs
/// in a transaction that never commits (the client closed the connection; or the server
/// ends the idle transaction itself after `bound`). Costs no extra round trip for the
/// settings: they travel in `BEGIN`'s simple query.
pub(crate) fn gate_sql(bound: std::time::Duration) -> sqlx::AssertSqlSafe<String> {
    // Whole milliseconds, at least 1 (0 would switch the timeouts off).
    let ms = bound.as_millis().clamp(1, i32::MAX as u128);
    sqlx::AssertSqlSafe(format!(
        "BEGIN; SET LOCAL statement_timeout = {ms}; \
         SET LOCAL idle_in_transaction_session_timeout = {ms}"
    ))
}

/// `COMMIT` of one gated transaction and the [`gate_sql`] of the next, as one simple query
/// (the coalescer's chained groups: one round trip for both).
pub(crate) fn commit_then_gate_sql(bound: std::time::Duration) -> sqlx::AssertSqlSafe<String> {
    sqlx::AssertSqlSafe(format!("COMMIT; {}", gate_sql(bound).0))
}

/// The connection a write's statements run on: one checked out of the pool for the whole
/// write, or the caller's; in the write's own transaction (gated) unless the caller's
/// transaction holds it.
pub(crate) struct Lent<'c> {
    conn: Conn<'c>,
    stage: Stage,
    /// The call's bound (the gate's server-side timeouts).
    bound: std::time::Duration,
}

enum Conn<'c> {
    /// Not gated: each statement a transaction of its own (reads, checks, ordered writes).
    Pooled(Closing),
    /// The caller's connection: inside its transaction, or not gated.
    Borrowed(&'c mut sqlx::PgConnection),
    /// The write's own transaction, on a pooled connection or the caller's connection
    /// outside any transaction. Dropped before its `COMMIT` (the call cut off), it queues its
    /// `ROLLBACK` behind whatever the connection still waits for: a statement that reaches
    /// the server late runs, and is rolled back.
    Gate(sqlx::Transaction<'c, Postgres>),
}

/// A pooled connection that is closed, not returned to the pool, when the call using it is
/// dropped before it [`Lent::finish`]ed: a statement cut off by its bound is still running on
/// it, and sqlx would otherwise wait for that statement's end to return the connection. Closed,
/// the server ends the statement too at its next check of the client's connection
/// (`client_connection_check_interval`).
pub(crate) struct Closing {
    conn: Option<sqlx::pool::PoolConnection<Postgres>>,
    armed: bool,
}

impl Drop for Closing {
    fn drop(&mut self) {
        if self.armed
            && let Some(conn) = self.conn.take()
        {
            // Detached and dropped here: its socket closes now (the pool opens another), so
            // the server sees the client gone at its next check. A graceful close would wait
            // behind the statement.
            drop(conn.detach());
        }
    }
}

impl Closing {
    fn conn(&mut self) -> &mut sqlx::PgConnection {
        // Only `drop` takes the connection out.
        self.conn
            .as_deref_mut()
            .expect("a lent connection is present until dropped")
    }
}

impl<'c> WriteTarget<'c> {
    /// The connection, not gated: every statement on a pool is a transaction of its own.
    pub(crate) async fn lend(self) -> sqlx::Result<Lent<'c>> {
        Ok(Lent {
            conn: match self {
                Self::Pool(pool) => Conn::Pooled(Closing {
                    conn: Some(pool.acquire().await?),
                    armed: false,
                }),
                Self::Connection(conn) => Conn::Borrowed(conn),
            },
            stage: Stage::default(),
            bound: DEFAULT_CALL_TIMEOUT,
        })
    }

    /// The connection for a write bounded by `bound`, in the write's own transaction (the
    /// gate, committed by [`Lent::finish`]) unless it is the caller's connection inside the
    /// caller's transaction. `stage` follows it.
    pub(crate) async fn lend_gated(
        self,
        bound: std::time::Duration,
        stage: &Stage,
    ) -> sqlx::Result<Lent<'c>> {
        use sqlx::Connection;
        let conn = match self {
            Self::Pool(pool) => Conn::Gate(pool.begin_with(gate_sql(bound)).await?),
            Self::Connection(conn) if conn.is_in_transaction() => {
                stage.set(Step::CallerTransaction);
                Conn::Borrowed(conn)
            }
            Self::Connection(conn) => Conn::Gate(conn.begin_with(gate_sql(bound)).await?),
        };
        Ok(Lent {
            conn,
            stage: stage.clone(),
            bound,
        })
    }
}

impl Lent<'_> {
    pub(crate) fn conn(&mut self) -> &mut sqlx::PgConnection {
        match &mut self.conn {
            Conn::Pooled(conn) => conn.conn(),
            Conn::Borrowed(conn) => conn,
            Conn::Gate(tx) => tx,
        }
    }

    /// From now on, a pooled connection dropped before [`Lent::finish`] is closed
    /// ([`Closing`]).
    fn arm(&mut self) {
        if let Conn::Pooled(c) = &mut self.conn {
            c.armed = true;
        }
    }

    /// The call got its answers: the connection goes back to the pool as usual.
    fn finish(&mut self) {
        if let Conn::Pooled(c) = &mut self.conn {
            c.armed = false;
        }
    }

    /// Whether every statement is committed without the caller's say: a pooled connection,
    /// or the write's own transaction (the gate commits it, rejection audit rows included).
    /// Only the client knows; the server cannot tell autocommit from a transaction block.
    pub(crate) fn own_transaction(&self) -> bool {
        !matches!(self.conn, Conn::Borrowed(_))
    }

    /// Whether each statement is a transaction of its own (a pooled connection, not gated).
    pub(crate) fn autocommit(&self) -> bool {
        matches!(self.conn, Conn::Pooled(_))
    }

    /// Whether the statements run in the write's own transaction (which [`Lent::settle`]
    /// commits or rolls back).
    pub(crate) fn gated(&self) -> bool {
        matches!(self.conn, Conn::Gate(_))
    }

    /// Rolls the gate back and begins it again (one round trip), after a statement error
    /// aborted it; nothing to do when not gated.
    pub(crate) async fn restart_gate(&mut self) -> sqlx::Result<()> {
        use sqlx::Executor;
        if let Conn::Gate(tx) = &mut self.conn {
            let sql = format!("ROLLBACK; {}", gate_sql(self.bound).0);
            tx.execute(sqlx::raw_sql(sqlx::AssertSqlSafe(sql))).await?;
        }
        Ok(())
    }

    /// Keeps `rejection`, whose audit row was just written on this connection, until the
    /// gate's `COMMIT` says whether the row persists. Nothing to keep when not gated: on a
    /// pooled connection the row committed with its statement (inside a caller's transaction
    /// rows are written through the auditor's pool instead).
    pub(crate) fn hold_audit(&self, auditor: &Auditor, rejection: &Rejection) {
        if self.gated() {
            self.stage.held().push((auditor.clone(), rejection.clone()));
        }
    }

    /// Ends the write: the gate commits when the write succeeded or was fenced out (a
    /// rejection's audit row, written in the gate, persists); after any other error (a row that
    /// did not decode, invalid input found late, a failed statement) it rolls back and nothing
    /// of the write is kept. Returns `result`, or the `COMMIT`'s error when `result` was a
    /// success. Audit rows written in a gate that did not commit (or may not have) are written
    /// again through the auditor's pool ([`Lent::hold_audit`]): a logged rejection keeps its row.
    pub(crate) async fn settle<R>(self, result: crate::Result<R>) -> crate::Result<R> {
        let Conn::Gate(tx) = self.conn else {
            return result;
        };
        if let Err(e) = &result
            && e.kind() != crate::error::ErrorKind::Fenced
        {
            // The write's own error is the answer, whatever the rollback says.
            let _ = tx.rollback().await;
            self.stage
                .rewrite_held(&AuditLoss::RolledBack(e.to_string()))
                .await;
            return result;
        }
        self.stage.set(Step::Committing);
        let committed = tx.commit().await;
        match &committed {
            Ok(()) => self.stage.clear_held(),
            // Still in doubt while the rows are written again: a timer firing meanwhile says so.
            Err(e) if !commit_rolled_back(e) => {
                self.stage
                    .rewrite_held(&AuditLoss::InDoubt(e.to_string()))
                    .await;
            }
            Err(e) => {
                self.stage.set(Step::Uncommitted);
                self.stage
                    .rewrite_held(&AuditLoss::RolledBack(e.to_string()))
                    .await;
            }
        }
        self.stage.set(Step::Uncommitted);
        match (result, committed) {
            (Ok(_), Err(e)) => Err(e.into()),
            (result, _) => result,
        }
    }
}

fn err_target(err: &crate::Error) -> &str {
    match err {
        crate::Error::TimedOut { target, .. } => target,
        _ => "",
    }
}

/// The bound of a repository call when none is set
/// ([`Repository::with_call_timeout`](crate::Repository::with_call_timeout)).
pub const DEFAULT_CALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// The shortest and longest call bound accepted.
pub(crate) const CALL_TIMEOUT_RANGE: (std::time::Duration, std::time::Duration) = (
    std::time::Duration::from_millis(10),
    std::time::Duration::from_secs(86_400),
);

/// Checks a call bound ([`CALL_TIMEOUT_RANGE`]).
pub(crate) fn check_call_timeout(bound: std::time::Duration) -> crate::Result<()> {
    let (min, max) = CALL_TIMEOUT_RANGE;
    if bound < min || bound > max {
        return Err(crate::Error::Invalid(InvalidInput::Duration(format!(
            "call timeout {bound:?}: a call timeout must be between {min:?} and {}s",
            max.as_secs()
        ))));
    }
    Ok(())
}

/// Runs one write — `work`, handed the connection and handing it back with its result — on
/// `target` in its gate ([`WriteTarget::lend_gated`]), and cuts it off after `bound`
/// ([`crate::Error::TimedOut`], with what the caller may conclude; logged at WARN).
pub(crate) async fn bounded<'c, R, Fut>(
    bound: std::time::Duration,
    operation: &'static str,
    what: impl FnOnce() -> String,
    target: WriteTarget<'c>,
    work: impl FnOnce(Lent<'c>) -> Fut,
) -> crate::Result<R>
where
    Fut: std::future::Future<Output = (Lent<'c>, crate::Result<R>)>,
{
    let stage = Stage::default();
    let call = async {
        let lent = target.lend_gated(bound, &stage).await?;
        let (lent, result) = work(lent).await;
        lent.settle(result).await
    };
    let started = tokio::time::Instant::now();
    match tokio::time::timeout(bound, call).await {
        // The gate's own `statement_timeout` (the same bound) fired on the server before the
        // client's timer did, as it can on a loaded host: the statement ran for the whole
        // bound, the gate rolled back, and the caller is owed the same answer as when the
        // client's timer wins. A cancel that came sooner (`pg_cancel_backend`, the caller's
        // own shorter setting) is not this bound and stays a database error.
        Ok(Err(e))
            if stage.get() == Step::Uncommitted
                && is_query_canceled(&e)
                && started.elapsed() >= bound => {}
        // A table that is not guarded has no fence column for the statement to read.
        Ok(result) => return result.map_err(|e| e.on_table(what)),
        Err(_) => {}
    }
    let outcome = match stage.get() {
        Step::Uncommitted => crate::error::TimedOut::NotApplied,
        Step::Committing => crate::error::TimedOut::InDoubt,
        Step::CallerTransaction => crate::error::TimedOut::CallerTransaction,
    };
    let why = format!("the call timed out after {bound:?}");
    stage.report_held(&match outcome {
        crate::error::TimedOut::InDoubt => AuditLoss::InDoubt(why),
        _ => AuditLoss::RolledBack(why),
    });
    let err = crate::Error::TimedOut {
        operation,
        target: what(),
        after: bound,
        outcome,
    };
    tracing::warn!(
        target: crate::audit::LOG_TARGET,
        operation,
        table = %err_target(&err),
        outcome = ?outcome,
        bound_ms = u64::try_from(bound.as_millis()).unwrap_or(u64::MAX),
        "{err}"
    );
    Err(err)
}

/// Runs one write ordered by the row ([`crate::token::order`]): no transaction of its own, one
/// autocommit statement on a pool. `work` gets the connection and the fence the write expects;
/// when the bound cuts it off, `lost` is told which fence the write expected, so the lease's
/// next write to the row orders after it, whether it applied or not.
pub(crate) async fn ordered<'c, R, Fut>(
    bound: std::time::Duration,
    operation: &'static str,
    what: impl FnOnce() -> String,
    target: WriteTarget<'c>,
    lost: impl FnOnce(),
    work: impl FnOnce(Lent<'c>) -> Fut,
) -> crate::Result<R>
where
    Fut: std::future::Future<Output = (Lent<'c>, crate::Result<R>)>,
{
    let in_caller_tx =
        matches!(&target, WriteTarget::Connection(c) if sqlx::Connection::is_in_transaction(&**c));
    let sent = std::sync::atomic::AtomicBool::new(false);
    let call = async {
        let mut lent = target.lend().await?;
        lent.arm();
        sent.store(true, std::sync::atomic::Ordering::Release);
        let (mut lent, result) = work(lent).await;
        lent.finish();
        result
    };
    let result = match tokio::time::timeout(bound, call).await {
        // A table that is not guarded has no fence column for the statement to read.
        Ok(result) => result.map_err(|e| e.on_table(what)),
        Err(_) => {
            let outcome = if in_caller_tx {
                crate::error::TimedOut::CallerTransaction
            } else if sent.load(std::sync::atomic::Ordering::Acquire) {
                crate::error::TimedOut::InDoubt
            } else {
                crate::error::TimedOut::NotApplied
            };
            let err = crate::Error::TimedOut {
                operation,
                target: what(),
                after: bound,
                outcome,
            };
            tracing::warn!(
                target: crate::audit::LOG_TARGET,
                operation,
                table = %err_target(&err),
                outcome = ?outcome,
                bound_ms = u64::try_from(bound.as_millis()).unwrap_or(u64::MAX),
                "{err}"
            );
            Err(err)
        }
    };
    if let Err(e) = &result
        && (matches!(e, crate::Error::TimedOut { .. }) || e.is_retryable())
    {
        lost();
    }
    result
}

/// Whether `err` is PostgreSQL's `query_canceled` (57014): a statement timeout or a cancel
/// request.
fn is_query_canceled(err: &crate::Error) -> bool {
    matches!(err, crate::Error::Backend(b) if b.sqlstate() == Some("57014"))
}

/// What a fenced handle outside the repository carries ([`Fence`](crate::Fence),
/// [`Effects`](crate::Effects)): where refusals are audited, the timeline it last saw (what
/// leases bind to), and every call's bound.
#[derive(Clone, Debug)]
pub(crate) struct Handle {
    pub(crate) auditor: crate::audit::Auditor,
    /// The PostgreSQL timeline this handle last saw.
    pub(crate) seen: crate::timeline::Seen,
    /// Every call's bound (`with_call_timeout`).
    pub(crate) call_timeout: std::time::Duration,
}

impl Handle {
    /// A handle auditing through `auditor`, bounded by [`DEFAULT_CALL_TIMEOUT`].
    pub(crate) fn new(auditor: crate::audit::Auditor) -> Self {
        Self {
            auditor,
            seen: crate::timeline::Seen::default(),
            call_timeout: DEFAULT_CALL_TIMEOUT,
        }
    }

    /// The same handle bounded by `bound` ([`check_call_timeout`]).
    pub(crate) fn with_call_timeout(mut self, bound: std::time::Duration) -> crate::Result<Self> {
        check_call_timeout(bound)?;
        self.call_timeout = bound;
        Ok(self)
    }
}
