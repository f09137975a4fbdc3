//! Recovery per fault: per row, the leases, rejections and errors it took after the fault
//! until the row accepted writes again ([`recovery`]; [`recovery_batch`] in batch mode).

use std::collections::{BTreeMap, HashMap, HashSet};

use crate::report::FaultRecovery;
use crate::schema::Kind;
use crate::util::count;
use crate::worker::Stats;
use crate::{Attempt, FaultMark, LeaseRecord, Outcome};

use super::{Committed, FAILOVER};

/// Batch mode: how the run recovered from `fault`, per counter row: the leases granted after
/// it whose batches included the row, up to the one whose write of the row committed first.
///
/// For a fault that loses the token counters (`counter_reset`, `redis_restart`) recovery is
/// measured from the counter loss as the workers met it: the first lease granted after the
/// mark whose token is below one already issued for its group (`at_ms` is that lease's time).
/// A Redis restart goes down a little after its mark, and a batch covers so many rows that the
/// leases granted in between could otherwise count every row as recovered before any counter
/// was lost.
pub(super) fn recovery_batch(
    fault: &FaultMark,
    rows: usize,
    attempts: &[Attempt],
    leases: &[LeaseRecord],
    committed: &BTreeMap<i32, Vec<Committed>>,
    stats: &Stats,
) -> FaultRecovery {
    let loses_counters = fault.name == "counter_reset" || fault.name == "redis_restart";
    let at_ms = if loses_counters {
        counter_loss_seen(fault.at_ms, leases).unwrap_or(fault.at_ms)
    } else {
        fault.at_ms
    };
    let fault = &FaultMark {
        at_ms,
        ..fault.clone()
    };
    // Leases that count as after the fault, with when they were granted.
    let lease_at: HashMap<u64, u64> = leases
        .iter()
        .filter(|l| after_fault(fault, l))
        .map(|l| (l.unit, l.at_ms))
        .collect();
    let finished: HashMap<(u64, u32), u64> = attempts
        .iter()
        .map(|a| ((a.unit, a.try_no), a.finished_ms))
        .collect();
    // Per row: when its first write by a lease granted after the fault committed (as the
    // writing try saw it end), and when that lease was granted.
    let mut recovered_at: BTreeMap<i32, (u64, u64)> = BTreeMap::new();
    for (&row, writes) in committed {
        for w in writes.iter().filter(|w| w.kind != Kind::Claim.as_str()) {
            let Some(&at) = lease_at.get(&w.unit) else {
                continue;
            };
            if let Some(&t) = finished.get(&(w.unit, w.try_no)) {
                let e = recovered_at.entry(row).or_insert((t, at));
                if t < e.0 {
                    *e = (t, at);
                }
            }
        }
    }
    // Per row: leases (and their rejected rows there) after the fault, up to the recovering one.
    let mut per_row: BTreeMap<i32, (u64, u64)> = BTreeMap::new();
    for a in attempts {
        let Some(b) = &a.batch else { continue };
        let Some(&at) = lease_at.get(&a.unit) else {
            continue;
        };
        for (i, row) in b.rows.iter().enumerate() {
            if recovered_at.get(row).is_some_and(|&(_, by)| at > by) {
                continue;
            }
            let e = per_row.entry(*row).or_default();
            e.0 += u64::from(a.try_no == 0);
            e.1 += count(
                [b.claim.get(i), b.write.get(i)]
                    .into_iter()
                    .flatten()
                    .filter(|r| r.is_rejection())
                    .count(),
            );
        }
    }
    let recovered: Vec<u64> = recovered_at.values().map(|&(t, _)| t).collect();
    let rows_recovered = recovered.len();
    let last = (rows_recovered == rows)
        .then(|| recovered.iter().copied().max())
        .flatten();
    let first = recovered.iter().copied().min();
    let (errors, acquire_errors) = errors_until(fault, last, attempts, stats);
    FaultRecovery {
        name: fault.name.clone(),
        at_ms: fault.at_ms,
        rows_recovered,
        rows,
        leases_to_recover: per_row.values().map(|e| e.0).sum(),
        max_leases_one_row: per_row.values().map(|e| e.0).max().unwrap_or(0),
        rejections_before_recovery: per_row.values().map(|e| e.1).sum(),
        errors_before_recovery: errors,
        acquire_errors_before_recovery: acquire_errors,
        first_write_ms: first.map(|t| t.saturating_sub(fault.at_ms)),
        recovery_ms: last.map(|t| t.saturating_sub(fault.at_ms)),
    }
}

