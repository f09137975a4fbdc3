//! Per-attempt checks, every mode: what each try was told (accepted, rejected, failed)
//! against what the history says committed, and what a database failover lost.

use std::collections::{BTreeMap, HashMap, HashSet};

use crate::util::count;
use crate::{Attempt, Outcome, Stage};

/// What the attempts say, compared with what committed.
#[derive(Default)]
pub(super) struct AttemptChecks {
    /// Outcomes that contradict the history.
    pub(super) mismatches: u64,
    /// After a database failover: transactions acknowledged in tries that started before the
    /// promotion and missing from the new primary — lost by the database, `(unit, try, txn)`.
    pub(super) db_lost: Vec<(u64, u32, u32)>,
    pub(super) acknowledged: u64,
    pub(super) rejected: u64,
    pub(super) errors: u64,
    pub(super) retryable_errors: u64,
    /// Failures by (classification, retryable).
    pub(super) kinds: BTreeMap<(String, bool), u64>,
}

/// Checks each try's transactions against the history (every transaction records at least one
/// statement): the ones acknowledged committed; the one that failed committed only if it failed
/// in `COMMIT`; none after it ran. With `lost_before` (a database failover's promotion time),
/// an acknowledged transaction missing from the history of a try that started before it is
/// counted as lost by the database instead.
pub(super) fn check_attempts(
    attempts: &[Attempt],
    in_history: &HashSet<(u64, u32, u32)>,
    lost_before: Option<u64>,
) -> AttemptChecks {
    let mut c = AttemptChecks::default();
    // Highest transaction in the history per try.
    let mut last_txn: HashMap<(u64, u32), u32> = HashMap::new();
    for &(unit, try_no, txn) in in_history {
        let e = last_txn.entry((unit, try_no)).or_insert(txn);
        *e = (*e).max(txn);
    }
    for a in attempts {
        let acked = a.first_txn..a.first_txn + a.commits;
        let missing = acked.filter(|&t| !in_history.contains(&(a.unit, a.try_no, t)));
        if lost_before.is_some_and(|promoted| a.started_ms < promoted) {
            c.db_lost.extend(missing.map(|t| (a.unit, a.try_no, t)));
        } else {
            c.mismatches += count(missing.count());
        }
        // The transaction the try ended in, if it did not end accepted.
        let failed_txn = a.first_txn + a.commits;
        let committed = in_history.contains(&(a.unit, a.try_no, failed_txn));
        let beyond = last_txn
            .get(&(a.unit, a.try_no))
            .is_some_and(|&t| t > failed_txn);
        if beyond {
            c.mismatches += 1;
        }
        match &a.outcome {
            Outcome::Accepted => {
                c.acknowledged += 1;
                if committed {
                    c.mismatches += 1;
                }
            }
            Outcome::Rejected { .. } => {
                c.rejected += 1;
                if committed {
                    c.mismatches += 1;
                }
            }
            Outcome::Failed {
                stage,
                retryable,
                error,
            } => {
                c.errors += 1;
                if *retryable {
                    c.retryable_errors += 1;
                }
                *c.kinds.entry((error.clone(), *retryable)).or_default() += 1;
                // Only a failed COMMIT may have committed.
                if committed && *stage != Stage::Commit {
                    c.mismatches += 1;
                }
            }
        }
    }
    c
}
