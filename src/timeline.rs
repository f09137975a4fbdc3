//! Fencing across a failover of the protected database.
//!
//! A PostgreSQL promotion with asynchronous replication can lose commits the old primary had
//! acknowledged: rows and high-water marks go back to what the standby had replayed, and a
//! lease that a newer lease had fenced out meets its own fence again. Every promotion starts
//! a new **timeline**, so each lease is bound to the timeline its first fenced statement runs
//! on ([`Binding`], shared by every clone of the [`Lease`](crate::Lease) and of the
//! [`Fencing`](crate::Fencing) made from it), and every fenced statement presents it: the
//! database refuses a lease bound to another timeline
//! ([`Error::FencedByFailover`](crate::Error::FencedByFailover)), whatever its rows say.
//!
//! The binding is made *before* the lease's first statement is sent, from the timeline the
//! handle (repository, fence, effects) last saw ([`Seen`]), so a statement that committed
//! always ran on the timeline its lease is bound to. When that cached timeline is out of
//! date (the database failed over since the handle last looked), the first statement of a
//! lease bound from it is refused too, and the handle learns the new timeline from the
//! refusal: a new lease is refused at most once per handle and failover, never let in on the
//! wrong timeline. A lost connection makes the handle look again before its next binding.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use crate::Result;

/// The PostgreSQL timeline a lease is bound to: `0` until its first fenced statement, then
/// the timeline that statement ran on. Clones share it.
#[derive(Clone, Debug, Default)]
pub(crate) struct Binding(Arc<AtomicI64>);

impl Binding {
    /// The bound timeline, `None` before the first fenced statement.
    pub(crate) fn get(&self) -> Option<i64> {
        Some(self.0.load(Ordering::Acquire)).filter(|t| *t > 0)
    }

    /// The value statements present: the timeline, or `0` when not bound.
    pub(crate) fn presented(&self) -> i64 {
        self.0.load(Ordering::Acquire)
    }

    /// Binds to `timeline` unless bound already; returns the binding.
    pub(crate) fn bind(&self, timeline: i64) -> i64 {
        match self
            .0
            .compare_exchange(0, timeline, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => timeline,
            Err(bound) => bound,
        }
    }
}

/// The timeline a handle (repository, fence, effects) last saw on the database it writes to:
/// what a lease's first statement binds it to. Clones share it.
#[derive(Clone, Debug, Default)]
pub(crate) struct Seen(Arc<AtomicI64>);

impl Seen {
    /// Binds `binding` (if it is not bound yet) to the timeline this handle last saw, asking
    /// the database on `conn` when it has not looked yet; returns the lease's timeline.
    pub(crate) async fn bind(
        &self,
        binding: &Binding,
        conn: &mut sqlx::PgConnection,
    ) -> Result<i64> {
        if let Some(bound) = binding.get() {
            return Ok(bound);
        }
        let seen = match self.0.load(Ordering::Acquire) {
            0 => self.look(conn).await?,
            seen => seen,
        };
        Ok(binding.bind(seen))
    }

    /// Asks the database for its timeline (`pgfence.note_timeline()`, which records it) and
    /// remembers it. Logs a WARN event the first time this handle sees a new timeline, or an
    /// unacknowledged one.
    pub(crate) async fn look(&self, conn: &mut sqlx::PgConnection) -> Result<i64> {
        // A role that was not granted pgfence's functions (`pgfence grant`) still reads the
        // timeline, which every role may; it records nothing. (Asked first: a refused call
        // would abort the caller's transaction.)
        let (may_note, now): (bool, i64) = sqlx::query_as(
            "SELECT pg_catalog.has_function_privilege('pgfence.note_timeline()', 'EXECUTE'), \
             pgfence.timeline()",
        )
        .fetch_one(&mut *conn)
        .await?;
        let (now, previous, unacknowledged) = if may_note {
            sqlx::query_as(
                "SELECT current_timeline, previous_timeline, unacknowledged \
                 FROM pgfence.note_timeline()",
            )
            .fetch_one(&mut *conn)
            .await?
        } else {
            (now, None, false)
        };
        let before = self.0.swap(now, Ordering::AcqRel);
        if (before != 0 && before != now) || (before == 0 && unacknowledged) {
            tracing::warn!(
                target: crate::LOG_TARGET,
                timeline = now,
                previous = previous.unwrap_or(before),
                unacknowledged,
                "PostgreSQL failover: the database is on timeline {now} (pgfence saw {}): \
                 leases that wrote before the promotion are fenced out; acknowledge with \
                 `pgfence doctor --ack-failover` once checked",
                previous.unwrap_or(before)
            );
        }
        Ok(now)
    }

    /// Records the timeline a refusal reported (the database moved on).
    pub(crate) fn saw(&self, timeline: i64) {
        self.0.store(timeline, Ordering::Release);
    }

    /// Forgets the timeline: the next binding asks the database again (after a lost
    /// connection, which is what a failover looks like from here).
    pub(crate) fn forget(&self) {
        self.0.store(0, Ordering::Release);
    }

    /// Forgets the timeline when `err` is a lost connection.
    pub(crate) fn forget_on(&self, err: &crate::Error) {
        if let crate::Error::Database(
            sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed,
        ) = err
        {
            self.forget();
        }
    }
}

/// The audit row's `reason` for a failover refusal (the SQL functions write the same text).
pub(crate) fn failover_reason(lease_timeline: i64, timeline: i64) -> String {
    format!("failover: lease timeline {lease_timeline}, database timeline {timeline}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_binding_is_made_once_and_shared_by_clones() {
        let b = Binding::default();
        assert_eq!(b.get(), None);
        assert_eq!(b.presented(), 0);
        let clone = b.clone();
        assert_eq!(clone.bind(3), 3);
        assert_eq!(b.bind(4), 3, "the first binding stays");
        assert_eq!(b.get(), Some(3));
    }
}
