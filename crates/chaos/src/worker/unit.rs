//! One work unit: a lease's tries (retried while retryable, through an outage too), each
//! recorded as an [`Attempt`], what each try's result comes to ([`outcome`]), and the release.

use std::sync::atomic::Ordering;
use std::time::Duration;

use pgfence::{Error, Lease, issuer::ReleaseOutcome};
use rand::Rng;

use crate::faults::reset_counters;
use crate::util::millis;
use crate::{Attempt, BatchRows, LeaseRecord, Outcome, Stage};

use super::pause::Pause;
use super::script::{Script, ScriptKind};
use super::{Failure, Step, Try, Worker, classify};

impl Worker {
    /// One work unit with `lease`: maybe a counter reset, maybe a stall, the tries, the
    /// release.
    pub(super) async fn unit(&mut self, lease: &Lease, row: i32, unit: u64, asked_at_ms: u64) {
        let ctx = self.ctx.clone();
        let cfg = &ctx.cfg;
        let lease_at_ms = self.now();
        self.out.leases.push(LeaseRecord {
            unit,
            worker: self.id,
            row,
            token: lease.token().get(),
            asked_at_ms,
            at_ms: lease_at_ms,
        });
        if cfg.reset_counters_at.contains(&unit) {
            reset_counters(&ctx).await;
        }
        let script = ctx
            .plan
            .script
            .map(|kind| Script::draw(kind, &mut self.rng, cfg.coalesce));
        let batch_rows = if ctx.plan.script == Some(ScriptKind::Batch) {
            self.draw_batch_rows(row)
        } else {
            Vec::new()
        };
        let pause = self.pick_pause(script.as_ref().map(Script::len));
        let mut try_no = 0u32;
        let mut first_txn = 0u32;
        loop {
            let started_ms = self.now();
            let mut t = Try {
                ctx: &ctx,
                lease,
                row,
                unit,
                try_no,
                worker: self.id,
                pause: if try_no == 0 { pause } else { Pause::None },
                read: None,
                written: None,
                first_txn,
                commits: 0,
                believed: 0,
                applied: false,
                batch: BatchRows {
                    rows: batch_rows.clone(),
                    ..BatchRows::default()
                },
                claimed: Vec::new(),
                clock: self.started,
                begins: Vec::new(),
                calls: Vec::new(),
                library: Vec::new(),
                done_skip: false,
            };
            let result = match (&script, ctx.plan.effects) {
                (_, Some(keys)) => t.run_effects(keys).await,
                (Some(script), None) => t.run_script(script).await,
                (None, None) => t.run().await,
            };
            self.out.begins.append(&mut t.begins);
            self.out.calls.append(&mut t.calls);
            self.out.library.append(&mut t.library);
            self.out.stats.done_skips += u64::from(t.done_skip);
            let (outcome, stale) = outcome(result);
            // A batch try that went on with the rows it got may still have met a lost counter.
            let stale = stale.or_else(|| t.batch_rejection(None));
            // Through an outage (a database failover), a unit keeps retrying past `retries`.
            let outage = cfg
                .outage_retry
                .is_some_and(|d| self.now().saturating_sub(lease_at_ms) < millis(d));
            let retry = matches!(
                outcome,
                Outcome::Failed {
                    retryable: true,
                    ..
                }
            ) && (try_no < cfg.retries || outage)
                && !ctx.shared.done.load(Ordering::SeqCst);
            self.out.attempts.push(Attempt {
                unit,
                try_no,
                worker: self.id,
                row,
                token: lease.token().get(),
                lease_at_ms,
                started_ms,
                finished_ms: self.now(),
                paused_ms: millis(t.pause.length()),
                value_read: t.read,
                value_written: t.written,
                first_txn: t.first_txn,
                commits: t.commits,
                outcome,
                batch: (ctx.plan.script == Some(ScriptKind::Batch))
                    .then(|| std::mem::take(&mut t.batch)),
            });
            if let Some(err) = stale
                && cfg.recovery.recover_from
                && let Ok(true) = ctx.issuer.recover_from(&err).await
            {
                self.out.stats.counter_raises += 1;
            }
            if !retry {
                break;
            }
            self.out.stats.retries += 1;
            // A fenced-multi retry resumes at the transaction that failed (each one checks and
            // reads afresh); a row-claim retry claims again from the start (the claim reads
            // back whether the unit's increment landed).
            if ctx.plan.script == Some(ScriptKind::MultiCheck) {
                first_txn = t.first_txn + t.commits;
            }
            try_no += 1;
            let backoff = if try_no > cfg.retries {
                self.rng.random_range(20..60)
            } else {
                self.rng.random_range(5..25)
            };
            tokio::time::sleep(Duration::from_millis(backoff)).await;
        }
        match self.release(lease).await {
            Ok(ReleaseOutcome::AlreadyExpired) => self.out.stats.released_expired += 1,
            Ok(ReleaseOutcome::TakenByOther) => self.out.stats.released_taken += 1,
            Ok(ReleaseOutcome::Released) | Err(_) => {}
        }
    }
}

/// What a try's result comes to, and the rejection to recover from if it was one.
fn outcome(result: Step<()>) -> (Outcome, Option<Error>) {
    let (stage, error) = match result {
        Ok(()) => return (Outcome::Accepted, None),
        Err(Failure::Provider { error, retryable }) => {
            let failed = Outcome::Failed {
                stage: Stage::Call,
                retryable,
                error,
            };
            return (failed, None);
        }
        Err(Failure::Fence { stage, error }) => (stage, error),
    };
    // The rejections are fencing at work (and audited): a newer lease got there first, or
    // the counter went backwards and another lease already presented this token, or a
    // lease-less writer bypassed the guard on the row after this lease wrote it (sealed: it
    // must not write its stale picture of the row back; nothing to recover).
    // Or the database failed over since the lease's first statement (fenced out whatever
    // its rows say; nothing to recover either: the counter is not behind).
    let rejected = match &error {
        Error::StaleToken { current, .. } => Some((*current, false, false, false)),
        Error::DuplicateToken { token, .. } => Some((*token, true, false, false)),
        Error::RowSealed { token, .. } => Some((*token, false, true, false)),
        Error::FencedByFailover { presented, .. } => Some((*presented, false, false, true)),
        _ => None,
    };
    match rejected {
        Some((current, duplicate, sealed, failover)) => {
            let by = match stage {
                Stage::Check => "check",
                Stage::Claim => "claim",
                Stage::Effect => "effect",
                Stage::Finish => "effect_finish",
                _ => "update",
            };
            let rejected = Outcome::Rejected {
                current,
                by,
                duplicate,
                sealed,
                failover,
            };
            (rejected, (!sealed && !failover).then_some(error))
        }
        None => {
            let failed = Outcome::Failed {
                stage,
                retryable: error.is_retryable(),
                error: classify(&error),
            };
            (failed, None)
        }
    }
}
