//! What a write runs on: [`WriteExecutor`], sealed, implemented for `&PgPool` and
//! `&mut PgConnection`, and the connection a write's statements share ([`Lent`]). Used by the
//! repository, the resource check, the effect ledger and `verify`; the module is private, so
//! [`WriteTarget`] cannot be named outside the crate.

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

/// The connection a write's statements run on: one checked out of the pool for the whole
/// write, or the caller's.
pub(crate) enum Lent<'c> {
    Pooled(sqlx::pool::PoolConnection<Postgres>),
    Borrowed(&'c mut sqlx::PgConnection),
}

impl<'c> WriteTarget<'c> {
    pub(crate) async fn lend(self) -> sqlx::Result<Lent<'c>> {
        Ok(match self {
            Self::Pool(pool) => Lent::Pooled(pool.acquire().await?),
            Self::Connection(conn) => Lent::Borrowed(conn),
        })
    }
}

impl Lent<'_> {
    pub(crate) fn conn(&mut self) -> &mut sqlx::PgConnection {
        match self {
            Self::Pooled(conn) => conn,
            Self::Borrowed(conn) => conn,
        }
    }

    /// Whether every statement is a transaction of its own: only for a pooled connection
    /// (only the client knows; the server cannot tell autocommit from a transaction block).
    pub(crate) fn own_transaction(&self) -> bool {
        matches!(self, Self::Pooled(_))
    }
}
