//! The rejection path of a row write: from an explaining statement's row to the typed error
//! (single-row writes) or [`RowOutcome`] (batches), and the rejection's audit record.
//!
//! A write that changed nothing is explained by a second statement (`sql.rs`); its row says
//! which fence the write met (`current`, or for upsert the `tombstone` of a fenced delete),
//! the row's key, the database's `timeline`, and whether the statement wrote the audit row
//! itself (`audit`). Here, in this order: a lease bound before a failover of the database is
//! refused ([`Rejecting::failover`]), or sent again when that statement was its only one;
//! otherwise the met fence is judged against the lease ([`judge`]) — not found, contended
//! (retryable), or a rejection: stale, duplicate token, sealed — and a rejection is logged
//! and audited ([`Rejecting::record`]). The repository turns a rejection into its
//! [`Error`]; a batch into one [`RowOutcome`] per row.

use sqlx::Row;
use sqlx::postgres::PgRow;

use crate::audit::{AuditRow, Auditor, Rejection, RejectionKind};
use crate::repository::executor::Lent;
use crate::repository::outcome::RowOutcome;
use crate::timeline::{Seen, Verdict};
use crate::token::Relation;
use crate::token::layout::StoredFence;
use crate::{Error, Fencing, Result, error::StaleTarget};

/// What a write that changed nothing met, judged against its lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Judgement {
    /// No row (and no tombstone).
    NotFound,
    /// The fence admits the lease, yet the write did not apply: the row was replaced
    /// (deleted and inserted again) while the write ran. Retryable, not audited.
    Contended,
    /// A rejection, audited: the fence met and why it refuses the lease.
    Rejected(StoredFence, Refusal),
}

/// Why a fence refuses a lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// A newer lease wrote or claimed the row; `other_counter` when its token came from
    /// another counter.
    Stale { other_counter: bool },
    /// Another lease presented the same token from the same counter.
    Duplicate,
    /// This lease's fence, sealed since.
    Sealed,
}

/// Judges the fence a write met (`None`: no row) against `fencing`.
pub(crate) fn judge(fencing: &Fencing, met: Option<i64>) -> Judgement {
    let Some(fence) = met else {
        return Judgement::NotFound;
    };
    let refusal = match fencing.classify(fence) {
        Relation::Newer { other_counter } => Refusal::Stale { other_counter },
        Relation::Duplicate => Refusal::Duplicate,
        Relation::Sealed => Refusal::Sealed,
        Relation::Older | Relation::Own => return Judgement::Contended,
    };
    Judgement::Rejected(StoredFence::from_raw(fence), refusal)
}

/// An explaining statement's row, and the error of its own audit insert if that failed (the
/// statement then ran again without it).
pub(crate) struct Explained<'r> {
    pub(crate) row: &'r PgRow,
    pub(crate) audit_error: Option<&'r str>,
}

impl Explained<'_> {
    /// The fence of the row the write met (`None`: no such row).
    pub(crate) fn current(&self) -> Result<Option<i64>> {
        Ok(self.row.try_get::<Option<i64>, _>("current")?)
    }

    /// The fence an upsert met: the row's, or without a row, a fenced delete's tombstone.
    pub(crate) fn current_or_tombstone(&self) -> Result<Option<i64>> {
        match self.current()? {
            Some(fence) => Ok(Some(fence)),
            None => Ok(self.row.try_get::<Option<i64>, _>("tombstone")?),
        }
    }

    /// Whether the row is there and does not meet the write's own condition: the `condition`
    /// column of a conditional write's explaining statement (`false`; NULL is no row). `false`
    /// for every other explaining statement (no such column).
    pub(crate) fn condition_refused(&self) -> Result<bool> {
        match self.row.try_get::<Option<bool>, _>("condition") {
            Ok(holds) => Ok(holds == Some(false)),
            Err(sqlx::Error::ColumnNotFound(_)) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// The row's key, as JSON text.
    pub(crate) fn key(&self) -> String {
        self.row
            .try_get::<Option<String>, _>("row_key")
            .ok()
            .flatten()
            .unwrap_or_default()
    }

    /// Where the rejection's audit row stands after this statement.
    fn audit_row(&self) -> Result<AuditRow> {
        Ok(match self.audit_error {
            Some(e) => AuditRow::Failed(e.to_owned()),
            // `pgfence.record_rejection` ran (and wrote the row) or the column is NULL.
            None if self.row.try_get::<Option<String>, _>("audit")?.is_some() => AuditRow::Written,
            None => AuditRow::Pending,
        })
    }
}

/// One write's rejection context: the lease, the table, the operation, where audit rows go.
pub(crate) struct Rejecting<'a> {
    pub(crate) fencing: &'a Fencing,
    /// The quoted table.
    pub(crate) table: String,
    pub(crate) operation: &'static str,
    pub(crate) auditor: &'a Auditor,
}

