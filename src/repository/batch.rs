//! Batch fenced writes: many rows in one statement, one outcome per row.
//!
//! [`Repository::update_many`], [`upsert_many`](Repository::upsert_many),
//! [`delete_many`](Repository::delete_many) and [`claim_many`](Repository::claim_many) send
//! the batch as one array per column in **one statement** whose text does not depend on the
//! batch's size. Every row gets its own [`RowOutcome`], in input order; nothing is collapsed.
//! As for single writes, a batch whose rows all applied costs that one statement; only when
//! some rows were not applied does a second statement, about those rows only, tell stale
//! from duplicate token from not found — and, on a pool, write one audit row per rejected row
//! in that same statement (on a connection the [`Auditor`](crate::audit::Auditor)'s pool writes them).
//! Each rejected row is logged as its own WARN event with the usual fields.
//!
//! Rules: an empty batch is a no-op (no statement is sent); a batch naming one key twice is
//! refused before anything is written ([`InvalidInput::Batch`](crate::error::InvalidInput::Batch), listing the keys); a batch
//! of more than [`MAX_BATCH_ROWS`] rows is refused (split it; parameters never run out, as
//! each column is one array parameter). Inside the caller's transaction (`&mut *tx`) a batch
//! is part of that transaction; on a pool it is a transaction of its own, applied rows and
//! rejections alike.

use crate::error::InvalidInput;
use sqlx::Row;
use sqlx::postgres::PgRow;

use crate::repository::executor::{Lent, WriteExecutor};
use crate::repository::outcome::{BatchOutcome, Claimed, MAX_BATCH_ROWS, RowOutcome};
use crate::repository::rejection::{Explained, Judgement, audit_failure, judge};
use crate::repository::sql::{BatchSource, Statement};
use crate::{Error, FencedTable, Fencing, Repository, Result};

impl<T: FencedTable> Repository<T> {
    /// Updates many existing rows under one lease, in one statement: like
    /// [`Repository::update`] for each row, with one [`RowOutcome`] per row in input order.
    ///
    /// # Errors
    /// [`InvalidInput::Batch`] for a key given twice, more than [`MAX_BATCH_ROWS`] rows, or a
    /// table type that does not bind arrays (nothing is written); [`Error::Backend`].
    /// Stale, duplicate-token and missing rows are outcomes, not errors.
    ///
    /// # Example
    /// ```no_run
    /// # #[derive(Clone)] struct Invoice { id: i64, status: String }
    /// # pgfence::fenced_table!(Invoice { table: "invoices", key: id: i64, columns: [status] });
    /// # async fn f(pool: sqlx::PgPool, lease: pgfence::Lease, invoices: Vec<Invoice>) -> pgfence::Result<()> {
    /// let repo = pgfence::Repository::<Invoice>::new(pool.clone())?;
    /// let outcome = repo.update_many(&pool, &lease, &invoices).await?;
    /// let summary = outcome.summary();
    /// if summary.stale > 0 {
    ///     // A newer lease owns some of these invoices: this job has been fenced out.
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn update_many<'c, E: WriteExecutor<'c>>(
        &self,
        exec: E,
        fencing: impl Into<Fencing>,
        rows: &[T],
    ) -> Result<BatchOutcome> {
        self.write_rows(exec, fencing.into(), rows, Op::Update)
            .await
    }

    /// Inserts or updates many rows under one lease, in one statement: like
    /// [`Repository::upsert`] for each row ([`RowOutcome::Inserted`] / [`RowOutcome::Updated`]).
    ///
    /// # Errors
    /// As [`Repository::update_many`].
    pub async fn upsert_many<'c, E: WriteExecutor<'c>>(
        &self,
        exec: E,
        fencing: impl Into<Fencing>,
        rows: &[T],
    ) -> Result<BatchOutcome> {
        self.write_rows(exec, fencing.into(), rows, Op::Upsert)
            .await
    }

    /// Deletes many rows under one lease, in one statement, leaving tombstones: like
    /// [`Repository::delete`] for each key.
    ///
    /// # Errors
    /// As [`Repository::update_many`].
    pub async fn delete_many<'c, E: WriteExecutor<'c>>(
        &self,
        exec: E,
        fencing: impl Into<Fencing>,
        keys: &[T::Key],
    ) -> Result<BatchOutcome> {
        let refs: Vec<&T::Key> = keys.iter().collect();
        self.write_many(exec, &fencing.into(), BatchSource::Keys(&refs), Op::Delete)
            .await
    }

