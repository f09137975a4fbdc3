//! Leaseless mode: the lease-less writes (bypasses, `fence + 1`) as their writers saw them,
//! against the history and the audit, and what they did to the leases.

use std::collections::{BTreeMap, HashMap};

use sqlx::PgPool;

use crate::report::LeaselessFigures;
use crate::util::count;
use crate::{
    Attempt, ChaosError, Config, LeaselessAttempt, LeaselessKind, LeaselessOutcome, Outcome,
};

use super::Committed;
use super::rows::RowChecks;

/// Leaseless mode: the audit rows of the run's bypasses (operation `bypass`, on the guarded
/// counter table, keyed by the run's rows: the trigger writes the key as `["<run>", <id>]`).
pub(super) async fn bypass_audit_rows(admin: &PgPool, run: &str) -> Result<u64, ChaosError> {
    let n: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pgfence.audit \
          WHERE operation = 'bypass' AND table_name = '\"pgfence_chaos\".\"cell\"' \
            AND left(row_key, length($1)) = $1",
    )
    .bind(format!("[\"{run}\","))
    .fetch_one(admin)
    .await?;
    Ok(u64::try_from(n).unwrap_or(0))
}

/// Leaseless mode: the lease-less writes as their writers saw them, checked against the
/// history (each that went through committed its history row with it), and what they did to
/// the leases.
pub(super) fn leaseless_figures(
    cfg: &Config,
    writes: &[LeaselessAttempt],
    attempts: &[Attempt],
    committed: &BTreeMap<i32, Vec<Committed>>,
    rows: &RowChecks,
    bypass_audit_rows: u64,
) -> LeaselessFigures {
    let in_history: HashMap<u64, &str> = committed
        .values()
        .flatten()
        .filter(|w| w.is_leaseless())
        .map(|w| (w.unit, w.kind.as_str()))
        .collect();
    let mut f = LeaselessFigures {
        writers: cfg.leaseless_writers,
        bypass_audit_rows,
        ..LeaselessFigures::default()
    };
    for kind in in_history.values() {
        if *kind == LeaselessKind::Bypass.as_str() {
            f.bypass_committed += 1;
        } else {
            f.fence_plus_one_committed += 1;
        }
    }
    let mut fence_plus_one_acked = 0;
    for w in writes {
        let bypass = w.kind == LeaselessKind::Bypass;
        let committed = in_history.contains_key(&w.id);
        let (sent, refused, applied, failed) = if bypass {
            (
                &mut f.bypass_sent,
                &mut f.bypass_refused,
                &mut f.bypass_applied,
                &mut f.bypass_failed,
            )
        } else {
            (
                &mut f.fence_plus_one_sent,
                &mut f.fence_plus_one_refused,
                &mut fence_plus_one_acked,
                &mut f.fence_plus_one_failed,
            )
        };
        *sent += 1;
        match &w.outcome {
            LeaselessOutcome::Applied => {
                *applied += 1;
                f.ack_mismatches += u64::from(!committed);
            }
            LeaselessOutcome::Refused { code } => {
                *refused += 1;
                if !bypass && code == "PF007" {
                    f.fence_plus_one_refused_pf007 += 1;
                }
                f.ack_mismatches += u64::from(committed);
            }
            LeaselessOutcome::Failed { stage, .. } => {
                *failed += 1;
                // Only a failed COMMIT may have committed.
                f.ack_mismatches += u64::from(committed && *stage != "commit");
            }
        }
    }
    f.fence_plus_one_accepted = f.fence_plus_one_committed.max(fence_plus_one_acked);
    f.leases_sealed = count(
        attempts
            .iter()
            .filter(|a| matches!(a.outcome, Outcome::Rejected { sealed: true, .. }))
            .count(),
    );
    f.lost_bypass_increments = rows.lost_leaseless;
    f.lost_lease_increments = rows.lost.saturating_sub(rows.lost_leaseless);
    f.sealed_writes = rows.sealed_writes;
    f
}