impl Rejecting<'_> {
    fn rejection(&self, key: Option<String>, current: Option<i64>) -> Rejection {
        Rejection {
            resource: self
                .fencing
                .resource
                .as_ref()
                .map(|r| r.as_str().to_owned()),
            table: Some(self.table.clone()),
            key,
            presented: self.fencing.token.get(),
            current,
            holder: self.fencing.holder.clone(),
            operation: self.operation,
            other_counter: false,
            reason: None,
            kind: RejectionKind::Stale,
        }
    }

    /// The target of a row's error.
    fn target(&self, key: String, held_by: Option<Box<str>>) -> StaleTarget {
        StaleTarget::Row {
            table: self.table.clone(),
            key,
            resource: self.fencing.resource.as_ref().map(ToString::to_string),
            held_by,
        }
    }

    /// A write statement's error. A token the guard trigger refused for its jump
    /// ([`Error::TokenJump`], the poisoning bound) is audited like a rejection: the
    /// trigger's own audit row would roll back with the statement.
    pub(crate) async fn write_failed(&self, err: Error) -> Error {
        if let Error::TokenJump { current, .. } = &err {
            let mut rejection = self.rejection(None, Some(*current));
            rejection.kind = RejectionKind::TokenJump;
            rejection.reason = RejectionKind::TokenJump.reason();
            self.auditor.record(&rejection, AuditRow::Pending).await;
        }
        err
    }

    /// A write that changed nothing, against the timeline its explaining statement ran on
    /// (`row`, the first explained row of a batch): `Ok(false)` when the lease is on the
    /// database's timeline (or not bound); `Ok(true)` when the lease's only statement was
    /// this one and it now binds to the database's new timeline (send the write again);
    /// [`Error::FencedByFailover`], logged and audited beside the statement, when the lease
    /// wrote before the database failed over.
    pub(crate) async fn failover(
        &self,
        seen: &Seen,
        row: &PgRow,
        lent: &mut Lent<'_>,
    ) -> Result<bool> {
        let now: i64 = row.try_get("timeline")?;
        let (lease_timeline, timeline) = match seen.verdict(&self.fencing.timeline, now) {
            Verdict::Fine => return Ok(false),
            Verdict::Again => return Ok(true),
            Verdict::Refused {
                lease_timeline,
                timeline,
            } => (lease_timeline, timeline),
        };
        let explained = Explained {
            row,
            audit_error: None,
        };
        let current = explained
            .current()?
            .map(|f| StoredFence::from_raw(f).token());
        let mut rejection = self.rejection(Some(explained.key()), current);
        rejection.reason = Some(crate::timeline::failover_reason(lease_timeline, timeline));
        rejection.kind = RejectionKind::Failover;
        self.auditor.record_beside(&rejection, lent).await;
        Err(Error::FencedByFailover {
            target: self.target(explained.key(), None),
            presented: self.fencing.token.get(),
            lease_timeline,
            timeline,
        })
    }

    /// Logs and audits a rejection (not found and contended are not rejections). A row the
    /// explaining statement wrote in the write's own transaction is held on `lent` until that
    /// transaction commits ([`Lent::hold_audit`]).
    pub(crate) async fn record(
        &self,
        out: &Explained<'_>,
        judgement: Judgement,
        lent: &Lent<'_>,
    ) -> Result<()> {
        let Judgement::Rejected(fence, refusal) = judgement else {
            return Ok(());
        };
        let mut rejection = self.rejection(Some(out.key()), Some(fence.token()));
        rejection.other_counter = matches!(
            refusal,
            Refusal::Stale {
                other_counter: true
            }
        );
        rejection.kind = match refusal {
            Refusal::Stale { .. } => RejectionKind::Stale,
            Refusal::Duplicate => RejectionKind::Duplicate,
            Refusal::Sealed => RejectionKind::Sealed,
        };
        rejection.reason = rejection.kind.reason();
        let row = out.audit_row()?;
        if row == AuditRow::Written {
            lent.hold_audit(self.auditor, &rejection);
        }
        self.auditor.record(&rejection, row).await;
        Ok(())
    }

    /// A single-row write's error for `judgement`, after recording it. `held_by` is the
    /// other resource of the lease's fencing domain that holds the row now (see
    /// [`StaleTarget::Row`]), asked for a stale rejection from the same counter only.
    pub(crate) async fn error<F>(
        &self,
        out: &Explained<'_>,
        judgement: Judgement,
        held_by: impl FnOnce(i64) -> F,
        lent: &Lent<'_>,
    ) -> Result<Error>
    where
        F: Future<Output = Option<Box<str>>>,
    {
        let token = self.fencing.token.get();
        let (fence, refusal) = match judgement {
            Judgement::NotFound => {
                return Ok(Error::NotFound {
                    table: self.table.clone(),
                    key: out.key(),
                });
            }
            Judgement::Contended => {
                return Ok(Error::Contended {
                    table: self.table.clone(),
                    operation: self.operation,
                });
            }
            Judgement::Rejected(fence, refusal) => (fence, refusal),
        };
        let held_by = match refusal {
            Refusal::Stale {
                other_counter: false,
            } => held_by(fence.token()).await,
            _ => None,
        };
        let target = self.target(out.key(), held_by);
        let err = match refusal {
            Refusal::Stale { other_counter } => Error::StaleToken {
                target,
                presented: token,
                current: fence.token(),
                other_counter,
            },
            Refusal::Duplicate => Error::DuplicateToken { target, token },
            Refusal::Sealed => Error::RowSealed { target, token },
        };
        self.record(out, judgement, lent).await?;
        Ok(err)
    }

    /// A conditional write whose fence admitted the lease and whose own `condition` did not
    /// hold ([`Explained::condition_refused`]): not a rejection of the lease, so neither
    /// logged at WARN nor audited.
    pub(crate) fn condition_failed(
        &self,
        out: &Explained<'_>,
        condition: &crate::repository::Condition,
    ) -> Error {
        Error::ConditionFailed {
            table: self.table.clone(),
            key: out.key(),
            operation: self.operation,
            condition: condition.to_string(),
        }
    }

    /// A batch row's outcome for `judgement`, after recording it.
    pub(crate) async fn outcome(
        &self,
        out: &Explained<'_>,
        judgement: Judgement,
        lent: &Lent<'_>,
    ) -> Result<RowOutcome> {
        let outcome = match judgement {
            Judgement::NotFound => RowOutcome::NotFound,
            Judgement::Contended => RowOutcome::Contended,
            Judgement::Rejected(fence, Refusal::Stale { other_counter }) => RowOutcome::Stale {
                current: fence.token(),
                other_counter,
            },
            Judgement::Rejected(_, Refusal::Duplicate) => RowOutcome::DuplicateToken,
            Judgement::Rejected(_, Refusal::Sealed) => RowOutcome::Sealed,
        };
        self.record(out, judgement, lent).await?;
        Ok(outcome)
    }
}

