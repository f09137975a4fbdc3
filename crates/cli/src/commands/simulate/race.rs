//! The scenario: two workers, one lock, one row. A pauses past its lease; B takes the lock and
//! writes; A wakes and writes too.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use pgfence::{Error, FenceToken, Issuer, Lease, LeaseState, Repository, Resource, TableName};
use sqlx::{AssertSqlSafe, PgPool};

use super::events::{Recorder, What};

/// A row of the demo table, whose name is chosen at run time.
pub struct DemoRow {
    batch: String,
    paid_by: String,
    amount: i64,
}

// The demo's table name is random; `Repository::for_table` supplies it.
pgfence::fenced_table!(DemoRow {
    table: "pgfence_demo",
    key: batch: String,
    columns: [paid_by, amount],
});

/// Everything the two workers share.
pub struct Stage {
    /// The demo database.
    pub pool: PgPool,
    /// The lock issuer.
    pub issuer: Issuer,
    /// Redis, for cleaning up the demo's keys.
    pub redis_url: String,
    /// The demo's lock.
    pub resource: Resource,
    /// The demo table.
    pub table: TableName,
    /// Whether writes are fenced (the table guarded).
    pub fenced: bool,
    /// The fenced writer, when `fenced`.
    pub repo: Option<Repository<DemoRow>>,
    /// Where the workers record what they do.
    pub rec: Recorder,
}

/// Runs both workers; returns (A's token, B's token).
pub async fn race(stage: Arc<Stage>, ttl: Duration, pause: Duration) -> Result<(i64, i64)> {
    let a = {
        let stage = stage.clone();
        tokio::spawn(async move { worker_a(&stage, ttl, pause).await })
    };
    let b = {
        let stage = stage.clone();
        tokio::spawn(async move { worker_b(&stage, ttl, pause).await })
    };
    let a_token = a.await.context("worker A panicked")??;
    let b_token = b.await.context("worker B panicked")??;
    Ok((a_token, b_token))
}

/// Takes the lock, reads, pauses past the TTL, wakes and writes anyway.
async fn worker_a(stage: &Stage, ttl: Duration, pause: Duration) -> Result<i64> {
    let rec = &stage.rec;
    let acquired_at = rec.t0.elapsed();
    let lease = stage
        .issuer
        .acquire(&stage.resource, ttl)
        .await?
        .context("worker A could not take the lock")?;
    rec.record(
        'A',
        What::Acquired {
            token: lease.token().get(),
            ttl,
        },
    );
    rec.record_at(acquired_at + ttl, '-', What::Expired);
    let paid_by = read(stage).await?;
    rec.record('A', What::Read { paid_by });
    rec.record('A', What::Pause(pause));
    tokio::time::sleep(pause).await;
    rec.record('A', What::Wake);
    write(stage, 'A', &lease).await?;
    let state = stage.issuer.release(&lease).await?;
    rec.record('A', What::Released(release_word(state)));
    Ok(lease.token().get())
}

/// Queues for the lock behind A, gets it once A's lease expires, reads and writes.
async fn worker_b(stage: &Stage, ttl: Duration, pause: Duration) -> Result<i64> {
    let rec = &stage.rec;
    // Let A go first; then queue for the lock like a second job instance would.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let lease = stage
        .issuer
        .acquire_wait(&stage.resource, ttl.max(pause), pause * 2)
        .await?
        .context("worker B never got the lock")?;
    rec.record(
        'B',
        What::Acquired {
            token: lease.token().get(),
            ttl: ttl.max(pause),
        },
    );
    let paid_by = read(stage).await?;
    rec.record('B', What::Read { paid_by });
    write(stage, 'B', &lease).await?;
    let state = stage.issuer.release(&lease).await?;
    rec.record('B', What::Released(release_word(state)));
    Ok(lease.token().get())
}

/// What a release answered, in words.
fn release_word(state: LeaseState) -> &'static str {
    match state {
        LeaseState::Held => "released the lock",
        LeaseState::Expired => "release: the lock had expired",
        LeaseState::Taken => "release refused: another holder has the lock",
    }
}

/// Who the demo row says paid.
async fn read(stage: &Stage) -> Result<String> {
    let sql = format!(
        "SELECT paid_by FROM {} WHERE batch = 'batch-42'",
        stage.table.quoted()
    );
    Ok(sqlx::query_scalar(AssertSqlSafe(sql))
        .fetch_one(&stage.pool)
        .await?)
}

/// Writes `paid_by = actor`: fenced through the repository, or a plain `UPDATE`.
async fn write(stage: &Stage, actor: char, lease: &Lease) -> Result<()> {
    let row = DemoRow {
        batch: "batch-42".into(),
        paid_by: actor.to_string(),
        amount: 100,
    };
    let rec = &stage.rec;
    if let (true, Some(repo)) = (stage.fenced, &stage.repo) {
        match repo.update(&stage.pool, lease, &row).await {
            Ok(()) => rec.record(
                actor,
                What::Write {
                    token: Some(lease.token().get()),
                    applied: true,
                    detail: "applied".into(),
                },
            ),
            Err(Error::StaleToken {
                presented, current, ..
            }) => rec.record(
                actor,
                What::Write {
                    token: Some(presented),
                    applied: false,
                    detail: format!(
                        "REJECTED: stale token (presented {presented}, current {current})"
                    ),
                },
            ),
            Err(e) => return Err(e.into()),
        }
    } else {
        let sql = format!(
            "UPDATE {} SET paid_by = $1, amount = $2 WHERE batch = 'batch-42'",
            stage.table.quoted()
        );
        sqlx::query(AssertSqlSafe(sql))
            .bind(&row.paid_by)
            .bind(row.amount)
            .execute(&stage.pool)
            .await?;
        rec.record(
            actor,
            What::Write {
                token: None,
                applied: true,
                detail: "applied (no fence to check)".into(),
            },
        );
    }
    Ok(())
}

/// The demo row once the race is over: who paid, and the token its fence was written with
/// (0 when unfenced). A stored fence also packs the holder's tag and a write sequence; the
/// story is told in tokens.
pub async fn final_row(stage: &Stage) -> Result<(String, i64)> {
    let (paid_by, fence): (String, i64) = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT paid_by, {} FROM {} WHERE batch = 'batch-42'",
        if stage.fenced { "fence" } else { "0::bigint" },
        stage.table.quoted()
    )))
    .fetch_one(&stage.pool)
    .await?;
    Ok((paid_by, FenceToken::of_fence(fence)))
}
