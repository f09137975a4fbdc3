//! [`Fence`], the transaction-scope check, for work that is not one row (a batch of ledger
//! inserts, a multi-table update): claim the resource for the lease inside the caller's
//! transaction, or fail with [`Error::StaleToken`].

use sqlx::PgPool;

use crate::audit::{AuditRow, Auditor, Rejection, RejectionKind};
use crate::timeline::Verdict;
use crate::{Error, Fencing, Resource, Result, WriteExecutor, error::StaleTarget};

/// A handle on a database with pgfence's schema: the transaction-scope check and high-water
/// marks, audited through one [`Auditor`].
#[derive(Clone, Debug)]
pub struct Fence {
    handle: crate::repository::executor::Handle,
}

impl Fence {
    /// A handle that audits through `pool`.
    #[must_use]
    pub fn new(pool: PgPool) -> Self {
        Self::with_auditor(Auditor::new(pool))
    }

    /// A handle with a custom [`Auditor`] (for example a shorter audit timeout).
    #[must_use]
    pub fn with_auditor(auditor: Auditor) -> Self {
        Self {
            handle: crate::repository::executor::Handle::new(auditor),
        }
    }

    /// Bounds every [`Fence::check`] by `bound` instead of 30 s
    /// ([`DEFAULT_CALL_TIMEOUT`](crate::repository::DEFAULT_CALL_TIMEOUT)), as
    /// [`Repository::with_call_timeout`](crate::Repository::with_call_timeout) does for writes:
    /// [`Error::TimedOut`] when the check is not done by then.
    ///
    /// # Errors
    /// [`InvalidInput::Duration`](crate::error::InvalidInput::Duration) when `bound` is under 10 ms or over a day.
    pub fn with_call_timeout(mut self, bound: std::time::Duration) -> Result<Self> {
        self.handle = self.handle.with_call_timeout(bound)?;
        Ok(self)
    }

    /// The pool audit rows go through.
    #[must_use]
    pub fn pool(&self) -> &PgPool {
        self.handle.auditor.pool()
    }

    /// The audit configuration, to share with repositories
    /// ([`Repository::with_auditor`](crate::Repository::with_auditor)).
    #[must_use]
    pub fn auditor(&self) -> &Auditor {
        &self.handle.auditor
    }

    /// Claims `resource` for the lease inside `exec`'s transaction: raises its high-water
    /// mark to the lease, or accepts the lease that already holds the mark.
    ///
    /// Call it first in each transaction that does the fenced work; one lease may check the
    /// same resource in any number of transactions. The row lock it takes is held until that
    /// transaction ends, so holders of one resource are serialised: once a newer lease has
    /// checked, an older one fails here (and one that checked earlier has already committed
    /// or rolled back). Outside an explicit transaction the check protects nothing beyond
    /// itself.
    ///
    /// A lease of an issuer with a key prefix other than the default checks `resource` under
    /// that prefix's name ([`Resource::in_key_prefix`]; the prefix is the one of the
    /// [`Fencing`]'s resource, [`Lease::fencing_resource`](crate::Lease::fencing_resource)),
    /// so leases of two prefixes never meet at a mark; audit rows carry that name. `resource`
    /// may also be given as that name.
    ///
    /// # Errors
    /// [`Error::StaleToken`] (logged and audited) when a newer lease has checked;
    /// [`Error::DuplicateToken`] (audited) when another lease checked with the same token;
    /// [`Error::TokenJump`] (audited) for a token absurdly far above the resource's mark.
    /// The transaction is then aborted: roll it back. [`InvalidInput::Resource`](crate::error::InvalidInput::Resource) when
    /// `resource` is another key prefix's name, or too long under the lease's.
    ///
    /// # Example
    /// ```no_run
    /// # async fn f(pool: sqlx::PgPool, token: pgfence::FenceToken) -> pgfence::Result<()> {
    /// let fence = pgfence::Fence::new(pool.clone());
    /// let batch = pgfence::Resource::new("payments:batch:42")?;
    /// let mut tx = pool.begin().await?;
    /// fence.check(&mut *tx, &batch, token).await?;
    /// sqlx::query("INSERT INTO ledger (batch, amount) VALUES (42, 100)").execute(&mut *tx).await?;
    /// tx.commit().await?;
    /// # Ok(()) }
    /// ```
    pub async fn check<'c, E: WriteExecutor<'c>>(
        &self,
        exec: E,
        resource: &Resource,
        fencing: impl Into<Fencing>,
    ) -> Result<()> {
        let fencing = fencing.into();
        let named = fenced_name(resource, &fencing)?;
        let resource = named.as_ref().unwrap_or(resource);
        let fencing = &fencing;
        let checked = crate::repository::executor::bounded(
            self.handle.call_timeout,
            "check",
            || resource.as_str().to_owned(),
            exec.into_target(),
            |mut lent| async move {
                let result = async {
                    loop {
                        let timeline = self
                            .handle
                            .seen
                            .bind(&fencing.timeline, lent.conn())
                            .await?;
                        // In the caller's transaction the check also bounds how long that
                        // transaction may then sit idle (`Fencing::idle_bound`), in the same
                        // statement; its own transaction has its call bound already.
                        let bound = fencing.idle_bound.filter(|_| !lent.own_transaction());
                        let query = sqlx::query_scalar(match bound {
                            Some(_) => CHECK_BOUNDED,
                            None => CHECK,
                        })
                        .bind(resource.as_str())
                        .bind(fencing.token.get())
                        .bind(i32::from(fencing.tag()))
                        .bind(timeline);
                        let query = match bound {
                            Some(bound) => query.bind(idle_ms(bound)),
                            None => query,
                        };
                        let outcome: sqlx::Result<i64> = query.fetch_one(lent.conn()).await;
                        let now = match outcome.map_err(Error::from) {
                            Ok(now) => now,
                            Err(e) => {
                                self.handle.seen.forget_on(&e);
                                return Err(e);
                            }
                        };
                        match self.handle.seen.verdict(&fencing.timeline, now) {
                            Verdict::Fine => return Ok(()),
                            Verdict::Again => {}
                            Verdict::Refused {
                                lease_timeline,
                                timeline,
                            } => {
                                let reason =
                                    crate::timeline::failover_reason(lease_timeline, timeline);
                                let rejection = check_rejection(
                                    resource,
                                    fencing,
                                    None,
                                    false,
                                    RejectionKind::Failover,
                                    Some(reason),
                                );
                                self.handle
                                    .auditor
                                    .record_beside(&rejection, &mut lent)
                                    .await;
                                return Err(Error::FencedByFailover {
                                    target: StaleTarget::Resource(resource.as_str().to_owned()),
                                    presented: fencing.token.get(),
                                    lease_timeline,
                                    timeline,
                                });
                            }
                        }
                    }
                }
                .await;
                (lent, result)
            },
        )
        .await;
        // The write's connection has gone back before the audit row takes one.
        match checked {
            Ok(()) => Ok(()),
            Err(err) => Err(self.audit_refused(resource, fencing, err).await),
        }
    }

