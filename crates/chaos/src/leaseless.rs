//! Leaseless mode's lease-less writers: next to the workers' leases, they write the same rows
//! without a lease — a raw `fence = fence + 1` (which the guard must refuse) or an audited
//! bypass (which goes through and seals the row) — recording every write, and the history row
//! of each that went through in its transaction.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use pgfence::Error;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::time::Instant;

use crate::harness::Ctx;
use crate::schema::{RECORD_LEASELESS_SQL, WRITE_BYPASS, WRITE_FENCE_PLUS_ONE};
use crate::util::millis;
use crate::worker::classify;
use crate::{LeaselessAttempt, LeaselessKind, LeaselessOutcome};

/// The `unit` of lease-less writes' history rows starts here, above every lease's unit.
pub(crate) const LEASELESS_UNIT_BASE: u64 = 1 << 40;

/// The bypass's reason (audited with each bypassed row).
const BYPASS_REASON: &str = "chaos: lease-less writer";

/// One lease-less writer: until the workers stop, waits a random pause (mean
/// [`Config::leaseless_every`](crate::Config::leaseless_every)), picks a row and writes it —
/// a bypass with probability [`Config::bypass_share`](crate::Config::bypass_share), else a
/// raw `fence = fence + 1`.
pub(crate) async fn leaseless_writer(
    writer: usize,
    ctx: Arc<Ctx>,
    ids: Arc<AtomicU64>,
    started: Instant,
) -> Vec<LeaselessAttempt> {
    let salt = u64::try_from(writer)
        .unwrap_or(0)
        .wrapping_add(1)
        .wrapping_mul(0xd1b5_4a32_d192_ed03);
    let mut rng = StdRng::seed_from_u64(ctx.cfg.seed ^ salt);
    let rows = i32::try_from(ctx.cfg.rows).unwrap_or(i32::MAX);
    let mean = millis(ctx.cfg.leaseless_every).max(1);
    let mut out = Vec::new();
    while !ctx.shared.done.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..=2 * mean))).await;
        if ctx.shared.done.load(Ordering::SeqCst) {
            break;
        }
        let row = rng.random_range(0..rows);
        let kind = if rng.random_bool(ctx.cfg.bypass_share) {
            LeaselessKind::Bypass
        } else {
            LeaselessKind::FencePlusOne
        };
        let id = LEASELESS_UNIT_BASE + ids.fetch_add(1, Ordering::SeqCst);
        let started_ms = millis(started.elapsed());
        let outcome = match write(&ctx, id, writer, row, kind).await {
            Ok(()) => LeaselessOutcome::Applied,
            Err((stage, error)) => failure(stage, &error),
        };
        out.push(LeaselessAttempt {
            id,
            writer,
            row,
            kind,
            started_ms,
            finished_ms: millis(started.elapsed()),
            outcome,
        });
    }
    out
}

/// One lease-less write and its history row, in one transaction.
async fn write(
    ctx: &Ctx,
    id: u64,
    writer: usize,
    row: i32,
    kind: LeaselessKind,
) -> Result<(), (&'static str, Error)> {
    let db = |stage: &'static str| move |e: sqlx::Error| (stage, Error::from(e));
    let mut tx = ctx.pool.begin().await.map_err(db("begin"))?;
    let sql = match kind {
        LeaselessKind::Bypass => {
            if let Some(role) = &ctx.bypass_role {
                sqlx::query(sqlx::AssertSqlSafe(format!("SET LOCAL ROLE {role}")))
                    .execute(&mut *tx)
                    .await
                    .map_err(db("begin"))?;
            }
            pgfence::guard::bypass(&mut tx, BYPASS_REASON)
                .await
                .map_err(|e| ("begin", e))?;
            WRITE_BYPASS
        }
        LeaselessKind::FencePlusOne => WRITE_FENCE_PLUS_ONE,
    };
    sqlx::query(sql)
        .bind(ctx.run.as_str())
        .bind(row)
        .execute(&mut *tx)
        .await
        .map_err(db("write"))?;
    sqlx::query(RECORD_LEASELESS_SQL)
        .bind(ctx.run.as_str())
        .bind(row)
        .bind(i64::try_from(id).unwrap_or(i64::MAX))
        .bind(i32::try_from(writer).unwrap_or(i32::MAX))
        .bind(kind.as_str())
        .execute(&mut *tx)
        .await
        .map_err(db("record"))?;
    tx.commit().await.map_err(db("commit"))?;
    Ok(())
}

/// A failed lease-less write: refused by the guard (nothing written), or another failure.
fn failure(stage: &'static str, error: &Error) -> LeaselessOutcome {
    let code = match error {
        Error::LeaselessWrite { .. } => Some("PF007"),
        Error::StaleToken { .. } => Some("PF001"),
        Error::BypassRefused { .. } => Some("PF006"),
        Error::RowSealed { .. } => Some("PF005"),
        Error::DuplicateToken { .. } => Some("PF004"),
        _ => None,
    };
    match code {
        Some(code) if stage == "write" => LeaselessOutcome::Refused {
            code: code.to_owned(),
        },
        _ => LeaselessOutcome::Failed {
            stage,
            retryable: error.is_retryable(),
            error: classify(error),
        },
    }
}
