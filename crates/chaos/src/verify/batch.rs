//! Batch mode: the rows' figures (claimed, applied, rejected, mixed statements), from the
//! tries' per-row outcomes and the history.

use std::collections::BTreeMap;

use crate::report::BatchFigures;
use crate::schema::Kind;
use crate::util::count;
use crate::{Attempt, Outcome, RowResult};

use super::Committed;

/// Batch mode: the rows' figures, from the tries' per-row outcomes and the history.
pub(super) fn batch_figures(
    attempts: &[Attempt],
    committed: &BTreeMap<i32, Vec<Committed>>,
) -> BatchFigures {
    let mut b = BatchFigures {
        min_rows: u64::MAX,
        ..BatchFigures::default()
    };
    let n =
        |rows: &[RowResult], f: fn(&RowResult) -> bool| count(rows.iter().filter(|r| f(r)).count());
    for a in attempts {
        let Some(r) = &a.batch else { continue };
        if a.try_no == 0 {
            b.min_rows = b.min_rows.min(count(r.rows.len()));
            b.max_rows = b.max_rows.max(count(r.rows.len()));
        }
        let claimed = n(&r.claim, |x| *x == RowResult::Applied);
        let rejected = n(&r.claim, |x| x.is_rejection());
        b.rows_claimed_sent += count(r.claim.len());
        b.rows_claimed += claimed;
        b.rows_rejected_at_claim += rejected;
        b.mixed_claims += u64::from(claimed > 0 && rejected > 0);
        let applied = n(&r.write, |x| *x == RowResult::Applied);
        let rejected = n(&r.write, |x| x.is_rejection());
        b.rows_written_sent += n(&r.write, |x| *x != RowResult::Skipped);
        b.rows_applied += applied;
        b.rows_rejected_at_write += rejected;
        b.mixed_writes += u64::from(applied > 0 && rejected > 0);
        for rows in [&r.claim, &r.write] {
            b.rows_duplicate += n(rows, |x| *x == RowResult::Duplicate);
            b.rows_other += n(rows, |x| {
                matches!(
                    x,
                    RowResult::NotFound | RowResult::Sealed | RowResult::Contended
                )
            });
        }
        b.tries_fully_rejected += u64::from(matches!(a.outcome, Outcome::Rejected { .. }));
    }
    if b.min_rows == u64::MAX {
        b.min_rows = 0;
    }
    for w in committed.values().flatten() {
        if w.kind == Kind::Claim.as_str() {
            b.row_claims_committed += 1;
        } else {
            b.row_writes_committed += 1;
        }
    }
    b
}