    /// Claims many rows for the lease and reads them, in one statement: like
    /// [`Repository::claim`] for each key.
    ///
    /// # Errors
    /// As [`Repository::update_many`].
    pub async fn claim_many<'c, E, R>(
        &self,
        exec: E,
        fencing: impl Into<Fencing>,
        keys: &[T::Key],
    ) -> Result<Claimed<R>>
    where
        E: WriteExecutor<'c>,
        R: for<'r> sqlx::FromRow<'r, PgRow> + Send + Unpin,
    {
        let _timer = crate::metrics::Timer::write("claim_many");
        let fencing = fencing.into();
        let refs: Vec<&T::Key> = keys.iter().collect();
        let source = BatchSource::<T>::Keys(&refs);
        let mut claimed: Vec<Option<R>> =
            std::iter::repeat_with(|| None).take(keys.len()).collect();
        if keys.is_empty() {
            return Ok(Claimed {
                rows: claimed,
                outcome: BatchOutcome::default(),
            });
        }
        self.check_size(keys.len())?;
        crate::repository::executor::bounded(
            self.call_timeout(),
            "claim_many",
            || self.table().quoted(),
            exec.into_target(),
            |mut lent| async move {
                let result = async {
                    loop {
                        self.seen.bind(&fencing.timeline, lent.conn()).await?;
                        let query =
                            self.bound(&self.sql.batch.claim, &source, &[], &fencing, false)?;
                        let mut outcomes = vec![None; keys.len()];
                        // The claim and the decoding of its rows are one transaction: the write's own (its
                        // gate, rolled back on an error) or a savepoint inside the caller's. When a row does
                        // not decode into `R`, no row is claimed.
                        let failed = |e| match e {
                            Decoding::Duplicate => {
                                self.invalid("the same key appears more than once in the batch")
                            }
                            Decoding::Row(source) => Error::Decode {
                                table: self.table().quoted(),
                                operation: "claim_many",
                                source,
                            },
                            Decoding::Other(e) => e,
                        };
                        if lent.gated() {
                            let rows = query.fetch_all(lent.conn()).await?;
                            decode_claimed(&rows, &mut claimed, &mut outcomes, keys.len())
                                .map_err(failed)?;
                        } else {
                            let mut tx = sqlx::Connection::begin(lent.conn()).await?;
                            let rows = match query.fetch_all(&mut *tx).await {
                                Ok(rows) => rows,
                                Err(e) => {
                                    let _ = tx.rollback().await;
                                    return Err(e.into());
                                }
                            };
                            match decode_claimed(&rows, &mut claimed, &mut outcomes, keys.len()) {
                                Ok(()) => tx.commit().await?,
                                Err(e) => {
                                    tx.rollback().await?;
                                    return Err(failed(e));
                                }
                            }
                        }
                        let Some(outcome) = self
                            .explain_rest(&mut lent, &source, &fencing, outcomes, Op::Claim)
                            .await?
                        else {
                            continue;
                        };
                        return Ok(Claimed {
                            rows: claimed,
                            outcome,
                        });
                    }
                }
                .await;
                (lent, result)
            },
        )
        .await
    }

    async fn write_rows<'c, E: WriteExecutor<'c>>(
        &self,
        exec: E,
        fencing: Fencing,
        rows: &[T],
        op: Op,
    ) -> Result<BatchOutcome> {
        let refs: Vec<&T> = rows.iter().collect();
        self.write_many(exec, &fencing, BatchSource::Rows(&refs), op)
            .await
    }

    async fn write_many<'c, E: WriteExecutor<'c>>(
        &self,
        exec: E,
        fencing: &Fencing,
        source: BatchSource<'_, T>,
        op: Op,
    ) -> Result<BatchOutcome> {
        let _timer = crate::metrics::Timer::write(op.batch_name());
        let n = match &source {
            BatchSource::Rows(rows) => rows.len(),
            BatchSource::Keys(keys) => keys.len(),
        };
        if n == 0 {
            return Ok(BatchOutcome::default());
        }
        self.check_size(n)?;
        let statement = match op {
            Op::Update => &self.sql.batch.update,
            Op::Upsert => &self.sql.batch.upsert,
            Op::Delete | Op::Claim => &self.sql.batch.delete,
        };
        crate::repository::executor::bounded(
            self.call_timeout(),
            op.batch_name(),
            || self.table().quoted(),
            exec.into_target(),
            |mut lent| async move {
                let result = async {
                    loop {
                        self.seen.bind(&fencing.timeline, lent.conn()).await?;
                        let query = self.bound(statement, &source, &[], fencing, false)?;
                        let mut outcomes = vec![None; n];
                        let mut dups = Vec::new();
                        for row in query.fetch_all(lent.conn()).await? {
                            if let Some(key) = row.try_get::<Option<String>, _>("dup")? {
                                dups.push(key);
                                continue;
                            }
                            let Some(ord) = row.try_get::<Option<i64>, _>("ord")? else {
                                continue;
                            };
                            outcomes[index(ord, n)?] = Some(match op {
                                Op::Upsert if row.try_get::<bool, _>("inserted")? => {
                                    RowOutcome::Inserted
                                }
                                Op::Upsert => RowOutcome::Updated,
                                _ => RowOutcome::Applied,
                            });
                        }
                        if !dups.is_empty() {
                            return Err(self.invalid(&format!(
                                "keys appear more than once in the batch (nothing was written): {}",
                                dups.join(", ")
                            )));
                        }
                        if let Some(outcome) = self
                            .explain_rest(&mut lent, &source, fencing, outcomes, op)
                            .await?
                        {
                            return Ok(outcome);
                        }
                    }
                }
                .await;
                (lent, result)
            },
        )
        .await
    }

    /// Explains the rows `outcomes` has no outcome for (they were not applied), records
    /// their rejections, and returns every row's outcome; `None` when nothing was applied
    /// and the lease now binds to the database's new timeline (send the batch again).
    async fn explain_rest(
        &self,
        lent: &mut Lent<'_>,
        source: &BatchSource<'_, T>,
        fencing: &Fencing,
        mut outcomes: Vec<Option<RowOutcome>>,
        op: Op,
    ) -> Result<Option<BatchOutcome>> {
        let missing: Vec<usize> = (0..outcomes.len())
            .filter(|&i| outcomes[i].is_none())
            .collect();
        if !missing.is_empty() {
            let ords: Vec<i64> = missing
                .iter()
                .map(|&i| i64::try_from(i + 1).unwrap_or(i64::MAX))
                .collect();
            let (rows, keys);
            let subset = match source {
                BatchSource::Rows(all) => {
                    rows = missing.iter().map(|&i| all[i]).collect::<Vec<_>>();
                    BatchSource::Rows(&rows)
                }
                BatchSource::Keys(all) => {
                    keys = missing.iter().map(|&i| all[i]).collect::<Vec<_>>();
                    BatchSource::Keys(&keys)
                }
            };
            let explain = match op {
                Op::Update => &self.sql.batch.explain_update,
                Op::Upsert => &self.sql.batch.explain_upsert,
                Op::Delete => &self.sql.batch.explain_delete,
                Op::Claim => &self.sql.batch.explain_claim,
            };
            let own = lent.own_transaction();
            let first = if lent.gated() {
                // In the write's own transaction, a failed audit insert must not abort it (the
                // batch's applied rows are in it): the explain runs in a savepoint.
                let mut savepoint = sqlx::Connection::begin(lent.conn()).await?;
                let first = self
                    .bound(explain, &subset, &ords, fencing, own)?
                    .fetch_all(&mut *savepoint)
                    .await;
                match &first {
                    Ok(_) => savepoint.commit().await?,
                    Err(_) => savepoint.rollback().await?,
                }
                first
            } else {
                self.bound(explain, &subset, &ords, fencing, own)?
                    .fetch_all(lent.conn())
                    .await
            };
            let (explained, audit_error) = match first {
                Ok(rows) => (rows, None),
                Err(e) => match audit_failure(&e) {
                    // The in-statement audit failed: explain again without it, keep the error.
                    Some(audit_error) => (
                        self.bound(explain, &subset, &ords, fencing, false)?
                            .fetch_all(lent.conn())
                            .await?,
                        Some(audit_error),
                    ),
                    None => return Err(e.into()),
                },
            };
            // A lease fenced out by a failover is refused as a whole, once.
            let rejecting = self.rejecting(fencing, op.name());
            if let Some(first) = explained.first()
                && rejecting.failover(&self.seen, first, lent).await?
            {
                return Ok(None);
            }
            for row in &explained {
                let i = index(row.try_get("ord")?, outcomes.len())?;
                let out = Explained {
                    row,
                    audit_error: audit_error.as_deref(),
                };
                let judgement = match op {
                    // No row and no tombstone: the upsert did not apply, yet nothing stopped
                    // it (the row went away while it ran).
                    Op::Upsert => match judge(fencing, out.current_or_tombstone()?) {
                        Judgement::NotFound => Judgement::Contended,
                        judgement => judgement,
                    },
                    _ => judge(fencing, out.current()?),
                };
                outcomes[i] = Some(rejecting.outcome(&out, judgement, lent).await?);
            }
        }
        Ok(Some(BatchOutcome {
            rows: outcomes
                .into_iter()
                .map(|o| o.unwrap_or(RowOutcome::Contended))
                .collect(),
        }))
    }

    fn bound(
        &self,
        statement: &Statement,
        source: &BatchSource<'_, T>,
        ords: &[i64],
        fencing: &Fencing,
        own_transaction: bool,
    ) -> Result<crate::table::PgQuery> {
        statement
            .bind_batch(source, ords, fencing, own_transaction)
            .ok_or_else(|| {
                self.invalid("its FencedTable impl does not bind arrays (use fenced_table!)")
            })
    }

    fn check_size(&self, n: usize) -> Result<()> {
        if n > MAX_BATCH_ROWS {
            return Err(self.invalid(&format!(
                "{n} rows; at most {MAX_BATCH_ROWS} per call (split the batch)"
            )));
        }
        Ok(())
    }

    fn invalid(&self, reason: &str) -> Error {
        Error::Invalid(InvalidInput::Batch {
            table: self.table().quoted(),
            reason: reason.to_owned(),
        })
    }
}

