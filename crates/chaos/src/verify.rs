//! The checks after a run: the client-side history against what Postgres committed.
//!
//! Ground truth is the `history` table, whose rows commit with the writes they describe, in
//! each row's commit (version) order. From it: token order, all-or-nothing (version gaps),
//! lost updates and stale reads per row; acknowledgement mismatches per attempt; recovery per
//! fault.

use std::collections::{BTreeMap, HashMap, HashSet};

use sqlx::{PgPool, Row};

use pgfence::issuer::IssuerKind;

use crate::faults::Kills;
use crate::nemesis::{NemesisEvent, NemesisFigures};
use crate::report::{
    BatchFigures, EffectFigures, ErrorKind, FailoverFigures, FaultRecovery, LeaselessFigures,
    PgFailoverFigures, Report, Summary,
};
use crate::schema::{CounterTable, Kind, is_leaseless};
use crate::util::count;
use crate::worker::{BeginRecord, CallAnswer, CallRecord, Stats, WorkerOut, invoice_item};
use crate::{
    Attempt, AuditTally, ChaosError, Config, FailoverEvent, FaultMark, LeaseRecord,
    LeaselessAttempt, LeaselessKind, LeaselessOutcome, Mode, Outcome, PgFailoverEvent, RowResult,
    Stage,
};

/// What the run produced on the client side, handed to [`verify`].
pub(crate) struct RunOutput {
    /// One per worker.
    pub(crate) workers: Vec<WorkerOut>,
    /// Faults, in order.
    pub(crate) faults: Vec<FaultMark>,
    /// The issuer failover's details, if one was recorded.
    pub(crate) failover: Option<FailoverEvent>,
    /// The database failover's details, if one was recorded.
    pub(crate) pg_failover: Option<PgFailoverEvent>,
    /// Backends terminated.
    pub(crate) kills: Kills,
    /// Wall-clock duration.
    pub(crate) duration_ms: u64,
    /// Audit events counted during the run.
    pub(crate) audit: AuditTally,
    /// Reseeds counted during the run, if counted.
    pub(crate) reseeds: Option<u64>,
    /// Effects modes: what the payment provider did.
    pub(crate) provider: Option<ProviderTally>,
    /// Leaseless mode: every lease-less write.
    pub(crate) leaseless: Vec<LeaselessAttempt>,
    /// Nemesis actions (partitions, clock steps), in order.
    pub(crate) nemesis: Vec<NemesisEvent>,
    /// Partition groups (0: no partitions).
    pub(crate) partition_groups: usize,
}

/// What the effects modes' payment provider counted, once every call had returned.
pub(crate) struct ProviderTally {
    pub(crate) requests: u64,
    pub(crate) replays: u64,
    pub(crate) conflicts: u64,
    /// Charges made, per item.
    pub(crate) charges: HashMap<String, u64>,
}

/// The run being verified.
pub(crate) struct RunId<'a> {
    /// Its configuration.
    pub(crate) cfg: &'a Config,
    /// Its issuer.
    pub(crate) issuer: IssuerKind,
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

impl Committed {
    /// A lease-less write's (a bypass, or a `fence + 1` the guard let through): no lease.
    fn is_leaseless(&self) -> bool {
        is_leaseless(&self.kind)
    }
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
    let final_values: Vec<(i32, i64)> = rows.iter().map(|r| (r.id, r.value)).collect();
    // The leases' statements (the lease-less writes' rows are checked on their own).
    let in_history: HashSet<(u64, u32, u32)> = committed
        .values()
        .flatten()
        .filter(|w| !w.is_leaseless())
        .map(|w| (w.unit, w.try_no, w.txn))
        .collect();
    let tries_committed: HashSet<(u64, u32)> = in_history.iter().map(|&(u, t, _)| (u, t)).collect();

