//! The typed repository: fenced `update`, `upsert`, `delete` and `claim` for tables declared
//! with [`fenced_table!`](crate::fenced_table) (or a hand-written [`FencedTable`] impl).
//!
//! An applied write is one plain statement (`UPDATE ... SET ..., fence = <next> WHERE <key>
//! AND <fence admits the lease>`, the fenced `INSERT ... ON CONFLICT`, the fenced `DELETE`;
//! see the crate's SQL module docs for the predicate). Only a write that changed nothing
//! sends a second statement, on the same executor, that tells why: stale (a newer lease wrote
//! or claimed the row, or for upsert deleted it), a duplicate token, not found, or contended
//! (the row was replaced meanwhile, retryable) — and, on a pool, writes the audit row in that
//! same statement. The common path pays nothing for the rare one (`BENCHMARKS.md`:
//! classifying inside the write cost ~15% of its throughput).
//!
//! Between the two statements the row can change; the second reports what it finds then. A
//! row a newer token deleted through [`Repository::delete`] left a tombstone and still
//! reports stale to `upsert`; a row deleted by raw SQL in between reports not found — the
//! write was rejected either way and nothing was written.
//!
//! Batches ([`Repository::update_many`], `upsert_many`, `delete_many`, `claim_many`) write up
//! to [`MAX_BATCH_ROWS`] rows in one statement and report one [`RowOutcome`] per row in a
//! [`BatchOutcome`]. The writes run on a [`WriteExecutor`]: `&pool`, `&mut *tx` or `&mut conn`.

pub(crate) mod batch;
pub(crate) mod coalesce;
pub(crate) mod condition;
pub(crate) mod executor;
pub(crate) mod outcome;
pub(crate) mod rejection;
pub(crate) mod sql;
pub(crate) mod verify;

use crate::error::InvalidInput;
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::postgres::PgRow;
use sqlx::{PgPool, Row};

use crate::audit::Auditor;
use crate::ident::{Ident, TableName};
use crate::repository::executor::Lent;
use crate::repository::rejection::{Explained, Judgement, Rejecting, audit_failure, judge};
use crate::repository::sql::{Source, Statement, Statements};
use crate::table::FencedTable;
use crate::timeline::Seen;
use crate::{Error, Fencing, Result};

pub use crate::repository::coalesce::{
    Coalescer, CoalescerStats, DEFAULT_LANES, DEFAULT_MAX_GROUP,
};
pub use crate::repository::condition::Condition;
pub use crate::repository::executor::{DEFAULT_CALL_TIMEOUT, WriteExecutor};
pub use crate::repository::outcome::{
    BatchOutcome, BatchSummary, Claimed, MAX_BATCH_ROWS, RowOutcome, Upserted,
};

/// Fenced writes to one table. Cheap to clone; build it once and share it.
///
/// Every method takes the executor to run on — `&PgPool`, or `&mut *tx` to join the caller's
/// transaction — and the lease (`&lease`, or a [`Fencing`] / [`FenceToken`](crate::FenceToken)).
/// One lease may write a row many times, in many transactions; a newer lease's first write or
/// claim fences every older lease out of that row. Rejections are logged and audited outside
/// the caller's transaction.
pub struct Repository<T> {
    table: Arc<TableName>,
    pub(crate) sql: Arc<Statements>,
    auditor: Auditor,
    /// The PostgreSQL timeline this repository last saw (what leases bind to).
    pub(crate) seen: Seen,
    /// [`Repository::update_columns`]' statements, by (sorted) column positions.
    partial: Arc<Mutex<HashMap<Vec<usize>, Arc<Statement>>>>,
    /// Every write's bound ([`Repository::with_call_timeout`]).
    call_timeout: Duration,
    /// The table's hash: with a key's, which row a lease's `RowLog` entry is about.
    table_id: u64,
    _row: PhantomData<fn() -> T>,
}

/// At most this many column sets keep their partial-update statement; others are built per
/// call.
const MAX_CACHED_PARTIAL: usize = 64;

/// How often a write is sent again after meeting another fence of its own lease than it
/// expected (the lease's concurrent writes to the row, or a row the lease forgot).
const MAX_OWN_RESENDS: usize = 4;

/// What a write that changed nothing does next ([`Repository::cas_refusal`]).
enum Next {
    /// Send it again as it was (the lease was rebound to a new timeline).
    Resend,
    /// Send it again expecting this fence of its own lease.
    Expect(i64),
    /// It is refused.
    Fail(Error),
}

impl<T> Clone for Repository<T> {
    fn clone(&self) -> Self {
        Self {
            table: self.table.clone(),
            sql: self.sql.clone(),
            auditor: self.auditor.clone(),
            seen: self.seen.clone(),
            partial: self.partial.clone(),
            call_timeout: self.call_timeout,
            table_id: self.table_id,
            _row: PhantomData,
        }
    }
}

