//! The transaction-scope check, for work that is not one row (a batch of ledger inserts, a
//! multi-table update): raise the resource's high-water mark inside the caller's transaction,
//! or fail with [`Error::StaleToken`].

use sqlx::{PgExecutor, PgPool};

use crate::audit::{AuditRow, Auditor, Rejection};
use crate::repository::{FencedTable, Fencing, Repository};
use crate::{Error, Resource, Result};

/// A handle on a database with pgfence's schema: the transaction-scope check, high-water
/// marks, and a factory for [`Repository`]s sharing one audit configuration.
#[derive(Clone, Debug)]
pub struct Fence {
    auditor: Auditor,
}

impl Fence {
    /// A handle that audits through `pool`.
    #[must_use]
    pub fn new(pool: PgPool) -> Self {
        Self {
            auditor: Auditor::new(pool),
        }
    }

    /// A handle with a custom [`Auditor`] (for example a shorter audit timeout).
    #[must_use]
    pub fn with_auditor(auditor: Auditor) -> Self {
        Self { auditor }
    }

    /// The pool audit rows go through.
    #[must_use]
    pub fn pool(&self) -> &PgPool {
        self.auditor.pool()
    }

    /// A repository for `T` sharing this handle's audit configuration.
    ///
    /// # Errors
    /// As [`Repository::new`].
    pub fn repository<T: FencedTable>(&self) -> Result<Repository<T>> {
        Repository::with_auditor(self.auditor.clone())
    }

    /// Raises `resource`'s high-water mark to the token, inside `exec`'s transaction.
    ///
    /// Call it first in the transaction that does the fenced work. The row lock it takes is
    /// held until that transaction ends, so holders of one resource are serialised: once a
    /// newer token has checked, an older one fails here (and one that checked earlier has
    /// already committed or rolled back). Outside an explicit transaction the check protects
    /// nothing beyond itself.
    ///
    /// # Errors
    /// [`Error::StaleToken`] (logged and audited) when the token is not newer than the mark.
    /// The transaction is then aborted: roll it back.
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
    pub async fn check<'c, E: PgExecutor<'c>>(
        &self,
        exec: E,
        resource: &Resource,
        fencing: impl Into<Fencing>,
    ) -> Result<()> {
        let fencing = fencing.into();
        let outcome = sqlx::query!(
            "SELECT pgfence.check($1, $2)",
            resource.as_str(),
            fencing.token.get()
        )
        .fetch_one(exec)
        .await;
        match outcome.map_err(Error::from) {
            Ok(_) => Ok(()),
            Err(Error::StaleToken {
                target,
                presented,
                current,
            }) => {
                let rejection = Rejection {
                    resource: Some(resource.as_str().to_owned()),
                    table: None,
                    key: None,
                    presented,
                    current: Some(current),
                    holder: fencing.holder.clone(),
                    operation: "check",
                };
                self.auditor.record(&rejection, AuditRow::Pending).await;
                Err(Error::StaleToken {
                    target,
                    presented,
                    current,
                })
            }
            Err(e) => Err(e),
        }
    }

    /// The highest token `resource` has checked with (0 when none).
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn high_water(&self, resource: &Resource) -> Result<i64> {
        high_water(self.pool(), resource).await
    }
}

/// The highest token `resource` has checked with (0 when none).
///
/// # Errors
/// [`Error::Database`].
pub async fn high_water<'c, E: PgExecutor<'c>>(exec: E, resource: &Resource) -> Result<i64> {
    let mark = sqlx::query_scalar!(
        r#"SELECT pgfence.high_water($1) AS "mark!""#,
        resource.as_str()
    )
    .fetch_one(exec)
    .await?;
    Ok(mark)
}