/// The message of an error raised inside `pgfence.record_rejection` (an explaining
/// statement's own audit insert), which the caller answers by explaining again without it.
pub(crate) fn audit_failure(e: &sqlx::Error) -> Option<String> {
    let sqlx::Error::Database(db) = e else {
        return None;
    };
    let pg = db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>()?;
    pg.r#where()
        .filter(|w| w.contains("pgfence.record_rejection"))
        .map(|_| pg.message().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{FenceToken, Resource};

    #[test]
    fn judgements() {
        let me = Fencing::new(FenceToken::new(5).unwrap()).holder("a");
        let mine = me.lease_fence();
        let twin = Fencing::new(FenceToken::new(5).unwrap()).holder("b");
        let newer = Fencing::new(FenceToken::new(6).unwrap()).lease_fence();
        assert_eq!(judge(&me, None), Judgement::NotFound);
        assert_eq!(judge(&me, Some(0)), Judgement::Contended);
        assert_eq!(judge(&me, Some(mine + 7)), Judgement::Contended);
        assert_eq!(
            judge(&me, Some(newer)),
            Judgement::Rejected(
                StoredFence::from_raw(newer),
                Refusal::Stale {
                    other_counter: false
                }
            )
        );
        assert!(matches!(
            judge(&me, Some(twin.lease_fence())),
            Judgement::Rejected(_, Refusal::Duplicate)
        ));
        assert!(matches!(
            judge(&me, Some(StoredFence::from_raw(mine).sealed().get())),
            Judgement::Rejected(_, Refusal::Sealed)
        ));
        let other = Fencing::new(FenceToken::new(9).unwrap())
            .resource(Resource::new("reports:daily").unwrap())
            .lease_fence();
        let billing = Fencing::new(FenceToken::new(1).unwrap())
            .resource(Resource::in_domain("billing", "account:2").unwrap());
        assert!(matches!(
            judge(&billing, Some(other)),
            Judgement::Rejected(
                _,
                Refusal::Stale {
                    other_counter: true
                }
            )
        ));
    }
}
