//! What a lease last saw on the rows it wrote: the expected fence of its next write to each
//! ([`RowLog`]). A lease's writes are ordered by the row itself (compare-and-set on the
//! fence): a write applies over an older lease's fence, or over exactly the fence this lease
//! last saw there. A statement of the lease that reaches the server after a later write of
//! the same lease to the row finds another fence and changes nothing.

use std::collections::HashMap;

use crate::token::Relation;
use crate::token::layout::StoredFence;
use std::sync::{Arc, Mutex};

/// The fence a write of the lease whose lease fence is `lease` leaves over `expected` (what
/// its statement stores): the lease fence over anything but the lease's own fence, the next
/// step of its sequence over that.
pub(crate) fn after(lease: StoredFence, expected: i64) -> i64 {
    let met = StoredFence::from_raw(expected);
    match met.relation_to(lease) {
        Relation::Own => met.next().map_or(expected, StoredFence::get),
        _ => lease.get(),
    }
}

/// Rows a lease remembers at most; past it the oldest half is forgotten (a forgotten row
/// costs its next write one explaining round trip, nothing else).
pub(crate) const MAX_ROWS: usize = 65_536;

/// A row of one table: the table's and the key's hashes.
pub(crate) type RowId = (u64, u64);

/// What the lease knows of one row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Seen {
    /// The fence the lease's next write expects (0: none of its own).
    pub(crate) expected: i64,
    /// The fence a write whose answer was lost would have left, when one was lost.
    pub(crate) in_doubt: Option<i64>,
    /// Insertion order, for forgetting the oldest.
    age: u64,
}

/// Shared by a lease, its clones and every `Fencing` made from it.
#[derive(Clone, Debug, Default)]
pub(crate) struct RowLog(Arc<Mutex<Log>>);

#[derive(Debug, Default)]
struct Log {
    rows: HashMap<RowId, Seen>,
    clock: u64,
}

impl RowLog {
    fn log(&self) -> std::sync::MutexGuard<'_, Log> {
        // Nothing panics while holding it; a poisoned map is still the map.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// What the lease knows of `row`.
    pub(crate) fn get(&self, row: RowId) -> Option<Seen> {
        self.log().rows.get(&row).copied()
    }

    /// The row's fence is now `fence` (a write applied, or the row was read).
    pub(crate) fn saw(&self, row: RowId, fence: i64) {
        self.put(row, fence, None);
    }

    /// A write expecting `expected` lost its answer; had it applied, it left `after`.
    pub(crate) fn lost(&self, row: RowId, expected: i64, after: i64) {
        self.put(row, expected, Some(after));
    }

    /// The row is gone or no longer the lease's.
    pub(crate) fn forget(&self, row: RowId) {
        self.log().rows.remove(&row);
    }

    fn put(&self, row: RowId, expected: i64, in_doubt: Option<i64>) {
        let mut log = self.log();
        log.clock += 1;
        let age = log.clock;
        if log.rows.len() >= MAX_ROWS && !log.rows.contains_key(&row) {
            let cut = age.saturating_sub(u64::try_from(MAX_ROWS / 2).unwrap_or(u64::MAX));
            log.rows.retain(|_, s| s.age > cut);
        }
        log.rows.insert(
            row,
            Seen {
                expected,
                in_doubt,
                age,
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{FenceToken, Fencing};

    #[test]
    fn a_write_leaves_the_lease_fence_over_others_and_the_next_step_over_its_own() {
        let me = Fencing::new(FenceToken::new(9).unwrap())
            .holder("a")
            .stored();
        let older = Fencing::new(FenceToken::new(8).unwrap()).stored().get();
        assert_eq!(after(me, 0), me.get());
        assert_eq!(after(me, older), me.get());
        let first = me.get();
        let second = after(me, first);
        assert_eq!(Some(StoredFence::from_raw(second)), me.next());
        assert_eq!(
            Some(StoredFence::from_raw(after(me, second))),
            StoredFence::from_raw(second).next()
        );
    }

    #[test]
    fn the_log_keeps_what_it_saw_and_forgets_the_oldest_half_when_full() {
        let log = RowLog::default();
        log.saw((1, 1), 10);
        log.lost((1, 2), 20, 21);
        assert_eq!(
            log.get((1, 1)).map(|s| (s.expected, s.in_doubt)),
            Some((10, None))
        );
        assert_eq!(
            log.get((1, 2)).map(|s| (s.expected, s.in_doubt)),
            Some((20, Some(21)))
        );
        log.forget((1, 2));
        assert_eq!(log.get((1, 2)), None);
        for k in 0..u64::try_from(MAX_ROWS - 1).unwrap() {
            log.saw((2, k), 1);
        }
        // Full: the next new row forgets the oldest half (row (1, 1) among them).
        assert!(log.get((1, 1)).is_some());
        log.saw((3, 0), 5);
        assert_eq!(log.get((3, 0)).map(|s| s.expected), Some(5));
        assert!(log.get((1, 1)).is_none(), "the oldest row is forgotten");
        assert!(log.log().rows.len() <= MAX_ROWS);
    }
}