impl<T> std::fmt::Debug for Repository<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Repository")
            .field("table", &self.table.quoted())
            .finish_non_exhaustive()
    }
}

/// The loop every single-row write shares, ordered by the row ([`crate::token::order`]): one
/// autocommit statement on a pool, no transaction of its own. The write expects the fence the
/// lease last saw on the row (`$row`, from its [`RowLog`](crate::token::order::RowLog); `0`
/// when it saw none) and applies over exactly that fence or an older lease's; a statement of
/// the lease that reaches the server after a later write of the lease to the row therefore
/// changes nothing. `$attempt` (an async block on `$lent` and `$expected`) is `Some((done,
/// fence))` when the write applied, `fence` being what the row now holds (`None`: the row is
/// gone). When it changed nothing, the explaining statement says why: the lease's own fence
/// where another of its fences was expected (its concurrent write, or a row it forgot) sends
/// the write again expecting that fence; a refusal ends the call; a lease rebound to the
/// database's new timeline sends it again. A call cut off by its bound or a lost connection
/// leaves the row's entry in doubt: the lease's next write there expects the fence the row had
/// before, so it orders after the lost statement whether that applied or not.
macro_rules! ordered_write {
    ($repo:expr, $exec:expr, ($call:expr, $operation:expr), $fencing:expr, $source:expr,
     $row:expr, $explain:expr, |$lent:ident, $expected:ident| $attempt:expr) => {{
        let id: Option<crate::token::order::RowId> = $row.map(|k| ($repo.table_id, k));
        let rows = $fencing.rows.clone();
        let lease = $fencing.stored();
        let start = id.and_then(|id| rows.get(id)).map_or(0, |s| s.expected);
        crate::repository::executor::ordered(
            $repo.call_timeout,
            $call,
            || $repo.table.quoted(),
            $exec.into_target(),
            || {
                if let Some(id) = id {
                    // The fence the write expected last (a resend may have moved it).
                    let e = rows.get(id).map_or(start, |s| s.expected);
                    rows.lost(id, e, crate::token::order::after(lease, e));
                }
            },
            |mut $lent| async move {
                let result = async {
                    let mut $expected = start;
                    for _ in 0..MAX_OWN_RESENDS {
                        $repo.seen.bind(&$fencing.timeline, $lent.conn()).await?;
                        let applied: Result<Option<(_, Option<i64>)>> = $attempt.await;
                        if let Some((done, fence)) = applied? {
                            if let Some(id) = id {
                                match fence {
                                    Some(fence) => $fencing.rows.saw(id, fence),
                                    None => $fencing.rows.forget(id),
                                }
                            }
                            return Ok(done);
                        }
                        match $repo
                            .cas_refusal($explain, $source, &$fencing, $operation, &mut $lent)
                            .await?
                        {
                            Next::Resend => {}
                            Next::Expect(current) => {
                                if let Some(id) = id {
                                    $fencing.rows.saw(id, current);
                                }
                                $expected = current;
                            }
                            Next::Fail(err) => {
                                if let Some(id) = id {
                                    $fencing.rows.forget(id);
                                }
                                return Err(err);
                            }
                        }
                    }
                    Err(Error::Contended {
                        table: $repo.table.quoted(),
                        operation: $operation,
                    })
                }
                .await;
                ($lent, result)
            },
        )
        .await
    }};
}

impl<T: FencedTable> Repository<T> {
    /// Validates `T`'s declaration and prepares its SQL. `pool` is used for audit records.
    ///
    /// # Errors
    /// [`InvalidInput::Identifier`] / [`InvalidInput::Table`] for a bad declaration.
    pub fn new(pool: PgPool) -> Result<Self> {
        Self::with_auditor(Auditor::new(pool))
    }

    /// Like [`Repository::new`], but for `table` instead of `T::SCHEMA.T::TABLE`: one row
    /// type for several tables of the same shape (per-tenant schemas, names chosen at run
    /// time).
    ///
    /// # Errors
    /// As [`Repository::new`].
    pub fn for_table(pool: PgPool, table: TableName) -> Result<Self> {
        Self::build(Auditor::new(pool), table)
    }

    /// Like [`Repository::new`] with a custom [`Auditor`] (a shorter audit timeout, an
    /// [`AuditSink`](crate::audit::AuditSink), audit rows in another database).
    ///
    /// # Errors
    /// As [`Repository::new`].
    pub fn with_auditor(auditor: Auditor) -> Result<Self> {
        Self::build(auditor, TableName::new(T::SCHEMA, T::TABLE)?)
    }