    /// Audits a check the database refused (stale, duplicate, token jump) and gives the error
    /// back; any other error is given back as is.
    async fn audit_refused(&self, resource: &Resource, fencing: &Fencing, err: Error) -> Error {
        let (current, other_counter) = match &err {
            Error::StaleToken {
                current,
                other_counter,
                ..
            } => (*current, *other_counter),
            Error::DuplicateToken { token, .. } => (*token, false),
            Error::TokenJump { current, .. } => (*current, false),
            _ => return err,
        };
        let kind = RejectionKind::of(&err).unwrap_or(RejectionKind::Stale);
        let rejection = check_rejection(
            resource,
            fencing,
            Some(current),
            other_counter,
            kind,
            kind.reason(),
        );
        self.handle
            .auditor
            .record(&rejection, AuditRow::Pending)
            .await;
        err
    }

    /// The token of the newest lease that checked `resource` (0 when none).
    ///
    /// # Errors
    /// [`Error::Backend`](crate::Error::Backend).
    pub async fn high_water(&self, resource: &Resource) -> Result<i64> {
        crate::admin::high_water(self.pool(), resource).await
    }
}

/// The check.
const CHECK: &str = "SELECT pgfence.check_on($1, $2, $3, $4)";

/// The check in a caller's transaction with an idle bound: it also sets the transaction's
/// `idle_in_transaction_session_timeout` (`set_config(..., true)`: this transaction only), so a
/// paused holder's locks are released by the server ([`Fencing::idle_bound`]).
const CHECK_BOUNDED: &str = "SELECT pgfence.check_on($1, $2, $3, $4), \
     pg_catalog.set_config('idle_in_transaction_session_timeout', $5, true)";

/// A bound as `idle_in_transaction_session_timeout` takes it: whole milliseconds, at least 1
/// (0 would switch the timeout off), at most `i32::MAX`.
pub(crate) fn idle_ms(bound: std::time::Duration) -> String {
    bound.as_millis().clamp(1, i32::MAX as u128).to_string()
}

/// The name `fencing`'s lease checks `resource` under: its key prefix's name when the lease's
/// resource has one (`None`: `resource` as it is).
fn fenced_name(resource: &Resource, fencing: &Fencing) -> Result<Option<Resource>> {
    match fencing.resource.as_ref().and_then(Resource::key_prefix) {
        Some(prefix) => resource.in_key_prefix(prefix).map(Some),
        None => Ok(None),
    }
}

/// The audit record of a refused [`Fence::check`].
fn check_rejection(
    resource: &Resource,
    fencing: &Fencing,
    current: Option<i64>,
    other_counter: bool,
    kind: RejectionKind,
    reason: Option<String>,
) -> Rejection {
    Rejection {
        resource: Some(resource.as_str().to_owned()),
        table: None,
        key: None,
        presented: fencing.token.get(),
        current,
        holder: fencing.holder.clone(),
        operation: "check",
        other_counter,
        reason,
        kind,
    }
}