/// Which batch write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Update,
    Upsert,
    Delete,
    Claim,
}

impl Op {
    fn batch_name(self) -> &'static str {
        match self {
            Op::Update => "update_many",
            Op::Upsert => "upsert_many",
            Op::Delete => "delete_many",
            Op::Claim => "claim_many",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Op::Update => "update",
            Op::Upsert => "upsert",
            Op::Delete => "delete",
            Op::Claim => "claim",
        }
    }
}

/// The 0-based index of a 1-based position the server returned.
fn index(ord: i64, len: usize) -> Result<usize> {
    usize::try_from(ord)
        .ok()
        .and_then(|o| o.checked_sub(1))
        .filter(|&i| i < len)
        .ok_or_else(|| {
            Error::database(sqlx::Error::Protocol(format!(
                "batch statement returned position {ord} for a batch of {len}"
            )))
        })
}

/// Why a batch claim's rows could not be taken.
enum Decoding {
    /// The same key more than once.
    Duplicate,
    /// A row does not decode into the caller's type.
    Row(sqlx::Error),
    /// Anything else.
    Other(Error),
}

/// Decodes a batch claim's rows into `claimed` (by their position in the batch) and marks
/// them applied in `outcomes`.
fn decode_claimed<R>(
    rows: &[PgRow],
    claimed: &mut [Option<R>],
    outcomes: &mut [Option<RowOutcome>],
    len: usize,
) -> std::result::Result<(), Decoding>
where
    R: for<'r> sqlx::FromRow<'r, PgRow>,
{
    for row in rows {
        let dups: i64 = row
            .try_get("pgfence_dups")
            .map_err(|e| Decoding::Other(e.into()))?;
        if dups > 0 {
            return Err(Decoding::Duplicate);
        }
        let ord: Option<i64> = row
            .try_get("pgfence_ord")
            .map_err(|e| Decoding::Other(e.into()))?;
        if let Some(ord) = ord {
            let i = index(ord, len).map_err(Decoding::Other)?;
            claimed[i] = Some(R::from_row(row).map_err(Decoding::Row)?);
            outcomes[i] = Some(RowOutcome::Applied);
        }
    }
    Ok(())
}
