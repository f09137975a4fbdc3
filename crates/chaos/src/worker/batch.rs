//! Batch mode: a unit's rows (drawn from its lease's group), `claim_many` and `update_many`
//! of them, the history rows of a batch statement, and the rejection its rows met.

use pgfence::{Error, error::StaleTarget, repository::Claimed};
use rand::Rng;
use sqlx::PgConnection;

use crate::schema::{ClaimCell, CounterTable, Kind, RECORD_MANY_SQL};
use crate::{RowResult, Stage};

use super::{Failure, Step, Try, Worker, at, db_at};

impl Worker {
    /// Batch mode: the rows a unit of `group` writes — between `batch_min_rows` and
    /// `batch_max_rows` distinct rows of the group (all of them if it is smaller), ascending.
    pub(super) fn draw_batch_rows(&mut self, group: i32) -> Vec<i32> {
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
}

impl Try<'_> {
    /// Batch mode: claims the unit's rows in one statement and records the claimed ones. Fails
    /// (rejected) only when no row was claimed; the others go on to the update.
    pub(super) async fn claim_many(
        &mut self,
        conn: &mut PgConnection,
        txn: u32,
        step: i32,
    ) -> Step<()> {
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
    pub(super) async fn update_many(
        &mut self,
        conn: &mut PgConnection,
        txn: u32,
        step: i32,
    ) -> Step<()> {
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
    pub(super) fn batch_rejection(&self, rows: Option<&[RowResult]>) -> Option<Error> {
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