    let mut attempts = Vec::new();
    let mut leases = Vec::new();
    let mut stats = Stats::default();
    let mut begins = Vec::new();
    let mut calls = Vec::new();
    let mut library_calls = Vec::new();
    for out in output.workers {
        library_calls.extend(out.library);
        attempts.extend(out.attempts);
        leases.extend(out.leases);
        stats.add(&out.stats);
        begins.extend(out.begins);
        calls.extend(out.calls);
    }
    let effects = match &output.provider {
        Some(provider) => {
            let ledger = ledger_items(admin, id.resource_prefix).await?;
            let seen = Seen {
                begins: &begins,
                calls: &calls,
                stats: &stats,
            };
            Some(effect_figures(cfg, &rows, &ledger, provider, &seen))
        }
        None => None,
    };
    // After a database failover, acknowledged transactions of tries that started before the
    // promotion may be missing: the database lost them (not a mismatch).
    let lost_before = output.pg_failover.as_ref().map(|e| e.promoted_at_ms);
    let acks = check_attempts(&attempts, &in_history, lost_before);
    let leaseless = if cfg.mode == Mode::LeaselessMix {
        let audit_rows = bypass_audit_rows(admin, id.run).await?;
        Some(leaseless_figures(
            cfg,
            &output.leaseless,
            &attempts,
            &committed,
            &row_checks,
            audit_rows,
        ))
    } else {
        None
    };
    let leaseless_violations = leaseless
        .as_ref()
        .map_or(0, |l| l.fence_plus_one_accepted + l.sealed_writes);
    let ack_mismatches = acks.mismatches + leaseless.as_ref().map_or(0, |l| l.ack_mismatches);
    let mut kinds = acks.kinds;
    for ((kind, retryable), n) in &stats.acquire_error_kinds {
        *kinds
            .entry((format!("acquire: {kind}"), *retryable))
            .or_default() += n;
    }
    let fault_recovery: Vec<FaultRecovery> = output
        .faults
        .iter()
        .map(|f| match cfg.mode {
            Mode::Batch => recovery_batch(f, cfg.rows, &attempts, &leases, &committed, &stats),
            _ => recovery(f, cfg.rows, &attempts, &leases, &tries_committed, &stats),
        })
        .collect();
    let failover = output
        .faults
        .iter()
        .zip(&fault_recovery)
        .find(|(f, _)| f.name == FAILOVER)
        .map(|(f, r)| {
            let around = Around {
                fault: f,
                event: output.failover.as_ref(),
                issuer: id.issuer,
                recovery: r,
            };
            failover_figures(&around, &leases, &attempts, &committed)
        });
    // In batch mode a rejection is a row: each rejected row is audited and logged on its own.
    let batch = (cfg.mode == Mode::Batch).then(|| batch_figures(&attempts, &committed));
    let rejected = match &batch {
        Some(b) => b.rows_rejected_at_claim + b.rows_rejected_at_write,
        None => acks.rejected,
    };
    let pg_failover = output.pg_failover.as_ref().map(|event| {
        let recovery = output
            .faults
            .iter()
            .zip(&fault_recovery)
            .find(|(f, _)| f.name == PG_FAILOVER)
            .map(|(_, r)| r);
        let reported = u64::try_from(audit_rows).unwrap_or(0) + output.audit.audit_failures;
        let seen = PgSeen {
            event,
            issuer: id.issuer,
            recovery,
            lost: &acks.db_lost,
            audit_rows_lost: rejected.saturating_sub(reported),
        };
        pg_failover_figures(&seen, &attempts, &committed)
    });
    let zombie_writes = pg_failover.as_ref().map_or(0, |p| p.zombie_writes);

