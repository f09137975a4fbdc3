//! Per-row checks, every mode: token order in commit order, all-or-nothing (version gaps),
//! lost updates (split by kind: a lease's or a lease-less write's) and stale reads.

use std::collections::{BTreeMap, HashSet};

use crate::schema::Kind;
use crate::util::count;
use crate::{LeaselessKind, Mode};

use super::{Committed, FinalRow};

/// Per-row verdicts.
#[derive(Default)]
pub(super) struct RowChecks {
    /// Accepted lease writes whose token was older than the previous lease write's, or the
    /// same from another lease (lease-less writes have no token to order).
    pub(super) token_order: u64,
    /// Lease writes right after a bypass by the lease that wrote the row before it: the seal
    /// must have stopped them.
    pub(super) sealed_writes: u64,
    /// Version gaps, and row versions without their history row.
    pub(super) torn: u64,
    /// Committed increments (the leases' and the lease-less writes') minus final value, summed.
    pub(super) lost: u64,
    /// Of those, lease-less increments (bypasses): committed, but not in the final value.
    pub(super) lost_leaseless: u64,
    /// Recorded statements that did not read the previous one's value, or changed it by other
    /// than their kind says (one for an increment, nothing for a claim or a rewrite).
    pub(super) stale_reads: u64,
    /// Committed increments of the leases.
    pub(super) increments: u64,
    /// Units with at least one committed increment.
    pub(super) units_incremented: u64,
    /// Committed increments beyond a unit's first (per transaction in fenced-multi, per row in
    /// batch mode): a retry after a lost commit acknowledgement that did not know its increment
    /// had landed.
    pub(super) repeated_increments: u64,
}

pub(super) fn check_rows(
    committed: &BTreeMap<i32, Vec<Committed>>,
    rows: &[FinalRow],
    mode: Mode,
) -> RowChecks {
    let mut c = RowChecks::default();
    let mut units: HashSet<u64> = HashSet::new();
    // Where a unit means to increment: once per transaction in fenced-multi, once per row in
    // batch mode, once otherwise.
    let mut slots: HashSet<(u64, i64)> = HashSet::new();
    for row in rows {
        let writes = committed
            .get(&row.id)
            .map(Vec::as_slice)
            .unwrap_or_default();
        let n = i64::try_from(writes.len()).unwrap_or(i64::MAX);
        let mut increments = 0i64;
        // Version gaps or a row version without its history row: not all-or-nothing.
        c.torn += u64::try_from((row.version - n).abs()).unwrap_or(u64::MAX);
        let mut prev_lease: Option<&Committed> = None;
        let mut bypassed = false;
        let mut prev_value = 0i64;
        for (i, w) in writes.iter().enumerate() {
            if w.version != i64::try_from(i).unwrap_or(i64::MAX) + 1 {
                c.torn += 1;
            }
            let delta = Kind::delta(&w.kind);
            if w.value_read != prev_value || w.value_written != w.value_read + delta {
                c.stale_reads += 1;
            }
            increments += delta;
            prev_value = w.value_written;
            if w.is_leaseless() {
                bypassed |= w.kind == LeaselessKind::Bypass.as_str();
                continue;
            }
            if let Some(p) = prev_lease {
                if out_of_order(p, w) {
                    c.token_order += 1;
                } else if bypassed && w.token == p.token {
                    c.sealed_writes += 1;
                }
            }
            if delta > 0 {
                c.increments += 1;
                if units.insert(w.unit) {
                    c.units_incremented += 1;
                }
                let slot = match mode {
                    Mode::FencedMulti => i64::from(w.txn),
                    Mode::Batch => i64::from(row.id),
                    _ => 0,
                };
                if !slots.insert((w.unit, slot)) {
                    c.repeated_increments += 1;
                }
            }
            prev_lease = Some(w);
            bypassed = false;
        }
        let lost = u64::try_from(increments - row.value).unwrap_or(0);
        c.lost += lost;
        c.lost_leaseless += lost_leaseless(writes).min(lost);
    }
    c
}

/// The lease-less increments of a row (in commit order) that its final value does not hold.
///
/// Each committed statement builds on a state of the row: a lease-less write (one `UPDATE
/// ... SET value = value + 1`) on the one before it; a lease's statement on the latest state
/// whose value it read (the one before it unless it read stale). Following that chain back
/// from the last statement gives the increments the final value is made of; a lease-less
/// increment off the chain was overwritten by a lease that had read the row before it.
fn lost_leaseless(writes: &[Committed]) -> u64 {
    // State k is the row after writes[k - 1]; state 0 is the fresh row (value 0).
    let value = |k: usize| {
        if k == 0 {
            0
        } else {
            writes[k - 1].value_written
        }
    };
    let mut base = vec![0usize; writes.len() + 1];
    for (i, w) in writes.iter().enumerate() {
        let k = i + 1;
        base[k] = if w.is_leaseless() || value(k - 1) == w.value_read {
            k - 1
        } else {
            (0..k)
                .rev()
                .find(|&j| value(j) == w.value_read)
                .unwrap_or(k - 1)
        };
    }
    let mut kept = vec![false; writes.len() + 1];
    let mut k = writes.len();
    while k > 0 {
        kept[k] = true;
        k = base[k];
    }
    count(
        writes
            .iter()
            .enumerate()
            .filter(|(i, w)| w.is_leaseless() && Kind::delta(&w.kind) > 0 && !kept[i + 1])
            .count(),
    )
}

