//! The checks after a run: the client-side history against what Postgres committed.
//!
//! Ground truth is the `history` table, whose rows commit with the writes they describe, in
//! each row's commit (version) order. From it: token order, all-or-nothing (version gaps),
//! lost updates and stale reads per row; acknowledgement mismatches per attempt; recovery per
//! fault.

use std::collections::{BTreeMap, HashMap, HashSet};

use sqlx::{PgPool, Row};

use crate::report::{ErrorKind, FaultRecovery, Report, Summary};
use crate::schema::{CounterTable, Kind};
use crate::util::count;
use crate::worker::{Stats, WorkerOut};
use crate::{
    Attempt, AuditTally, ChaosError, Config, FaultMark, LeaseRecord, Mode, Outcome, Stage,
};

/// What the run produced on the client side, handed to [`verify`].
pub(crate) struct RunOutput {
    /// One per worker.
    pub(crate) workers: Vec<WorkerOut>,
    /// Faults, in order.
    pub(crate) faults: Vec<FaultMark>,
    /// Backends terminated.
    pub(crate) kills: u64,
    /// Wall-clock duration.
    pub(crate) duration_ms: u64,
    /// Audit events counted during the run.
    pub(crate) audit: AuditTally,
    /// Reseeds counted during the run, if counted.
    pub(crate) reseeds: Option<u64>,
}

/// The run being verified.
pub(crate) struct RunId<'a> {
    /// Its configuration.
    pub(crate) cfg: &'a Config,
    /// Its id (the `run` column).
    pub(crate) run: &'a str,
    /// The prefix of its resources.
    pub(crate) resource_prefix: &'a str,
}

/// A committed write, from the history table.
struct Committed {
    version: i64,
    token: i64,
    value_read: i64,
    value_written: i64,
    unit: u64,
    try_no: u32,
    txn: u32,
    kind: String,
}

/// A counter row's final state.
struct FinalRow {
    id: i32,
    value: i64,
    version: i64,
}

/// Reads back what Postgres committed and checks the history against it.
pub(crate) async fn verify(
    admin: &PgPool,
    id: RunId<'_>,
    output: RunOutput,
) -> Result<Report, ChaosError> {
    let cfg = id.cfg;
    let committed = committed_writes(admin, id.run).await?;
    let rows = final_rows(admin, id.run, CounterTable::of(cfg.mode)).await?;
    let audit_rows: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pgfence.audit WHERE left(resource, length($1)) = $1",
    )
    .bind(id.resource_prefix)
    .fetch_one(admin)
    .await?;

    let row_checks = check_rows(&committed, &rows, cfg.mode);
    let in_history: HashSet<(u64, u32, u32)> = committed
        .values()
        .flatten()
        .map(|w| (w.unit, w.try_no, w.txn))
        .collect();
    let tries_committed: HashSet<(u64, u32)> = in_history.iter().map(|&(u, t, _)| (u, t)).collect();

    let mut attempts = Vec::new();
    let mut leases = Vec::new();
    let mut stats = Stats::default();
    for out in output.workers {
        attempts.extend(out.attempts);
        leases.extend(out.leases);
        stats.add(&out.stats);
    }
    let acks = check_attempts(&attempts, &in_history);
    let mut kinds = acks.kinds;
    for ((kind, retryable), n) in &stats.acquire_error_kinds {
        *kinds
            .entry((format!("acquire: {kind}"), *retryable))
            .or_default() += n;
    }
    let fault_recovery = output
        .faults
        .iter()
        .map(|f| recovery(f, cfg.rows, &attempts, &leases, &tries_committed, &stats))
        .collect();

    let summary = Summary {
        run: id.run.to_owned(),
        mode: cfg.mode,
        workers: cfg.workers,
        rows: cfg.rows,
        units: count(leases.len()),
        attempts: count(attempts.len()),
        accepted: count(committed.values().map(Vec::len).sum()),
        increments: row_checks.increments,
        units_incremented: row_checks.units_incremented,
        repeated_increments: row_checks.repeated_increments,
        acknowledged: acks.acknowledged,
        rejected: acks.rejected,
        errors: acks.errors,
        retryable_errors: acks.retryable_errors,
        retries: stats.retries,
        violations: row_checks.token_order + acks.mismatches + row_checks.torn,
        token_order_violations: row_checks.token_order,
        ack_mismatches: acks.mismatches,
        torn_writes: row_checks.torn,
        lost_updates: row_checks.lost,
        stale_reads: row_checks.stale_reads,
        audit_rows: u64::try_from(audit_rows).unwrap_or(0),
        log_events: output.audit.rejections,
        audit_failures: output.audit.audit_failures,
        reseed_events: output.reseeds,
        counter_raises: stats.counter_raises,
        pauses: stats.pauses,
        backend_kills: output.kills,
        acquire_errors: stats.acquire_errors,
        acquire_timeouts: stats.acquire_timeouts,
        released_expired: stats.released_expired,
        released_taken: stats.released_taken,
        duration_ms: output.duration_ms,
        timed_out: stats.timed_out,
        faults: fault_recovery,
        error_kinds: kinds
            .into_iter()
            .map(|((kind, retryable), count)| ErrorKind {
                kind,
                retryable,
                count,
            })
            .collect(),
    };
    Ok(Report {
        summary,
        attempts,
        leases,
        faults: output.faults,
    })
}

