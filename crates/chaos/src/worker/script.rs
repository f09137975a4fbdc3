//! The multi-statement modes (`fenced-multi`, `row-claim`, and the leaseless mode's leases;
//! batch units use it too): a unit's [`Script`] of statements in transactions, and running it.

use rand::Rng;
use rand::rngs::StdRng;
use sqlx::PgConnection;

use std::sync::atomic::Ordering;

use pgfence::Error;

use crate::Stage;
use crate::schema::{ClaimCell, CoalescedCell, Kind};

use super::pause::stall;
use super::{Failure, Step, Try, at, db_at};

/// Whether `error` is fencing refusing the write (nothing written): stale, duplicate, sealed,
/// or fenced by a database failover.
fn is_rejection(error: &Error) -> bool {
    matches!(
        error,
        Error::StaleToken { .. }
            | Error::DuplicateToken { .. }
            | Error::RowSealed { .. }
            | Error::FencedByFailover { .. }
    )
}

/// The multi-statement modes' unit shapes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ScriptKind {
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
pub(super) enum Op {
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
pub(super) struct Script {
    txns: Vec<Vec<Op>>,
}

impl Script {
    /// Draws a unit's script. With `coalesce` ([`Config::coalesce`](crate::Config::coalesce)),
    /// half of the row-claim scripts commit the claim on its own and give each update a
    /// transaction of its own (which goes through the coalescer); the others are drawn as
    /// without it.
    pub(super) fn draw(kind: ScriptKind, rng: &mut StdRng, coalesce: bool) -> Self {
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
                if coalesce && rng.random_bool(0.5) {
                    return Script {
                        txns: ops.into_iter().map(|op| vec![op]).collect(),
                    };
                }
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
    pub(super) fn len(&self) -> usize {
        self.txns.iter().map(Vec::len).sum()
    }

    /// Transactions.
    pub(super) fn txn_count(&self) -> u32 {
        u32::try_from(self.txns.len()).unwrap_or(u32::MAX)
    }
}

impl Try<'_> {
    /// Runs a multi-statement unit's script from transaction `first_txn` on: each transaction
    /// begins (after a stall placed before its first statement), runs its statements (a stall
    /// may fall between two of them) and commits.
    pub(super) async fn run_script(&mut self, script: &Script) -> Step<()> {
        let mut n = 0usize;
        for (txn, ops) in script.txns.iter().enumerate() {
            let first = n;
            n += ops.len();
            let txn = u32::try_from(txn).unwrap_or(u32::MAX);
            if txn < self.first_txn {
                continue;
            }
            stall(self.pause.before_op(first)).await;
            if let ([Op::Update(k)], Some(coalescer)) =
                (ops.as_slice(), self.ctx.coalescer_of(self.worker))
            {
                self.coalesced_update(coalescer, *k, txn, first).await?;
                self.commits += 1;
                continue;
            }
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

    /// [`Op::Update`] `k` alone in transaction `txn` of the unit, through the coalescer: the
    /// write and its history row (the `w_*` columns, inserted by the table's trigger) commit
    /// in the coalesced statement, shared with other units' writes. A rejection comes back as
    /// from [`Repository::update`](pgfence::Repository::update) (nothing written); any other
    /// error is recorded at [`Stage::Commit`]: the statement was its own commit, so whether it
    /// committed is read back from the history, as for a failed `COMMIT`.
    async fn coalesced_update(
        &mut self,
        coalescer: &pgfence::repository::Coalescer<CoalescedCell>,
        k: i32,
        txn: u32,
        n: usize,
    ) -> Step<()> {
        let read = self.believed;
        let (value, kind) = if self.applied {
            (read, Kind::Rewrite)
        } else {
            (read + 1, Kind::Increment)
        };
        let cell = CoalescedCell {
            run: self.ctx.run.clone(),
            id: self.row,
            value,
            step: k,
            last_unit: self.unit_id(),
            w_nonce: self.ctx.nonce.fetch_add(1, Ordering::Relaxed) + 1,
            w_token: self.lease.token().get(),
            w_read: read,
            w_try: i32::try_from(self.try_no).unwrap_or(i32::MAX),
            w_worker: i32::try_from(self.worker).unwrap_or(i32::MAX),
            w_txn: i32::try_from(txn).unwrap_or(i32::MAX),
            w_step: i32::try_from(n).unwrap_or(i32::MAX),
            w_kind: kind.as_str().to_owned(),
        };
        coalescer.update(self.lease, &cell).await.map_err(|error| {
            let stage = if is_rejection(&error) {
                Stage::Write
            } else {
                Stage::Commit
            };
            Failure::Fence { stage, error }
        })?;
        self.written = Some(value);
        self.believed = value;
        self.applied = true;
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
}