    let summary = Summary {
        run: id.run.to_owned(),
        mode: cfg.mode,
        issuer: id.issuer.name().to_owned(),
        workers: cfg.workers,
        rows: cfg.rows,
        units: count(leases.len()),
        attempts: count(attempts.len()),
        accepted: count(
            committed
                .values()
                .flatten()
                .filter(|w| !w.is_leaseless())
                .count(),
        ),
        increments: row_checks.increments,
        units_incremented: row_checks.units_incremented,
        repeated_increments: row_checks.repeated_increments,
        acknowledged: acks.acknowledged,
        rejected,
        errors: acks.errors,
        retryable_errors: acks.retryable_errors,
        retries: stats.retries,
        violations: row_checks.token_order
            + ack_mismatches
            + row_checks.torn
            + leaseless_violations
            + zombie_writes,
        token_order_violations: row_checks.token_order,
        ack_mismatches,
        torn_writes: row_checks.torn,
        lost_updates: row_checks.lost,
        stale_reads: row_checks.stale_reads,
        audit_rows: u64::try_from(audit_rows).unwrap_or(0),
        log_events: output.audit.rejections,
        audit_failures: output.audit.audit_failures,
        reseed_events: output.reseeds,
        counter_raises: stats.counter_raises,
        pauses: stats.pauses,
        backend_kills: output.kills.workers + output.kills.issuer,
        issuer_backend_kills: output.kills.issuer,
        issuer_kills_mid_statement: output.kills.issuer_mid_statement,
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
        batch,
        effects,
        leaseless,
        failover,
        pg_failover,
        nemesis: NemesisFigures::of(output.partition_groups, &output.nemesis),
    };
    Ok(Report {
        summary,
        attempts,
        leases,
        leaseless: output.leaseless,
        faults: output.faults,
        nemesis: output.nemesis,
        final_values,
        calls: library_calls,
    })
}