    fn build(auditor: Auditor, table: TableName) -> Result<Self> {
        let keys = idents(T::KEY_COLUMNS)?;
        let cols = idents(T::COLUMNS)?;
        let invalid = |reason: &str| {
            Error::Invalid(InvalidInput::Table {
                table: table.quoted(),
                reason: reason.to_owned(),
            })
        };
        if keys.is_empty() {
            return Err(invalid("no key columns"));
        }
        let mut all: Vec<&str> = keys.iter().chain(&cols).map(Ident::as_str).collect();
        if all.contains(&"fence") {
            return Err(invalid(
                "`fence` is managed by pgfence and cannot be a declared column",
            ));
        }
        all.sort_unstable();
        if all.windows(2).any(|w| w[0] == w[1]) {
            return Err(invalid("a column is declared twice"));
        }
        let sql = Statements::build(&table, &keys, &cols, auditor.in_statement_timeout_ms())?;
        Ok(Self {
            table_id: crate::table::hash_key(table.quoted().as_str()),
            table: Arc::new(table),
            sql: Arc::new(sql),
            auditor,
            seen: Seen::default(),
            partial: Arc::default(),
            call_timeout: crate::repository::executor::DEFAULT_CALL_TIMEOUT,
            _row: PhantomData,
        })
    }

    /// Bounds every write of this repository (single-row and batch; claims included) by
    /// `bound` instead of [`DEFAULT_CALL_TIMEOUT`]
    /// (30 s): the call returns [`Error::TimedOut`] when it is not done by then. Set it below
    /// the lease's TTL, above your slowest write.
    ///
    /// A single-row write is one autocommit statement that expects the fence its lease last
    /// saw on the row: a statement held up in the network that reaches the server after the
    /// call gave up — and after the lease wrote the row again — finds another fence and
    /// changes nothing, so it cannot undo the lease's later writes. A cut-off call closes its
    /// connection, and the server ends the statement at its next check of the client
    /// (`client_connection_check_interval`, set to 1 s by `pgfence migrate`). Batches run in a
    /// transaction of their own, begun with `statement_timeout` at `bound` and committed only
    /// when their answers came in time. [`TimedOut`](crate::error::TimedOut) says what the
    /// caller may conclude, and what to do. Inside the caller's transaction, the caller's
    /// `COMMIT` decides.
    ///
    /// # Errors
    /// [`InvalidInput::Duration`] when `bound` is under 10 ms or over a day.
    pub fn with_call_timeout(mut self, bound: Duration) -> Result<Self> {
        crate::repository::executor::check_call_timeout(bound)?;
        self.call_timeout = bound;
        Ok(self)
    }

    /// Every write's bound ([`Repository::with_call_timeout`]).
    #[must_use]
    pub fn call_timeout(&self) -> Duration {
        self.call_timeout
    }

    /// The table this repository writes.
    #[must_use]
    pub fn table(&self) -> &TableName {
        &self.table
    }

    /// The exact text of the update statement (for benchmarks comparing it with raw sqlx).
    /// Binds: key columns, data columns, then [`Fencing::lease_fence`] and the lease's
    /// timeline ([`Fencing::timeline`], `0` when not bound).
    #[doc(hidden)]
    #[must_use]
    pub fn update_sql(&self) -> &str {
        self.sql.update.text()
    }

    /// Updates the existing row `row` (matched by its key), setting the declared columns, if
    /// no newer lease has written or claimed it. The same lease may update a row many times.
    ///
    /// # Errors
    /// [`Error::StaleToken`] when a newer lease wrote or claimed the row (audited and logged);
    /// [`Error::DuplicateToken`] when another lease presented the same token there (audited);
    /// [`Error::NotFound`] when there is no such row; [`Error::RowSealed`];
    /// [`Error::Backend`] otherwise.
    ///
    /// # Example
    /// ```no_run
    /// # #[derive(Clone)] struct Snapshot { sku: String, payload: String }
    /// # pgfence::fenced_table!(Snapshot { table: "inventory_snapshot", key: sku: String, columns: [payload] });
    /// # async fn f(pool: sqlx::PgPool, lease: pgfence::Lease) -> pgfence::Result<()> {
    /// let repo = pgfence::Repository::<Snapshot>::new(pool.clone())?;
    /// let mut tx = pool.begin().await?;
    /// repo.update(&mut *tx, &lease, &Snapshot { sku: "A-1".into(), payload: "{}".into() }).await?;
    /// tx.commit().await?;
    /// // Later, in another transaction, the same lease writes the row again:
    /// repo.update(&pool, &lease, &Snapshot { sku: "A-1".into(), payload: "[]".into() }).await?;
    /// # Ok(()) }
    /// ```
    pub async fn update<'c, E: WriteExecutor<'c>>(
        &self,
        exec: E,
        fencing: impl Into<Fencing>,
        row: &T,
    ) -> Result<()> {
        let _timer = crate::metrics::Timer::write("update");
        let fencing = fencing.into();
        let source = Source::Row(row);
        ordered_write!(
            self,
            exec,
            ("update", "update"),
            fencing,
            source,
            row.key_hash(),
            &self.sql.explain_update,
            |lent, expected| async {
                let write = self
                    .sql
                    .update
                    .bind_expecting(source, &fencing, false, expected);
                let done = self
                    .written(write.fetch_optional(lent.conn()).await, &fencing, "update")
                    .await?;
                done.map(|d| Ok(((), Some(d.try_get::<i64, _>(0)?))))
                    .transpose()
            }
        )
    }