/// Whether `lease` counts as after `fault` for its recovery: granted at or after its mark, or
/// for an issuer failover asked for after it (a lease asked for before the kill may have been
/// issued by the old leader, its answer arriving after the mark).
fn after_fault(fault: &FaultMark, lease: &LeaseRecord) -> bool {
    if fault.name == FAILOVER {
        lease.asked_at_ms > fault.at_ms
    } else {
        lease.at_ms >= fault.at_ms
    }
}

/// When the first lease granted at or after `from` got a token below one already issued for
/// its row (its group in batch mode): the counter went backwards.
fn counter_loss_seen(from: u64, leases: &[LeaseRecord]) -> Option<u64> {
    let mut sorted: Vec<&LeaseRecord> = leases.iter().collect();
    sorted.sort_by_key(|l| (l.at_ms, l.token));
    let mut highest: HashMap<i32, i64> = HashMap::new();
    for l in sorted {
        let top = highest.entry(l.row).or_insert(l.token);
        if l.at_ms >= from && l.token < *top {
            return Some(l.at_ms);
        }
        *top = (*top).max(l.token);
    }
    None
}

/// Failed tries and failed acquisitions from `fault` until `last` (the end of recovery; the
/// end of the run if it never came).
fn errors_until(
    fault: &FaultMark,
    last: Option<u64>,
    attempts: &[Attempt],
    stats: &Stats,
) -> (u64, u64) {
    let until = last.unwrap_or(u64::MAX);
    let errors = attempts
        .iter()
        .filter(|a| a.started_ms >= fault.at_ms && a.started_ms <= until)
        .filter(|a| matches!(a.outcome, Outcome::Failed { .. }))
        .count();
    let acquire_errors = stats
        .acquire_error_at
        .iter()
        .filter(|&&t| t >= fault.at_ms && t <= until)
        .count();
    (count(errors), count(acquire_errors))
}

/// How the run recovered from `fault`: per row, the leases granted after it up to the row's
/// first committed write.
pub(super) fn recovery(
    fault: &FaultMark,
    rows: usize,
    attempts: &[Attempt],
    leases: &[LeaseRecord],
    in_history: &HashSet<(u64, u32)>,
    stats: &Stats,
) -> FaultRecovery {
    // A try counts as writing once any of its transactions committed.
    // First committed try per unit, and rejections per unit.
    let mut success_at: HashMap<u64, u64> = HashMap::new();
    let mut rejections: HashMap<u64, u64> = HashMap::new();
    for a in attempts {
        if in_history.contains(&(a.unit, a.try_no)) {
            let t = success_at.entry(a.unit).or_insert(a.finished_ms);
            *t = (*t).min(a.finished_ms);
        }
        if matches!(a.outcome, Outcome::Rejected { .. }) {
            *rejections.entry(a.unit).or_default() += 1;
        }
    }
    let mut after: Vec<&LeaseRecord> = leases.iter().filter(|l| after_fault(fault, l)).collect();
    after.sort_by_key(|l| (l.at_ms, l.unit));
    // Per row: leases, rejections, and when it first committed.
    let mut per_row: BTreeMap<i32, (u64, u64, Option<u64>)> = BTreeMap::new();
    for l in after {
        let e = per_row.entry(l.row).or_default();
        if e.2.is_some() {
            continue;
        }
        e.0 += 1;
        e.1 += rejections.get(&l.unit).copied().unwrap_or(0);
        if let Some(&t) = success_at.get(&l.unit) {
            e.2 = Some(t);
        }
    }
    let recovered: Vec<u64> = per_row.values().filter_map(|e| e.2).collect();
    let rows_recovered = recovered.len();
    let last = (rows_recovered == rows)
        .then(|| recovered.iter().copied().max())
        .flatten();
    let first = recovered.iter().copied().min();
    let (errors_before, acquire_errors_before) = errors_until(fault, last, attempts, stats);
    FaultRecovery {
        name: fault.name.clone(),
        at_ms: fault.at_ms,
        rows_recovered,
        rows,
        leases_to_recover: per_row.values().map(|e| e.0).sum(),
        max_leases_one_row: per_row.values().map(|e| e.0).max().unwrap_or(0),
        rejections_before_recovery: per_row.values().map(|e| e.1).sum(),
        errors_before_recovery: errors_before,
        acquire_errors_before_recovery: acquire_errors_before,
        first_write_ms: first.map(|t| t.saturating_sub(fault.at_ms)),
        recovery_ms: last.map(|t| t.saturating_sub(fault.at_ms)),
    }
}