/// Leaseless mode: the audit rows of the run's bypasses (operation `bypass`, on the guarded
/// counter table, keyed by the run's rows: the trigger writes the key as `["<run>", <id>]`).
async fn bypass_audit_rows(admin: &PgPool, run: &str) -> Result<u64, ChaosError> {
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
fn leaseless_figures(
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

/// Effects modes: one work item as the ledger has it.
struct LedgerItem {
    work_key: String,
    state: String,
    holders: i32,
}

/// Effects modes: the ledger's charges for the run's resources.
async fn ledger_items(
    admin: &PgPool,
    resource_prefix: &str,
) -> Result<Vec<LedgerItem>, ChaosError> {
    let rows = sqlx::query(
        "SELECT work_key, state, holders FROM pgfence.effect \
          WHERE left(resource, length($1)) = $1 AND step = $2",
    )
    .bind(resource_prefix)
    .bind(crate::worker::CHARGE_STEP)
    .fetch_all(admin)
    .await?;
    rows.iter()
        .map(|r| {
            Ok(LedgerItem {
                work_key: r.try_get("work_key")?,
                state: r.try_get("state")?,
                holders: r.try_get("holders")?,
            })
        })
        .collect()
}

/// Effects modes: what the workers recorded of the job's side effect.
struct Seen<'a> {
    begins: &'a [BeginRecord],
    calls: &'a [CallRecord],
    stats: &'a Stats,
}

/// Effects modes: the charges' figures, from the provider's counts, the ledger, the rows'
/// final values (invoices paid) and the workers' calls.
fn effect_figures(
    cfg: &Config,
    rows: &[FinalRow],
    ledger: &[LedgerItem],
    provider: &ProviderTally,
    seen: &Seen<'_>,
) -> EffectFigures {
    let paid: HashSet<String> = rows
        .iter()
        .flat_map(|r| (0..r.value.max(0)).map(move |n| invoice_item(r.id, n)))
        .collect();
    let in_ledger: HashSet<&str> = ledger.iter().map(|e| e.work_key.as_str()).collect();
    let charged = |item: &str| provider.charges.get(item).copied().unwrap_or(0);
    let mut duplicate_items: Vec<(String, u64)> = provider
        .charges
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(item, n)| (item.clone(), *n))
        .collect();
    duplicate_items.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let duplicate_effects = count(duplicate_items.len());
    let extra_charges = duplicate_items.iter().map(|(_, n)| n - 1).sum();
    duplicate_items.truncate(10);

    // A late call: a lease calls for an item after a newer lease's begin of it had returned.
    let mut begun: HashMap<&str, Vec<(i64, u64)>> = HashMap::new();
    for b in seen.begins {
        begun
            .entry(b.item.as_str())
            .or_default()
            .push((b.token, b.at_ms));
    }
    let (mut late, mut late_dedup, mut late_charged) = (0u64, 0u64, 0u64);
    let mut answers: HashMap<CallAnswer, u64> = HashMap::new();
    for c in seen.calls {
        *answers.entry(c.answer).or_default() += 1;
        let is_late = begun.get(c.item.as_str()).is_some_and(|bs| {
            bs.iter()
                .any(|&(token, at)| token > c.token && at < c.started_ms)
        });
        if is_late {
            late += 1;
            match c.answer {
                CallAnswer::Replayed | CallAnswer::Conflict => late_dedup += 1,
                CallAnswer::Charged => late_charged += 1,
                CallAnswer::Status(_) | CallAnswer::NoAnswer => {}
            }
        }
    }
    let answered = |a: CallAnswer| answers.get(&a).copied().unwrap_or(0);
    let calls = count(seen.calls.len());
    let ok = answered(CallAnswer::Charged)
        + answered(CallAnswer::Replayed)
        + answered(CallAnswer::Conflict);
    EffectFigures {
        keys: if cfg.mode == Mode::Effects {
            "ledger"
        } else {
            "per-lease"
        }
        .to_owned(),
        provider_latency_ms: crate::util::millis(cfg.provider_latency),
        items: count(ledger.len()),
        items_taken_over: count(ledger.iter().filter(|e| e.holders > 1).count()),
        takeovers: ledger
            .iter()
            .map(|e| u64::try_from(e.holders - 1).unwrap_or(0))
            .sum(),
        items_succeeded: count(ledger.iter().filter(|e| e.state == "succeeded").count()),
        invoices_paid: count(paid.len()),
        stalls_before_call: seen.stats.stalls_before_call,
        calls,
        calls_charged: answered(CallAnswer::Charged),
        calls_replayed: answered(CallAnswer::Replayed),
        calls_conflict: answered(CallAnswer::Conflict),
        calls_failed: calls - ok,
        late_calls: late,
        late_calls_deduplicated: late_dedup,
        late_calls_charged: late_charged,
        done_skips: seen.stats.done_skips,
        provider_requests: provider.requests,
        provider_charges: provider.charges.values().sum(),
        provider_replays: provider.replays,
        provider_conflicts: provider.conflicts,
        duplicate_effects,
        extra_charges,
        paid_uncharged: count(paid.iter().filter(|i| charged(i) == 0).count()),
        charged_unpaid: count(
            provider
                .charges
                .keys()
                .filter(|i| !paid.contains(*i))
                .count(),
        ),
        begun_uncharged: count(in_ledger.iter().filter(|i| charged(i) == 0).count()),
        stray_charges: count(
            provider
                .charges
                .keys()
                .filter(|i| !in_ledger.contains(i.as_str()))
                .count(),
        ),
        duplicate_items,
    }
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
    /// Accepted lease writes whose token was older than the previous lease write's, or the
    /// same from another lease (lease-less writes have no token to order).
    token_order: u64,
    /// Lease writes right after a bypass by the lease that wrote the row before it: the seal
    /// must have stopped them.
    sealed_writes: u64,
    /// Version gaps, and row versions without their history row.
    torn: u64,
    /// Committed increments (the leases' and the lease-less writes') minus final value, summed.
    lost: u64,
    /// Of those, lease-less increments (bypasses): committed, but not in the final value.
    lost_leaseless: u64,
    /// Recorded statements that did not read the previous one's value, or changed it by other
    /// than their kind says (one for an increment, nothing for a claim or a rewrite).
    stale_reads: u64,
    /// Committed increments of the leases.
    increments: u64,
    /// Units with at least one committed increment.
    units_incremented: u64,
    /// Committed increments beyond a unit's first (per transaction in fenced-multi, per row in
    /// batch mode): a retry after a lost commit acknowledgement that did not know its increment
    /// had landed.
    repeated_increments: u64,
}