    /// Inserts `row`, or updates it if no newer lease has written it. A row that a newer lease
    /// deleted through [`Repository::delete`] is not brought back.
    ///
    /// # Errors
    /// [`Error::StaleToken`] when a newer lease wrote (or deleted) the row;
    /// [`Error::DuplicateToken`]; [`Error::RowSealed`]; [`Error::Backend`] otherwise.
    pub async fn upsert<'c, E: WriteExecutor<'c>>(
        &self,
        exec: E,
        fencing: impl Into<Fencing>,
        row: &T,
    ) -> Result<Upserted> {
        let _timer = crate::metrics::Timer::write("upsert");
        let fencing = fencing.into();
        let source = Source::Row(row);
        ordered_write!(
            self,
            exec,
            ("upsert", "upsert"),
            fencing,
            source,
            row.key_hash(),
            &self.sql.explain_upsert,
            |lent, expected| async {
                let write = self
                    .sql
                    .upsert
                    .bind_expecting(source, &fencing, false, expected);
                let done = self
                    .written(write.fetch_optional(lent.conn()).await, &fencing, "upsert")
                    .await?;
                done.map(|done| {
                    let upserted = if done.try_get::<bool, _>(0)? {
                        Upserted::Inserted
                    } else {
                        Upserted::Updated
                    };
                    Ok((upserted, Some(done.try_get::<i64, _>(1)?)))
                })
                .transpose()
            }
        )
    }

    /// Deletes the row with `key` if no newer lease has written it, and records a tombstone
    /// so that an older lease's `upsert` cannot recreate it.
    ///
    /// # Errors
    /// [`Error::StaleToken`] when a newer lease wrote the row; [`Error::DuplicateToken`];
    /// [`Error::NotFound`] when there is no such row; [`Error::Backend`] otherwise.
    pub async fn delete<'c, E: WriteExecutor<'c>>(
        &self,
        exec: E,
        fencing: impl Into<Fencing>,
        key: &T::Key,
    ) -> Result<()> {
        let _timer = crate::metrics::Timer::write("delete");
        let fencing = fencing.into();
        let source = Source::<T>::Key(key);
        ordered_write!(
            self,
            exec,
            ("delete", "delete"),
            fencing,
            source,
            T::key_value_hash(key),
            &self.sql.explain_delete,
            |lent, expected| async {
                let write = self
                    .sql
                    .delete
                    .bind_expecting(source, &fencing, false, expected);
                let deleted = self
                    .written(write.fetch_one(lent.conn()).await, &fencing, "delete")
                    .await?;
                // The tombstone's fence: what the lease's next upsert of the key expects.
                let tomb: Option<i64> = deleted.try_get(1)?;
                Ok(deleted.try_get::<bool, _>(0)?.then_some(((), tomb)))
            }
        )
    }

