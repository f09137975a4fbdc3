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
//! lease bound from it applies nothing; the handle learns the new timeline from the refusal,
//! and since that statement was the only one the lease ever sent ([`Binding::rebind`]), the
//! lease moves to the new timeline and the statement is sent again: a new lease is never
//! refused for a failover it did not live through, nor let in on the wrong timeline. A lost
//! connection makes the handle look again before its next binding.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

use crate::Result;

/// The PostgreSQL timeline a lease is bound to: none until its first fenced statement, then
/// the timeline that statement was sent for. Clones share it.
///
/// It also counts the statements sent with the binding (every one is counted *before* it is
/// sent), which is what makes [`Binding::rebind`] safe: a binding may move to the database's
/// new timeline only while the one statement ever sent with it is the one the database just
/// refused — then nothing of the lease can have committed on the old timeline. A binding
/// given by the caller ([`Binding::pin`]: the lease ran elsewhere) never moves.
#[derive(Clone, Debug, Default)]
pub(crate) struct Binding(Arc<AtomicU64>);

/// `timeline << 32 | statements sent`; a pinned binding starts with one statement.
fn pack(timeline: i64, sent: u64) -> u64 {
    (u64::try_from(timeline)
        .unwrap_or(0)
        .min(u64::from(u32::MAX))
        << 32)
        | sent.min(0xFFFF_FFFF)
}

fn timeline_of(packed: u64) -> i64 {
    i64::try_from(packed >> 32).unwrap_or(0)
}

impl Binding {
    /// The bound timeline, `None` before the first fenced statement.
    pub(crate) fn get(&self) -> Option<i64> {
        Some(self.presented()).filter(|t| *t > 0)
    }

    /// The value statements present: the timeline, or `0` when not bound.
    pub(crate) fn presented(&self) -> i64 {
        timeline_of(self.0.load(Ordering::Acquire))
    }

    /// Binds to `timeline` unless bound already, and counts one statement about to be sent
    /// with the binding; returns the binding.
    pub(crate) fn bind_and_send(&self, timeline: i64) -> i64 {
        let mut current = self.0.load(Ordering::Acquire);
        loop {
            let next = match timeline_of(current) {
                0 => pack(timeline, 1),
                _ => current.saturating_add(1).min(current | 0xFFFF_FFFF),
            };
            match self
                .0
                .compare_exchange(current, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return timeline_of(next),
                Err(seen) => current = seen,
            }
        }
    }

    /// Binds to `timeline`, given by the caller (a lease that ran in another process), unless
    /// bound already. Such a binding never moves ([`Binding::rebind`]).
    pub(crate) fn pin(&self, timeline: i64) {
        if timeline > 0 {
            // Unbound is 0: nothing is counted before a binding.
            let _ =
                self.0
                    .compare_exchange(0, pack(timeline, 1), Ordering::AcqRel, Ordering::Acquire);
        }
    }