/// Committed writes per row, in commit (version) order.
async fn committed_writes(
    admin: &PgPool,
    run: &str,
) -> Result<BTreeMap<i32, Vec<Committed>>, ChaosError> {
    let history = sqlx::query(
        "SELECT id, version, token, value_read, value_written, unit, try_no, txn, kind \
         FROM pgfence_chaos.history WHERE run = $1 ORDER BY id, version",
    )
    .bind(run)
    .fetch_all(admin)
    .await?;
    let mut committed: BTreeMap<i32, Vec<Committed>> = BTreeMap::new();
    for r in &history {
        committed
            .entry(r.try_get("id")?)
            .or_default()
            .push(Committed {
                version: r.try_get("version")?,
                token: r.try_get("token")?,
                value_read: r.try_get("value_read")?,
                value_written: r.try_get("value_written")?,
                unit: u64::try_from(r.try_get::<i64, _>("unit")?).unwrap_or(u64::MAX),
                try_no: u32::try_from(r.try_get::<i32, _>("try_no")?).unwrap_or(u32::MAX),
                txn: u32::try_from(r.try_get::<i32, _>("txn")?).unwrap_or(u32::MAX),
                kind: r.try_get("kind")?,
            });
    }
    Ok(committed)
}

/// The run's counter rows as they ended.
async fn final_rows(
    admin: &PgPool,
    run: &str,
    table: CounterTable,
) -> Result<Vec<FinalRow>, ChaosError> {
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT id, value, version FROM {} WHERE run = $1",
        table.name()
    )))
    .bind(run)
    .fetch_all(admin)
    .await?;
    rows.iter()
        .map(|r| {
            Ok(FinalRow {
                id: r.try_get("id")?,
                value: r.try_get("value")?,
                version: r.try_get("version")?,
            })
        })
        .collect()
}

/// Per-row verdicts.
#[derive(Default)]
struct RowChecks {
    /// Accepted writes whose token was older than the previous one's, or the same from
    /// another lease.
    token_order: u64,
    /// Version gaps, and row versions without their history row.
    torn: u64,
    /// Committed increments minus final value, summed.
    lost: u64,
    /// Recorded statements that did not read the previous one's value, or changed it by other
    /// than their kind says (one for an increment, nothing for a claim or a rewrite).
    stale_reads: u64,
    /// Committed increments.
    increments: u64,
    /// Units with at least one committed increment.
    units_incremented: u64,
    /// Committed increments beyond a unit's first (per transaction in fenced-multi): a retry
    /// after a lost commit acknowledgement that did not know its increment had landed.
    repeated_increments: u64,
}