    /// Claims the row with `key` for this lease and reads it, in one statement (`UPDATE ...
    /// SET fence = <next> WHERE <key> AND <fence admits the lease> RETURNING *`): from now on
    /// every older lease's write, claim or delete of the row is rejected, so a
    /// read-modify-write that claims first loses nothing to a zombie — even across
    /// transactions. Returns the row as `R` (usually `T` itself, with `#[derive(sqlx::FromRow)]`;
    /// extra columns such as `fence` are ignored by the derive).
    ///
    /// # Errors
    /// As [`Repository::update`] (operation `claim` in the audit trail).
    ///
    /// # Example
    /// ```no_run
    /// # #[derive(Clone, sqlx::FromRow)] struct Invoice { id: i64, status: String }
    /// # pgfence::fenced_table!(Invoice { table: "invoices", key: id: i64, columns: [status] });
    /// # async fn f(pool: sqlx::PgPool, lease: pgfence::Lease) -> pgfence::Result<()> {
    /// let repo = pgfence::Repository::<Invoice>::new(pool.clone())?;
    /// let mut invoice: Invoice = repo.claim(&pool, &lease, &42).await?;
    /// invoice.status = "paid".into();
    /// repo.update(&pool, &lease, &invoice).await?;
    /// # Ok(()) }
    /// ```
    pub async fn claim<'c, E, R>(
        &self,
        exec: E,
        fencing: impl Into<Fencing>,
        key: &T::Key,
    ) -> Result<R>
    where
        E: WriteExecutor<'c>,
        R: for<'r> sqlx::FromRow<'r, PgRow> + Send + Unpin,
    {
        let _timer = crate::metrics::Timer::write("claim");
        let fencing = fencing.into();
        let source = Source::<T>::Key(key);
        let decode = |row: &PgRow| -> Result<(R, Option<i64>)> {
            let fence: i64 = row.try_get("fence")?;
            let decoded = R::from_row(row).map_err(|e| Error::Decode {
                table: self.table.quoted(),
                operation: "claim",
                source: e,
            })?;
            Ok((decoded, Some(fence)))
        };
        ordered_write!(
            self,
            exec,
            ("claim", "claim"),
            fencing,
            source,
            T::key_value_hash(key),
            &self.sql.explain_claim,
            |lent, expected| async {
                let write = self
                    .sql
                    .claim
                    .bind_expecting(source, &fencing, false, expected);
                // The claim and the decoding of its row are one transaction, so a row that
                // does not decode into `R` is left as it was: the claim's own on a pool or a
                // connection outside a transaction, a savepoint inside the caller's (one
                // round trip more than the claim; a claim is followed by a read-modify-write).
                let mut tx = sqlx::Connection::begin(lent.conn()).await?;
                let claimed = match write.fetch_optional(&mut *tx).await {
                    Ok(claimed) => claimed,
                    Err(e) => {
                        // The statement's own error is the answer, whatever the rollback says.
                        let _ = tx.rollback().await;
                        return Err(self.write_error(e, &fencing, "claim").await);
                    }
                };
                let Some(row) = claimed else {
                    tx.commit().await?;
                    return Ok(None);
                };
                match decode(&row) {
                    Ok(done) => {
                        tx.commit().await?;
                        Ok(Some(done))
                    }
                    Err(e) => {
                        tx.rollback().await?;
                        Err(e)
                    }
                }
            }
        )
    }

    /// Reads the row with `key` (`SELECT * FROM <table> WHERE <key>`), or `None`: a plain
    /// read, without a lease and without fencing anything, into `R` (usually `T` itself with
    /// `#[derive(sqlx::FromRow)]`; extra columns such as `fence` are ignored by the derive).
    /// To read a row and keep older leases from writing it, [`claim`](Repository::claim) it.
    ///
    /// # Errors
    /// [`Error::Backend`].
    ///
    /// # Example
    /// ```no_run
    /// # #[derive(Clone, sqlx::FromRow)] struct Invoice { id: i64, status: String }
    /// # pgfence::fenced_table!(Invoice { table: "invoices", key: id: i64, columns: [status] });
    /// # async fn f(pool: sqlx::PgPool) -> pgfence::Result<()> {
    /// let repo = pgfence::Repository::<Invoice>::new(pool.clone())?;
    /// if let Some(invoice) = repo.fetch::<_, Invoice>(&pool, &42).await? {
    ///     println!("invoice 42 is {}", invoice.status);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn fetch<'c, E, R>(&self, exec: E, key: &T::Key) -> Result<Option<R>>
    where
        E: WriteExecutor<'c>,
        R: for<'r> sqlx::FromRow<'r, PgRow> + Send + Unpin,
    {
        let mut lent = exec.into_target().lend().await?;
        let query = self.sql.fetch.bind_key::<T>(key);
        match query.fetch_optional(lent.conn()).await? {
            Some(row) => Ok(Some(R::from_row(&row)?)),
            None => Ok(None),
        }
    }

    /// Like [`Repository::update`], but sets only `columns` (names from
    /// [`FencedTable::COLUMNS`]): the other columns keep what the row has, whoever wrote it.
    /// The write is fenced exactly like `update` — same predicate, same next fence, same
    /// stale / duplicate / not-found classification and audit (operation `update`). Each
    /// column set's statement is built once and kept.
    ///
    /// # Errors
    /// [`InvalidInput::Table`] before anything is sent when `columns` is empty, names a column
    /// that is not declared (or a key column), or `T`'s impl does not bind single columns
    /// ([`FencedTable::bind_column`]); otherwise as [`Repository::update`].
    ///
    /// # Example
    /// ```no_run
    /// # #[derive(Clone)] struct Invoice { id: i64, status: String, amount: i64 }
    /// # pgfence::fenced_table!(Invoice { table: "invoices", key: id: i64, columns: [status, amount] });
    /// # async fn f(pool: sqlx::PgPool, lease: pgfence::Lease, mut invoice: Invoice) -> pgfence::Result<()> {
    /// let repo = pgfence::Repository::<Invoice>::new(pool.clone())?;
    /// invoice.status = "paid".into();
    /// // Writes `status` (and the fence) only; `amount` keeps what the row has.
    /// repo.update_columns(&pool, &lease, &invoice, &["status"]).await?;
    /// # Ok(()) }
    /// ```
    pub async fn update_columns<'c, E: WriteExecutor<'c>>(
        &self,
        exec: E,
        fencing: impl Into<Fencing>,
        row: &T,
        columns: &[&str],
    ) -> Result<()> {
        let _timer = crate::metrics::Timer::write("update_columns");
        let fencing = fencing.into();
        let statement = self.partial_update(columns)?;
        let unbound = || {
            self.invalid_table(
                "its FencedTable impl does not bind single columns (implement \
                 FencedTable::bind_column, or use #[derive(FencedTable)] / fenced_table!)",
            )
        };
        // Refused before anything is sent (or bound).
        let _ = statement
            .bind_partial(row, &fencing, 0)
            .ok_or_else(unbound)?;
        let source = Source::Row(row);
        ordered_write!(
            self,
            exec,
            ("update_columns", "update"),
            fencing,
            source,
            row.key_hash(),
            &self.sql.explain_update,
            |lent, expected| async {
                let write = statement
                    .bind_partial(row, &fencing, expected)
                    .ok_or_else(unbound)?;
                let done = self
                    .written(write.fetch_optional(lent.conn()).await, &fencing, "update")
                    .await?;
                done.map(|d| Ok(((), Some(d.try_get::<i64, _>(0)?))))
                    .transpose()
            }
        )
    }

    /// Like [`Repository::update`], but applied only where the row also meets `condition`, in
    /// the same statement (`... WHERE <key> AND <fence admits the lease> AND <condition>`): the
    /// caller's own check — an optimistic lock's `version = $n` — kept beside the fence, and
    /// checked atomically with it. Which check refused a write that changed nothing is told
    /// apart by the one explaining statement: the fence first, then the condition.
    ///
    /// # Errors
    /// [`Error::ConditionFailed`] when the row exists, the fence admits the lease and
    /// `condition` does not hold (not audited: the lease is not fenced out); otherwise as
    /// [`Repository::update`] — [`Error::StaleToken`] (and the other fenced errors) when the
    /// fence refuses, whatever the condition; [`Error::NotFound`] when there is no such row.
    ///
    /// # Example
    /// ```no_run
    /// # #[derive(Clone)] struct Doc { id: i64, body: String, version: i64 }
    /// # pgfence::fenced_table!(Doc { table: "docs", key: id: i64, columns: [body, version] });
    /// use pgfence::{Error, repository::Condition};
    /// # async fn f(pool: sqlx::PgPool, lease: pgfence::Lease, read: Doc) -> pgfence::Result<()> {
    /// let repo = pgfence::Repository::<Doc>::new(pool.clone())?;
    /// let next = Doc { body: "edited".into(), version: read.version + 1, ..read.clone() };
    /// match repo.update_if(&pool, &lease, &next, &Condition::eq("version", read.version)?).await {
    ///     Ok(()) => {}
    ///     // Someone wrote the row since we read it (the lease still holds it): re-read.
    ///     Err(Error::ConditionFailed { .. }) => { /* re-read and decide */ }
    ///     // A newer lease took over: stop.
    ///     Err(e) => return Err(e),
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn update_if<'c, E: WriteExecutor<'c>>(
        &self,
        exec: E,
        fencing: impl Into<Fencing>,
        row: &T,
        condition: &Condition,
    ) -> Result<()> {
        let _timer = crate::metrics::Timer::write("update_if");
        let fencing = fencing.into();
        let source = Source::Row(row);
        let statement = self.sql.update_if(None, condition);
        let explain = self.sql.explain_if(&self.sql.explain_update, condition);
        ordered_write!(
            self,
            exec,
            ("update_if", "update"),
            fencing,
            source,
            row.key_hash(),
            &explain,
            |lent, expected| async {
                let write = statement.bind_expecting(source, &fencing, false, expected);
                let done = self
                    .written(write.fetch_optional(lent.conn()).await, &fencing, "update")
                    .await?;
                done.map(|d| Ok(((), Some(d.try_get::<i64, _>(0)?))))
                    .transpose()
            }
        )
    }

    /// [`Repository::update_columns`] with a [`Condition`], as [`Repository::update_if`]:
    /// sets only `columns`, and only where the row also meets `condition`.
    ///
    /// # Errors
    /// As [`Repository::update_columns`], and [`Error::ConditionFailed`] as
    /// [`Repository::update_if`].
    pub async fn update_columns_if<'c, E: WriteExecutor<'c>>(
        &self,
        exec: E,
        fencing: impl Into<Fencing>,
        row: &T,
        columns: &[&str],
        condition: &Condition,
    ) -> Result<()> {
        let _timer = crate::metrics::Timer::write("update_columns_if");
        let fencing = fencing.into();
        let set = self.column_positions(columns)?;
        let statement = self.sql.update_if(Some(&set), condition);
        let unbound = || {
            self.invalid_table(
                "its FencedTable impl does not bind single columns (implement \
                 FencedTable::bind_column, or use #[derive(FencedTable)] / fenced_table!)",
            )
        };
        // Refused before anything is sent (or bound).
        let _ = statement
            .bind_partial(row, &fencing, 0)
            .ok_or_else(unbound)?;
        let explain = self.sql.explain_if(&self.sql.explain_update, condition);
        let source = Source::Row(row);
        ordered_write!(
            self,
            exec,
            ("update_columns_if", "update"),
            fencing,
            source,
            row.key_hash(),
            &explain,
            |lent, expected| async {
                let write = statement
                    .bind_partial(row, &fencing, expected)
                    .ok_or_else(unbound)?;
                let done = self
                    .written(write.fetch_optional(lent.conn()).await, &fencing, "update")
                    .await?;
                done.map(|d| Ok(((), Some(d.try_get::<i64, _>(0)?))))
                    .transpose()
            }
        )
    }

    /// Like [`Repository::delete`] (a tombstone included), but applied only where the row also
    /// meets `condition`, in the same statement, as [`Repository::update_if`].
    ///
    /// # Errors
    /// As [`Repository::delete`], and [`Error::ConditionFailed`] as [`Repository::update_if`].
    pub async fn delete_if<'c, E: WriteExecutor<'c>>(
        &self,
        exec: E,
        fencing: impl Into<Fencing>,
        key: &T::Key,
        condition: &Condition,
    ) -> Result<()> {
        let _timer = crate::metrics::Timer::write("delete_if");
        let fencing = fencing.into();
        let source = Source::<T>::Key(key);
        let statement = self.sql.delete_if(condition);
        let explain = self.sql.explain_if(&self.sql.explain_delete, condition);
        ordered_write!(
            self,
            exec,
            ("delete_if", "delete"),
            fencing,
            source,
            T::key_value_hash(key),
            &explain,
            |lent, expected| async {
                let write = statement.bind_expecting(source, &fencing, false, expected);
                let deleted = self
                    .written(write.fetch_one(lent.conn()).await, &fencing, "delete")
                    .await?;
                let tomb: Option<i64> = deleted.try_get(1)?;
                Ok(deleted.try_get::<bool, _>(0)?.then_some(((), tomb)))
            }
        )
    }

    /// The partial-update statement for `columns`, from the cache or built (and cached).
    fn partial_update(&self, columns: &[&str]) -> Result<Arc<Statement>> {
        let set = self.column_positions(columns)?;
        // A poisoned lock only means another thread panicked while inserting: the map is
        // still a valid cache.
        let mut cache = self.partial.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(statement) = cache.get(&set) {
            return Ok(statement.clone());
        }
        let statement = Arc::new(self.sql.update_columns(&set));
        if cache.len() < MAX_CACHED_PARTIAL {
            cache.insert(set, statement.clone());
        }
        Ok(statement)
    }

    /// The positions in [`FencedTable::COLUMNS`] of `columns` (sorted, distinct), or why they
    /// cannot be set by a partial update.
    fn column_positions(&self, columns: &[&str]) -> Result<Vec<usize>> {
        let mut set = Vec::with_capacity(columns.len());
        for name in columns {
            match T::COLUMNS.iter().position(|c| c == name) {
                Some(i) => set.push(i),
                None if T::KEY_COLUMNS.contains(name) => {
                    return Err(self.invalid_table(&format!(
                        "column \"{name}\" is a key column: update_columns sets data columns only"
                    )));
                }
                None => {
                    return Err(self.invalid_table(&format!(
                        "column \"{name}\" is not a declared column (declared: {})",
                        T::COLUMNS.join(", ")
                    )));
                }
            }
        }
        set.sort_unstable();
        set.dedup();
        if set.is_empty() {
            return Err(self.invalid_table("update_columns needs at least one column"));
        }
        Ok(set)
    }

    fn invalid_table(&self, reason: &str) -> Error {
        Error::Invalid(InvalidInput::Table {
            table: self.table.quoted(),
            reason: reason.to_owned(),
        })
    }

    /// The other resource of the lease's fencing domain whose lease, with `token`, holds a row
    /// now: the one whose high-water mark carries that token (`pgfence.domain_mark_holder`,
    /// through the audit pool: the rejection path only). `None` without a domain, for the
    /// lease's own resource, or when no mark (or no privilege) says.
    async fn held_by(&self, fencing: &Fencing, token: i64) -> Option<Box<str>> {
        let resource = fencing.resource.as_ref()?;
        let domain = resource.domain()?;
        let holder: Option<String> =
            sqlx::query_scalar("SELECT pgfence.domain_mark_holder($1, $2)")
                .bind(domain)
                .bind(token)
                .fetch_one(self.auditor.pool())
                .await
                .ok()
                .flatten();
        holder
            .filter(|h| h != resource.as_str())
            .map(String::into_boxed_str)
    }

    /// A write statement's result: an error is the write's (a refused token jump is audited,
    /// [`Rejecting::write_failed`]).
    async fn written<R>(
        &self,
        result: sqlx::Result<R>,
        fencing: &Fencing,
        operation: &'static str,
    ) -> Result<R> {
        match result {
            Ok(done) => Ok(done),
            Err(e) => Err(self.write_error(e, fencing, operation).await),
        }
    }

    /// A write statement's error, as [`written`](Self::written) reports it.
    async fn write_error(
        &self,
        e: sqlx::Error,
        fencing: &Fencing,
        operation: &'static str,
    ) -> Error {
        let err = Error::from(e);
        self.seen.forget_on(&err);
        self.rejecting(fencing, operation).write_failed(err).await
    }

    /// The rejection context of one write.
    pub(crate) fn rejecting<'a>(
        &'a self,
        fencing: &'a Fencing,
        operation: &'static str,
    ) -> Rejecting<'a> {
        Rejecting {
            fencing,
            table: self.table.quoted(),
            operation,
            auditor: &self.auditor,
        }
    }

    /// A single-row write that changed nothing: runs `explain` and says what to do next —
    /// send it again (the lease now binds to the database's new timeline), send it again
    /// expecting the lease's own fence it found (its concurrent write, or a row it forgot),
    /// or fail with the write's error (logged and audited when it is a rejection:
    /// [`crate::repository::rejection`]).
    async fn cas_refusal(
        &self,
        explain: &Statement,
        source: Source<'_, T>,
        fencing: &Fencing,
        operation: &'static str,
        lent: &mut Lent<'_>,
    ) -> Result<Next> {
        let (row, audit_error) = explain_row(explain, source, fencing, lent).await?;
        let rejecting = self.rejecting(fencing, operation);
        if rejecting.failover(&self.seen, &row, lent).await? {
            return Ok(Next::Resend);
        }
        let out = Explained {
            row: &row,
            audit_error: audit_error.as_deref(),
        };
        // An upsert that finds no row but a fenced delete's tombstone was refused by it.
        let met = if operation == "upsert" {
            out.current_or_tombstone()?
        } else {
            out.current()?
        };
        let judgement = judge(fencing, met);
        // The fence admits the lease: a conditional write's own condition may be why.
        if let Some(condition) = explain.condition()
            && judgement == Judgement::Contended
            && out.condition_refused()?
        {
            return Ok(Next::Fail(rejecting.condition_failed(&out, condition)));
        }
        if let (Judgement::Contended, Some(current)) = (judgement, met) {
            return Ok(Next::Expect(current));
        }
        let err = rejecting
            .error(&out, judgement, |token| self.held_by(fencing, token), lent)
            .await?;
        Ok(Next::Fail(err))
    }
}

