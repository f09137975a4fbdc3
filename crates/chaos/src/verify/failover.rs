//! An issuer failover (Redis sentinel, etcd, ZooKeeper): the tokens and writes on either
//! side of its mark, and the rejections after it.

use std::collections::{BTreeMap, HashMap, HashSet};

use pgfence::issuer::IssuerKind;

use crate::report::{FailoverFigures, FaultRecovery};
use crate::util::count;
use crate::{Attempt, FailoverEvent, FaultMark, LeaseRecord, Outcome, RowResult};

use super::Committed;

/// The name of the fault mark of an issuer failover.
pub(crate) const FAILOVER: &str = "failover";

/// An issuer failover: its mark, what its causer recorded, and the recovery measured from it.
pub(super) struct Around<'a> {
    pub(super) fault: &'a FaultMark,
    pub(super) event: Option<&'a FailoverEvent>,
    pub(super) issuer: IssuerKind,
    pub(super) recovery: &'a FaultRecovery,
}

/// The tokens and writes on either side of a failover: leases granted before its mark (taken
/// once the old leader was dead) against leases asked for after it (so none of those can come
/// from the old leader) and, for Redis, granted after it.
pub(super) fn failover_figures(
    around: &Around<'_>,
    leases: &[LeaseRecord],
    attempts: &[Attempt],
    committed: &BTreeMap<i32, Vec<Committed>>,
) -> FailoverFigures {
    let at = around.fault.at_ms;
    let by_unit: HashMap<u64, &LeaseRecord> = leases.iter().map(|l| (l.unit, l)).collect();
    let before: HashSet<u64> = leases
        .iter()
        .filter(|l| l.at_ms <= at)
        .map(|l| l.unit)
        .collect();
    // The mark is taken once the old leader is dead. Redis: a lease granted after it came from
    // the new master (the workers that waited through the outage get its first tokens). etcd,
    // ZooKeeper: an acquire sent before the mark may have been committed by the old leader, its
    // answer lost and the acquire re-sent to a survivor (same owner: the same, older token), so
    // only leases asked for after the mark count.
    let redis = around.issuer == IssuerKind::Redis;
    let after: HashSet<u64> = leases
        .iter()
        .filter(|l| l.asked_at_ms > at || (redis && l.at_ms > at))
        .map(|l| l.unit)
        .collect();
    // Per resource (the lease's row, or group in batch mode): the highest token accepted
    // before, the lowest issued after.
    let mut max_before: HashMap<i32, i64> = HashMap::new();
    let mut accepted_after = 0u64;
    let mut units_after: HashSet<u64> = HashSet::new();
    for w in committed.values().flatten() {
        let Some(lease) = by_unit.get(&w.unit) else {
            continue;
        };
        if before.contains(&w.unit) {
            let top = max_before.entry(lease.row).or_insert(w.token);
            *top = (*top).max(w.token);
        }
        if after.contains(&w.unit) {
            accepted_after += 1;
            units_after.insert(w.unit);
        }
    }
    let mut min_after: HashMap<i32, i64> = HashMap::new();
    for l in leases.iter().filter(|l| after.contains(&l.unit)) {
        let low = min_after.entry(l.row).or_insert(l.token);
        *low = (*low).min(l.token);
    }
    let (mut rejected_after, mut duplicates_after) = (0u64, 0u64);
    for a in attempts.iter().filter(|a| after.contains(&a.unit)) {
        match (&a.batch, &a.outcome) {
            (Some(b), _) => {
                rejected_after += count(b.rejected());
                duplicates_after += count(
                    b.claim
                        .iter()
                        .chain(&b.write)
                        .filter(|r| **r == RowResult::Duplicate)
                        .count(),
                );
            }
            (None, Outcome::Rejected { duplicate, .. }) => {
                rejected_after += 1;
                duplicates_after += u64::from(*duplicate);
            }
            (None, _) => {}
        }
    }
    let max_token_before = max_before.values().copied().max();
    let min_token_after = min_after.values().copied().min();
    let resources_backwards = count(
        min_after
            .iter()
            .filter(|(row, low)| max_before.get(row).is_some_and(|top| **low <= *top))
            .count(),
    );
    let event = around.event;
    FailoverFigures {
        issuer: around.issuer.name().to_owned(),
        at_ms: at,
        at_unit: around.fault.at_unit,
        old_leader: event.map_or_else(|| "?".to_owned(), |e| e.old_leader.clone()),
        new_leader: event.and_then(|e| e.new_leader.clone()),
        new_leader_after_ms: event.and_then(|e| e.new_leader_after_ms),
        replica_paused_at_unit: event.and_then(|e| e.replica_paused_at_unit),
        leases_before: count(before.len()),
        max_token_before,
        leases_after: count(after.len()),
        min_token_after,
        tokens_increased: max_token_before
            .zip(min_token_after)
            .map(|(before, after)| after > before),
        resources_backwards,
        accepted_after,
        units_accepted_after: count(units_after.len()),
        rejected_after,
        duplicates_after,
        rows_recovered: around.recovery.rows_recovered,
        rows: around.recovery.rows,
        first_write_ms: around.recovery.first_write_ms,
        recovery_ms: around.recovery.recovery_ms,
    }
}