    /// Moves the binding from `from` to `to` when the only statement ever sent with it is
    /// the one the database just refused for being on `to` (so the lease never wrote on
    /// `from`). Returns whether it moved; the caller then sends its statement again.
    pub(crate) fn rebind(&self, from: i64, to: i64) -> bool {
        from > 0
            && to > 0
            && from != to
            && self
                .0
                .compare_exchange(
                    pack(from, 1),
                    pack(to, 0),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok()
    }
}

/// What [`Seen`] holds for a database whose timeline check is off: `pgfence.timeline()` is 0
/// there (its WAL functions are not available, `pgfence.timeline_check`).
const CHECK_OFF: i64 = -1;

/// The timeline a handle (repository, fence, effects) last saw on the database it writes to:
/// what a lease's first statement binds it to. Clones share it.
#[derive(Clone, Debug, Default)]
pub(crate) struct Seen(Arc<AtomicI64>);

impl Seen {
    /// Binds `binding` (if it is not bound yet) to the timeline this handle last saw, asking
    /// the database on `conn` when it has not looked yet, and counts the statement the caller
    /// sends next with it; returns the lease's timeline. Call it once per statement.
    pub(crate) async fn bind(
        &self,
        binding: &Binding,
        conn: &mut sqlx::PgConnection,
    ) -> Result<i64> {
        let seen = match (binding.get(), self.0.load(Ordering::Acquire)) {
            (Some(bound), _) => bound,
            (None, 0) => self.look(conn).await?,
            // This database cannot tell its timeline (`pgfence.timeline_check`): leases stay
            // unbound, and nothing is asked again.
            (None, CHECK_OFF) => 0,
            (None, seen) => seen,
        };
        Ok(binding.bind_and_send(seen))
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
        if now == 0 {
            // The timeline check is off for this database (its WAL functions are not
            // available): remembered, so no statement asks again.
            self.0.store(CHECK_OFF, Ordering::Release);
            return Ok(0);
        }
        let before = self.0.swap(now, Ordering::AcqRel);
        if (before != 0 && before != now) || (before == 0 && unacknowledged) {
            tracing::warn!(
                target: crate::audit::LOG_TARGET,
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

    /// Records the timeline a refusal reported (the database moved on); the first refusal
    /// that shows this handle a new timeline says so at WARN.
    pub(crate) fn saw(&self, timeline: i64) {
        let before = self.0.swap(timeline, Ordering::AcqRel);
        if before != 0 && before != timeline {
            tracing::warn!(
                target: crate::audit::LOG_TARGET,
                timeline,
                previous = before,
                "PostgreSQL failover: the database is on timeline {timeline} (this process \
                 wrote on timeline {before}): leases that wrote before the promotion are \
                 fenced out; acknowledge with `pgfence doctor --ack-failover` once checked"
            );
        }
    }

    /// What a statement of the lease bound by `binding` that ran on timeline `now` means:
    /// fine (same timeline, or not bound); sent again after the binding moved to `now` (the
    /// lease's only statement was this refused one, [`Binding::rebind`]); or refused: the
    /// lease wrote on `lease_timeline` before the database failed over.
    pub(crate) fn verdict(&self, binding: &Binding, now: i64) -> Verdict {
        let bound = binding.presented();
        // `now` 0: the database cannot tell its timeline (the check is off there).
        if bound == 0 || bound == now || now == 0 {
            return Verdict::Fine;
        }
        self.saw(now);
        if binding.rebind(bound, now) {
            Verdict::Again
        } else {
            Verdict::Refused {
                lease_timeline: bound,
                timeline: now,
            }
        }
    }

    /// Forgets the timeline: the next binding asks the database again (after a lost
    /// connection, which is what a failover looks like from here).
    pub(crate) fn forget(&self) {
        self.0.store(0, Ordering::Release);
    }

    /// Forgets the timeline when `err` is a lost connection.
    pub(crate) fn forget_on(&self, err: &crate::Error) {
        if let crate::Error::Backend(b) = err
            && let Some(sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed) =
                b.as_sqlx()
        {
            self.forget();
        }
    }
}

/// See [`Seen::verdict`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// The statement stands as the database decided it.
    Fine,
    /// Nothing was applied, and the lease is now bound to the database's timeline: send the
    /// statement again.
    Again,
    /// The lease is fenced out by a failover.
    Refused {
        /// The lease's timeline.
        lease_timeline: i64,
        /// The database's.
        timeline: i64,
    },
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
        assert_eq!(clone.bind_and_send(3), 3);
        assert_eq!(b.bind_and_send(4), 3, "the first binding stays");
        assert_eq!(b.get(), Some(3));
    }

    #[test]
    fn a_binding_moves_only_while_its_one_statement_is_the_refused_one() {
        // A lease bound from a stale cache: its first statement was refused on timeline 2.
        let fresh = Binding::default();
        fresh.bind_and_send(1);
        assert!(fresh.rebind(1, 2));
        assert_eq!(fresh.get(), Some(2));
        assert_eq!(fresh.bind_and_send(2), 2, "the retry is counted");
        // The retry applied; the lease's next statement meets yet another promotion: it has
        // written on 2, so it is refused.
        fresh.bind_and_send(2);
        assert!(!fresh.rebind(2, 3), "it has written on 2");
        // A second statement was sent with the binding (a clone, concurrently): it may have
        // committed on timeline 1, so the lease stays fenced out.
        let used = Binding::default();
        used.bind_and_send(1);
        used.bind_and_send(1);
        assert!(!used.rebind(1, 2));
        assert_eq!(used.get(), Some(1));
        // A binding the caller gave (the lease ran elsewhere) never moves.
        let pinned = Binding::default();
        pinned.pin(1);
        pinned.bind_and_send(1);
        assert!(!pinned.rebind(1, 2));
        // Pinning a bound lease changes nothing.
        let bound = Binding::default();
        bound.bind_and_send(5);
        bound.pin(6);
        assert_eq!(bound.get(), Some(5));
    }
}
