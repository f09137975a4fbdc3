//! A failover of the protected database: what the promotion lost, whom fencing refused, and
//! whether a lease from before it got a write in after it (a zombie write).

use std::collections::{BTreeMap, HashMap, HashSet};

use pgfence::issuer::IssuerKind;

use crate::report::{FaultRecovery, PgFailoverFigures};
use crate::util::count;
use crate::{Attempt, Outcome, PgFailoverEvent};

use super::Committed;

/// The name of the fault a failover of the harness's own PostgreSQL is marked with (at the
/// promotion).
pub(crate) const PG_FAILOVER: &str = "pg_failover";

/// What [`pg_failover_figures`] works from besides the history.
pub(super) struct PgSeen<'a> {
    pub(super) event: &'a PgFailoverEvent,
    pub(super) issuer: IssuerKind,
    /// The recovery measured from the `pg_failover` mark.
    pub(super) recovery: Option<&'a FaultRecovery>,
    /// Acknowledged transactions the database lost: `(unit, try, txn)`.
    pub(super) lost: &'a [(u64, u32, u32)],
    /// Rejections with neither an audit row nor an audit-failure event.
    pub(super) audit_rows_lost: u64,
}

/// The database failover's figures: what it lost, whom fencing refused, and whether a lease
/// from before it got a write in after it (a zombie).
///
/// A lease counts as from before the kill when a try of it that started before the old
/// primary was gone had a statement acknowledged (it read, committed, or was rejected by the
/// database). A statement of such a lease in the new primary's history, from a try that
/// started after the old primary was gone (nothing commits between then and the promotion),
/// is a zombie write.
pub(super) fn pg_failover_figures(
    seen: &PgSeen<'_>,
    attempts: &[Attempt],
    committed: &BTreeMap<i32, Vec<Committed>>,
) -> PgFailoverFigures {
    let e = seen.event;
    let bound_before: HashSet<u64> = attempts
        .iter()
        .filter(|a| a.started_ms < e.dead_at_ms)
        .filter(|a| {
            a.commits > 0
                || a.value_read.is_some()
                || matches!(a.outcome, Outcome::Accepted | Outcome::Rejected { .. })
        })
        .map(|a| a.unit)
        .collect();
    let started: HashMap<(u64, u32), u64> = attempts
        .iter()
        .map(|a| ((a.unit, a.try_no), a.started_ms))
        .collect();
    let across: HashSet<u64> = attempts
        .iter()
        .filter(|a| a.started_ms >= e.dead_at_ms && bound_before.contains(&a.unit))
        .map(|a| a.unit)
        .collect();
    let zombie_writes = committed
        .values()
        .flatten()
        .filter(|w| !w.is_leaseless() && bound_before.contains(&w.unit))
        .filter(|w| {
            started
                .get(&(w.unit, w.try_no))
                .is_some_and(|&t| t >= e.dead_at_ms)
        })
        .count();
    let fenced: Vec<&Attempt> = attempts
        .iter()
        .filter(|a| matches!(a.outcome, Outcome::Rejected { failover: true, .. }))
        .collect();
    let leases_fenced: HashSet<u64> = fenced.iter().map(|a| a.unit).collect();
    // Rejections (rows in batch mode) by when their try started.
    let (mut rejected_before, mut rejected_after) = (0u64, 0u64);
    for a in attempts {
        let n = match &a.batch {
            Some(b) => count(b.rejected()),
            None => u64::from(matches!(a.outcome, Outcome::Rejected { .. })),
        };
        if a.started_ms < e.promoted_at_ms {
            rejected_before += n;
        } else {
            rejected_after += n;
        }
    }
    let units_lost: HashSet<u64> = seen.lost.iter().map(|&(u, _, _)| u).collect();
    PgFailoverFigures {
        cut_off_at_ms: e.cut_off_at_ms,
        cut_off_at_unit: e.cut_off_at_unit,
        kill_at_ms: e.kill_at_ms,
        dead_at_ms: e.dead_at_ms,
        promoted_at_ms: e.promoted_at_ms,
        failover_ms: e.failover_ms,
        old_timeline: e.old_timeline,
        new_timeline: e.new_timeline,
        acknowledged_lost: count(seen.lost.len()),
        units_lost: count(units_lost.len()),
        fenced_by_failover: count(fenced.len()),
        leases_fenced: count(leases_fenced.len()),
        leases_fenced_unbound: count(
            leases_fenced
                .iter()
                .filter(|u| !bound_before.contains(u))
                .count(),
        ),
        first_refusal_ms: fenced
            .iter()
            .map(|a| a.finished_ms.saturating_sub(e.promoted_at_ms))
            .min(),
        leases_across: count(across.len()),
        zombie_writes: count(zombie_writes),
        rejected_before,
        rejected_after,
        audit_rows_lost: seen.audit_rows_lost,
        issuer_rolled_back: seen.issuer == IssuerKind::Postgres,
        rows_recovered: seen.recovery.map_or(0, |r| r.rows_recovered),
        rows: seen.recovery.map_or(0, |r| r.rows),
        first_write_ms: seen.recovery.and_then(|r| r.first_write_ms),
        recovery_ms: seen.recovery.and_then(|r| r.recovery_ms),
    }
}