/// Whether `w`, committed right after `prev` on the same row, breaks token order: its token
/// is older, or the same token from another lease (a work unit is one lease, and one lease may
/// write a row more than once — a retry after a commit whose acknowledgement was lost).
fn out_of_order(prev: &Committed, w: &Committed) -> bool {
    w.token < prev.token || (w.token == prev.token && w.unit != prev.unit)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A committed statement of row 0: `kind` by `unit` (token `token`), reading `read`.
    fn stmt(version: i64, unit: u64, token: i64, read: i64, kind: &str) -> Committed {
        Committed {
            version,
            token,
            value_read: read,
            value_written: read + Kind::delta(kind),
            unit,
            try_no: 0,
            txn: 0,
            kind: kind.to_owned(),
        }
    }

    fn checks(writes: Vec<Committed>, value: i64) -> RowChecks {
        let version = i64::try_from(writes.len()).unwrap();
        let committed = BTreeMap::from([(0, writes)]);
        let rows = [FinalRow {
            id: 0,
            value,
            version,
        }];
        check_rows(&committed, &rows, Mode::LeaselessMix)
    }

    const BYPASS: u64 = crate::leaseless::LEASELESS_UNIT_BASE;

    /// Lease 1 claims the row and increments it; lease 2 reads it (value 1, no claim); a
    /// bypass increments it; lease 2 then writes what it read plus one. The bypass's increment
    /// is lost, and the verifier must say so, by kind.
    #[test]
    fn a_bypass_overwritten_by_the_lease_that_read_before_it_is_a_lost_update() {
        let writes = vec![
            stmt(1, 0, 1, 0, "claim"),
            stmt(2, 0, 1, 0, "increment"),
            stmt(3, BYPASS, 1, 1, "bypass"),
            // Lease 2, from its picture of the row before the bypass: value 1 + 1.
            stmt(4, 1, 2, 1, "increment"),
        ];
        let c = checks(writes, 2);
        assert_eq!(c.lost, 1, "3 increments committed, the row holds 2");
        assert_eq!(
            c.lost_leaseless, 1,
            "the bypass's increment is the lost one"
        );
        assert_eq!(c.stale_reads, 1);
        assert_eq!(c.token_order, 0);
    }

    /// The same lease writing right after a bypass (the seal must have stopped it) is a
    /// violation even when it read the bypass's value.
    #[test]
    fn a_write_by_the_sealed_lease_is_a_violation() {
        let writes = vec![
            stmt(1, 0, 1, 0, "claim"),
            stmt(2, BYPASS, 1, 0, "bypass"),
            stmt(3, 0, 1, 1, "rewrite"),
        ];
        let c = checks(writes, 1);
        assert_eq!(c.sealed_writes, 1);
        assert_eq!(c.lost, 0);
    }

    /// A lease increment overwritten by an older lease's stale write is a lost lease
    /// increment, not a bypass's; a bypass after it, kept in the final value, is not lost.
    #[test]
    fn lost_updates_are_split_by_kind() {
        let writes = vec![
            stmt(1, 0, 1, 0, "increment"),
            stmt(2, 1, 2, 1, "increment"),
            // A lease that read 1 before lease 2's increment: lease 2's is lost.
            stmt(3, 2, 3, 1, "increment"),
            stmt(4, BYPASS, 3, 2, "bypass"),
            stmt(5, 3, 4, 3, "increment"),
        ];
        let c = checks(writes, 4);
        assert_eq!(c.lost, 1);
        assert_eq!(c.lost_leaseless, 0);
        assert_eq!(c.increments, 4);
    }

    /// The safe interleaving: the bypass lands between two leases; nothing is lost.
    #[test]
    fn a_bypass_between_leases_is_kept() {
        let writes = vec![
            stmt(1, 0, 1, 0, "claim"),
            stmt(2, 0, 1, 0, "increment"),
            stmt(3, BYPASS, 1, 1, "bypass"),
            stmt(4, 1, 2, 2, "claim"),
            stmt(5, 1, 2, 2, "increment"),
        ];
        let c = checks(writes, 3);
        assert_eq!(
            (c.lost, c.lost_leaseless, c.sealed_writes, c.stale_reads),
            (0, 0, 0, 0)
        );
    }
}