/// Runs an explaining statement on the write's connection: its row, and the error of its own
/// audit insert if that failed (`pgfence.record_rejection` in the error's context; the
/// statement then runs again without the insert, so an audit failure never replaces the
/// rejection).
async fn explain_row<T: FencedTable>(
    explain: &Statement,
    source: Source<'_, T>,
    fencing: &Fencing,
    lent: &mut Lent<'_>,
) -> Result<(PgRow, Option<String>)> {
    let own = lent.own_transaction();
    let first = explain
        .bind(source, fencing, own)
        .fetch_one(lent.conn())
        .await;
    match first {
        Ok(row) => Ok((row, None)),
        Err(e) => {
            if let Some(audit_error) = audit_failure(&e) {
                // The failed insert aborted the write's own transaction, which holds nothing
                // (the write changed no row): begin it again.
                lent.restart_gate().await?;
                let row = explain
                    .bind(source, fencing, false)
                    .fetch_one(lent.conn())
                    .await?;
                return Ok((row, Some(audit_error)));
            }
            // On its own (autocommit), the statement's audit row commits with it: a commit the
            // server refused (a deferred constraint on the audit table, say) took the row back,
            // and the statement runs again with the row left to the auditor's pool.
            if own && lent.autocommit() && crate::repository::executor::commit_rolled_back(&e) {
                let row = explain
                    .bind(source, fencing, false)
                    .fetch_one(lent.conn())
                    .await?;
                return Ok((row, None));
            }
            Err(e.into())
        }
    }
}

fn idents(names: &[&str]) -> Result<Vec<Ident>> {
    names.iter().map(|n| Ident::new(*n)).collect()
}