fn check_rows(
    committed: &BTreeMap<i32, Vec<Committed>>,
    rows: &[FinalRow],
    mode: Mode,
) -> RowChecks {
    let mut c = RowChecks::default();
    let mut units: HashSet<u64> = HashSet::new();
    // Where a unit means to increment: once per transaction in fenced-multi, once otherwise.
    let mut slots: HashSet<(u64, u32)> = HashSet::new();
    for row in rows {
        let writes = committed
            .get(&row.id)
            .map(Vec::as_slice)
            .unwrap_or_default();
        let n = i64::try_from(writes.len()).unwrap_or(i64::MAX);
        let mut increments = 0i64;
        // Version gaps or a row version without its history row: not all-or-nothing.
        c.torn += u64::try_from((row.version - n).abs()).unwrap_or(u64::MAX);
        let mut prev: Option<&Committed> = None;
        let mut prev_value = 0i64;
        for (i, w) in writes.iter().enumerate() {
            if w.version != i64::try_from(i).unwrap_or(i64::MAX) + 1 {
                c.torn += 1;
            }
            if prev.is_some_and(|p| out_of_order(p, w)) {
                c.token_order += 1;
            }
            let delta = Kind::delta(&w.kind);
            if w.value_read != prev_value || w.value_written != w.value_read + delta {
                c.stale_reads += 1;
            }
            if delta > 0 {
                increments += 1;
                if units.insert(w.unit) {
                    c.units_incremented += 1;
                }
                let slot = if mode == Mode::FencedMulti { w.txn } else { 0 };
                if !slots.insert((w.unit, slot)) {
                    c.repeated_increments += 1;
                }
            }
            prev = Some(w);
            prev_value = w.value_written;
        }
        c.increments += u64::try_from(increments).unwrap_or(0);
        c.lost += u64::try_from(increments - row.value).unwrap_or(0);
    }
    c
}

/// Whether `w`, committed right after `prev` on the same row, breaks token order: its token
/// is older, or the same token from another lease (a work unit is one lease, and one lease may
/// write a row more than once — a retry after a commit whose acknowledgement was lost).
fn out_of_order(prev: &Committed, w: &Committed) -> bool {
    w.token < prev.token || (w.token == prev.token && w.unit != prev.unit)
}

/// What the attempts say, compared with what committed.
#[derive(Default)]
struct AttemptChecks {
    /// Outcomes that contradict the history.
    mismatches: u64,
    acknowledged: u64,
    rejected: u64,
    errors: u64,
    retryable_errors: u64,
    /// Failures by (classification, retryable).
    kinds: BTreeMap<(String, bool), u64>,
}

/// Checks each try's transactions against the history (every transaction records at least one
/// statement): the ones acknowledged committed; the one that failed committed only if it failed
/// in `COMMIT`; none after it ran.
fn check_attempts(attempts: &[Attempt], in_history: &HashSet<(u64, u32, u32)>) -> AttemptChecks {
    let mut c = AttemptChecks::default();
    // Highest transaction in the history per try.
    let mut last_txn: HashMap<(u64, u32), u32> = HashMap::new();
    for &(unit, try_no, txn) in in_history {
        let e = last_txn.entry((unit, try_no)).or_insert(txn);
        *e = (*e).max(txn);
    }
    for a in attempts {
        let acked = a.first_txn..a.first_txn + a.commits;
        c.mismatches += count(
            acked
                .clone()
                .filter(|&t| !in_history.contains(&(a.unit, a.try_no, t)))
                .count(),
        );
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

/// How the run recovered from `fault`: per row, the leases granted after it up to the row's
/// first committed write.
fn recovery(
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
    let mut after: Vec<&LeaseRecord> = leases.iter().filter(|l| l.at_ms >= fault.at_ms).collect();
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
    let until = last.unwrap_or(u64::MAX);
    let errors_before = attempts
        .iter()
        .filter(|a| a.started_ms >= fault.at_ms && a.started_ms <= until)
        .filter(|a| matches!(a.outcome, Outcome::Failed { .. }))
        .count();
    let acquire_errors_before = stats
        .acquire_error_at
        .iter()
        .filter(|&&t| t >= fault.at_ms && t <= until)
        .count();
    FaultRecovery {
        name: fault.name.clone(),
        at_ms: fault.at_ms,
        rows_recovered,
        rows,
        leases_to_recover: per_row.values().map(|e| e.0).sum(),
        max_leases_one_row: per_row.values().map(|e| e.0).max().unwrap_or(0),
        rejections_before_recovery: per_row.values().map(|e| e.1).sum(),
        errors_before_recovery: count(errors_before),
        acquire_errors_before_recovery: count(acquire_errors_before),
        first_write_ms: first.map(|t| t.saturating_sub(fault.at_ms)),
        recovery_ms: last.map(|t| t.saturating_sub(fault.at_ms)),
    }
}
