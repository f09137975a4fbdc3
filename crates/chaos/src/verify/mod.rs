//! The checks after a run: the client-side history against what Postgres committed.
//!
//! Ground truth is the `history` table, whose rows commit with the writes they describe, in
//! each row's commit (version) order. From it: token order, all-or-nothing (version gaps),
//! lost updates and stale reads per row; acknowledgement mismatches per attempt; recovery per
//! fault.
//!
//! [`verify`] reads the history back and puts the [`Summary`] together; the checks live by
//! concern: [`rows`] (per-row: token order, torn and lost writes, stale reads), [`attempts`]
//! (what each try was told against what committed), [`recovery`] (per fault); and by mode:
//! [`batch`], [`effects`], [`leaseless`], [`failover`] (an issuer failover) and
//! [`pg_failover`] (a failover of the protected database).

use std::collections::{BTreeMap, HashMap, HashSet};

use sqlx::{PgPool, Row};

use pgfence::issuer::IssuerKind;

use crate::faults::Kills;
use crate::nemesis::{NemesisEvent, NemesisFigures};
use crate::report::{ErrorKind, FaultRecovery, Report, Summary};
use crate::schema::{CounterTable, is_leaseless};
use crate::util::count;
use crate::worker::{Stats, WorkerOut};
use crate::{
    AuditTally, ChaosError, Config, FailoverEvent, FaultMark, LeaselessAttempt, Mode,
    PgFailoverEvent,
};

mod attempts;
mod batch;
mod effects;
mod failover;
mod leaseless;
mod pg_failover;
mod recovery;
mod rows;

use attempts::check_attempts;
use batch::batch_figures;
use effects::{Seen, effect_figures, ledger_items};
use failover::{Around, failover_figures};
use leaseless::{bypass_audit_rows, leaseless_figures};
use pg_failover::{PgSeen, pg_failover_figures};
use recovery::{recovery, recovery_batch};
use rows::check_rows;

pub(crate) use failover::FAILOVER;
pub(crate) use pg_failover::PG_FAILOVER;

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
    /// With `--coalesce`: what the coalescers did.
    pub(crate) coalescer: Option<pgfence::repository::CoalescerStats>,
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
    // A row the library wrote again after its first one's COMMIT got no answer may repeat
    // that first one (it says so at the end of `reason`): counted once, as the one rejection
    // it is. Every other row counts (a NULL `reason` included: hence the coalesce).
    let (audit_rows, audit_rows_rewritten): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE NOT (coalesce(right(a.reason, length($2)) = $2, false) \
                    AND EXISTS ( \
                    SELECT 1 FROM pgfence.audit b \
                    WHERE b.id < a.id AND b.resource = a.resource \
                      AND b.row_key IS NOT DISTINCT FROM a.row_key \
                      AND b.presented = a.presented \
                      AND b.current IS NOT DISTINCT FROM a.current \
                      AND b.operation = a.operation))), \
                count(*) FILTER (WHERE right(a.reason, length($2)) = $2) \
         FROM pgfence.audit a WHERE left(a.resource, length($1)) = $1",
    )
    .bind(id.resource_prefix)
    .bind(pgfence::audit::REWRITTEN_IN_DOUBT)
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
        audit_rows_rewritten: u64::try_from(audit_rows_rewritten).unwrap_or(0),
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
        coalescer: output.coalescer.map(Into::into),
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