fn check_rows(
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

/// The name of the fault a failover of the harness's own PostgreSQL is marked with (at the
/// promotion).
pub(crate) const PG_FAILOVER: &str = "pg_failover";

/// What [`pg_failover_figures`] works from besides the history.
struct PgSeen<'a> {
    event: &'a PgFailoverEvent,
    issuer: IssuerKind,
    /// The recovery measured from the `pg_failover` mark.
    recovery: Option<&'a FaultRecovery>,
    /// Acknowledged transactions the database lost: `(unit, try, txn)`.
    lost: &'a [(u64, u32, u32)],
    /// Rejections with neither an audit row nor an audit-failure event.
    audit_rows_lost: u64,
}

/// The database failover's figures: what it lost, whom fencing refused, and whether a lease
/// from before it got a write in after it (a zombie).
///
/// A lease counts as from before the kill when a try of it that started before the old
/// primary was gone had a statement acknowledged (it read, committed, or was rejected by the
/// database). A statement of such a lease in the new primary's history, from a try that
/// started after the old primary was gone (nothing commits between then and the promotion),
/// is a zombie write.
fn pg_failover_figures(
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

/// What the attempts say, compared with what committed.
#[derive(Default)]
struct AttemptChecks {
    /// Outcomes that contradict the history.
    mismatches: u64,
    /// After a database failover: transactions acknowledged in tries that started before the
    /// promotion and missing from the new primary — lost by the database, `(unit, try, txn)`.
    db_lost: Vec<(u64, u32, u32)>,
    acknowledged: u64,
    rejected: u64,
    errors: u64,
    retryable_errors: u64,
    /// Failures by (classification, retryable).
    kinds: BTreeMap<(String, bool), u64>,
}

/// Checks each try's transactions against the history (every transaction records at least one
/// statement): the ones acknowledged committed; the one that failed committed only if it failed
/// in `COMMIT`; none after it ran. With `lost_before` (a database failover's promotion time),
/// an acknowledged transaction missing from the history of a try that started before it is
/// counted as lost by the database instead.
fn check_attempts(
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

/// Batch mode: the rows' figures, from the tries' per-row outcomes and the history.
fn batch_figures(attempts: &[Attempt], committed: &BTreeMap<i32, Vec<Committed>>) -> BatchFigures {
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

/// Batch mode: how the run recovered from `fault`, per counter row: the leases granted after
/// it whose batches included the row, up to the one whose write of the row committed first.
///
/// For a fault that loses the token counters (`counter_reset`, `redis_restart`) recovery is
/// measured from the counter loss as the workers met it: the first lease granted after the
/// mark whose token is below one already issued for its group (`at_ms` is that lease's time).
/// A Redis restart goes down a little after its mark, and a batch covers so many rows that the
/// leases granted in between could otherwise count every row as recovered before any counter
/// was lost.
fn recovery_batch(
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

/// The name of the fault mark of an issuer failover.
pub(crate) const FAILOVER: &str = "failover";

/// An issuer failover: its mark, what its causer recorded, and the recovery measured from it.
struct Around<'a> {
    fault: &'a FaultMark,
    event: Option<&'a FailoverEvent>,
    issuer: IssuerKind,
    recovery: &'a FaultRecovery,
}

/// The tokens and writes on either side of a failover: leases granted before its mark (taken
/// once the old leader was dead) against leases asked for after it (so none of those can come
/// from the old leader) and, for Redis, granted after it.
fn failover_figures(
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
