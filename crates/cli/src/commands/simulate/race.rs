//! The scenario: two workers run the same billing job on one row under one lock: claim the
//! row, write step 1 (`processing`), record the charge in the effect ledger, call the payment
//! provider, write step 2 (`paid`). A claims the row, writes step 1, records the charge and
//! pauses — right before its provider call — past its lease; B takes the lock, claims the row,
//! writes step 1, records the charge (the same idempotency key) and calls the provider; A wakes
//! and makes its call; B writes step 2 under the same lease. Fenced, A's call carries B's key
//! (the provider charges once) and A's step 2 is rejected, while B's second write is applied;
//! unfenced (no ledger, no key), the provider charges twice and A overwrites B's writes.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use pgfence::{
    Effects, Error, FenceToken, Lease, Repository, Resource, TokenIssuer, effect::EffectOutcome,
    issuer::ReleaseOutcome, table::TableName,
};
use pgfence_testkit::Provider;
use sqlx::{AssertSqlSafe, PgPool};
use tokio::sync::Notify;

use super::events::{Recorder, What};

/// The demo row's key.
const BATCH: &str = "batch-42";

/// How long a worker waits at most for the other worker's step it must follow.
const CUE_WAIT: Duration = Duration::from_secs(10);

/// A row of the demo table, whose name is chosen at run time.
#[derive(Clone, sqlx::FromRow)]
pub struct DemoRow {
    batch: String,
    status: String,
    paid_by: String,
}

impl DemoRow {
    /// A row of the demo table.
    pub fn new(batch: &str, status: &str, paid_by: &str) -> Self {
        Self {
            batch: batch.to_owned(),
            status: status.to_owned(),
            paid_by: paid_by.to_owned(),
        }
    }
}

// The demo's table name is random; `Repository::for_table` supplies it.
pgfence::fenced_table!(DemoRow {
    table: "pgfence_demo",
    key: batch: String,
    columns: [status, paid_by],
});

/// Everything the two workers share.
pub struct Stage {
    /// The demo database.
    pub pool: PgPool,
    /// The lock issuer (Redis unless `--issuer-url` names another).
    pub issuer: Arc<dyn TokenIssuer>,
    /// Redis and the demo's keys there, for cleaning up (Redis issuers only).
    pub redis_keys: Option<(String, Vec<String>)>,
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
    /// The fake payment provider (honours `Idempotency-Key`), on loopback.
    pub provider: Provider,
    /// The effect ledger, when `fenced`.
    pub effects: Option<Effects>,
}

/// The points where one worker's step must follow the other's. The timing is real and
/// normally orders the steps by itself; a worker also waits (at most [`CUE_WAIT`]) for the
/// step it must follow, so a loaded machine, or a `--pause` barely longer than `--ttl`, cannot
/// reorder the story.
#[derive(Default)]
struct Cues {
    /// B has called the provider (A's late call comes after it).
    b_called: Notify,
    /// A has tried its step 2 (B's step 2 comes after it, fenced).
    a_second: Notify,
    /// B has written step 2 (an unfenced A's step 2 comes after it).
    b_second: Notify,
}

/// Waits for `cue`, or [`CUE_WAIT`] if it never comes (the other worker failed).
async fn after(cue: &Notify) {
    let _ = tokio::time::timeout(CUE_WAIT, cue.notified()).await;
}

/// Runs both workers; returns (A's token, B's token).
pub async fn race(stage: Arc<Stage>, ttl: Duration, pause: Duration) -> Result<(i64, i64)> {
    // The provider call between a job's two writes: B's outlasts A's pause, so A wakes
    // between B's two writes.
    let provider = pause.saturating_sub(ttl / 2);
    stage.provider.set_latency(provider);
    let cues = Arc::new(Cues::default());
    let a = {
        let (stage, cues) = (stage.clone(), cues.clone());
        tokio::spawn(async move { worker_a(&stage, &cues, ttl, pause, provider).await })
    };
    let b = {
        let (stage, cues) = (stage.clone(), cues.clone());
        tokio::spawn(async move { worker_b(&stage, &cues, ttl, pause, provider).await })
    };
    let a_token = a.await.context("worker A panicked")??;
    let b_token = b.await.context("worker B panicked")??;
    Ok((a_token, b_token))
}

/// Takes the lock, claims the row, writes step 1, records the charge, pauses past the TTL
/// right before its provider call, wakes and carries on with its job anyway: the call, then
/// step 2.
async fn worker_a(
    stage: &Stage,
    cues: &Cues,
    ttl: Duration,
    pause: Duration,
    provider: Duration,
) -> Result<i64> {
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
    let mut row = claim(stage, 'A', &lease).await?;
    let mut fenced_out = !write(stage, 'A', &lease, &mut row, 1).await?;
    let key = if fenced_out {
        None
    } else {
        record_charge(stage, 'A', &lease).await?
    };
    if !fenced_out {
        rec.record('A', What::Pause(pause));
        tokio::time::sleep(pause).await;
        rec.record('A', What::Wake);
        after(&cues.b_called).await;
        call_provider(stage, 'A', key, provider).await?;
        if !stage.fenced {
            after(&cues.b_second).await;
        }
        fenced_out = !write(stage, 'A', &lease, &mut row, 2).await?;
    }
    cues.a_second.notify_one();
    if fenced_out {
        rec.record('A', What::FencedOut);
    }
    let state = stage.issuer.release(&lease).await?;
    rec.record('A', What::Released(release_word(state)));
    Ok(lease.token().get())
}

/// Queues for the lock behind A, gets it once A's lease expires, and runs the job under that
/// one lease: claim, step 1, record the charge, the provider call, step 2 (with the call's
/// outcome recorded).
async fn worker_b(
    stage: &Stage,
    cues: &Cues,
    ttl: Duration,
    pause: Duration,
    provider: Duration,
) -> Result<i64> {
    let rec = &stage.rec;
    // Let A go first; then queue for the lock like a second job instance would. The lease
    // (as long as A's pause) outlasts the job, which ends about half a TTL after A wakes.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let lease_ttl = ttl.max(pause);
    let lease = stage
        .issuer
        .acquire_wait(&stage.resource, lease_ttl, pause * 2)
        .await?
        .context("worker B never got the lock")?;
    rec.record(
        'B',
        What::Acquired {
            token: lease.token().get(),
            ttl: lease_ttl,
        },
    );
    let mut row = claim(stage, 'B', &lease).await?;
    if write(stage, 'B', &lease, &mut row, 1).await? {
        let key = record_charge(stage, 'B', &lease).await?;
        let requests_before = stage.provider.counts().0;
        let call = {
            let (url, key) = (stage.provider.url(), key.clone());
            tokio::task::spawn_blocking(move || charge(&url, key.as_deref()))
        };
        rec.record(
            'B',
            What::Call {
                key,
                took: provider,
            },
        );
        // A's late call comes once the provider has B's request (its key is then in flight).
        let deadline = tokio::time::Instant::now() + CUE_WAIT;
        while stage.provider.counts().0 == requests_before
            && !call.is_finished()
            && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        cues.b_called.notify_one();
        let answer = call.await.context("provider call panicked")??;
        record_answer(stage, 'B', &answer);
        if stage.fenced {
            after(&cues.a_second).await;
        }
        if let (Some(effects), Some(charge)) = (&stage.effects, charge_id(&answer)) {
            effects
                .finish_step(
                    &stage.pool,
                    &lease,
                    BATCH,
                    STEP,
                    EffectOutcome::Succeeded(serde_json::json!({ "charge": charge })),
                )
                .await?;
            rec.record('B', What::Outcome(charge));
        }
        let applied = write(stage, 'B', &lease, &mut row, 2).await;
        cues.b_second.notify_one();
        applied?;
    } else {
        cues.b_called.notify_one();
        cues.b_second.notify_one();
        rec.record('B', What::FencedOut);
    }
    let state = stage.issuer.release(&lease).await?;
    rec.record('B', What::Released(release_word(state)));
    Ok(lease.token().get())
}

/// The effect ledger's step for the provider call.
const STEP: &str = "charge";

/// Records the charge in the effect ledger (fenced runs) and returns its idempotency key;
/// `None` unfenced (no ledger: the call goes out without a key).
async fn record_charge(stage: &Stage, actor: char, lease: &Lease) -> Result<Option<String>> {
    let Some(effects) = &stage.effects else {
        return Ok(None);
    };
    let effect = effects.begin(&stage.pool, lease, BATCH, STEP).await?;
    stage.rec.record(
        actor,
        What::Effect {
            key: effect.idempotency_key().to_owned(),
            holders: effect.holders(),
        },
    );
    Ok(Some(effect.idempotency_key().to_owned()))
}

/// Calls the provider (A's late call) and records the call and its answer.
async fn call_provider(
    stage: &Stage,
    actor: char,
    key: Option<String>,
    took: Duration,
) -> Result<pgfence_testkit::provider::Answer> {
    stage.rec.record(
        actor,
        What::Call {
            key: key.clone(),
            took,
        },
    );
    let url = stage.provider.url();
    let answer = tokio::task::spawn_blocking(move || charge(&url, key.as_deref()))
        .await
        .context("provider call panicked")??;
    record_answer(stage, actor, &answer);
    Ok(answer)
}

fn charge(url: &str, key: Option<&str>) -> Result<pgfence_testkit::provider::Answer> {
    pgfence_testkit::provider::charge(url, key, BATCH, 100, Duration::from_secs(30))
        .context("cannot reach the demo's payment provider")
}

/// The charge id in a provider's answer (`{"id":"ch_1",...}`).
fn charge_id(answer: &pgfence_testkit::provider::Answer) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(&answer.body).ok()?;
    v.get("id")?.as_str().map(str::to_owned)
}

fn record_answer(stage: &Stage, actor: char, answer: &pgfence_testkit::provider::Answer) {
    stage.rec.record(
        actor,
        What::Answer {
            status: answer.status,
            charge: charge_id(answer),
            replayed: answer.replayed,
        },
    );
}

/// What a release answered, in words.
fn release_word(outcome: ReleaseOutcome) -> &'static str {
    match outcome {
        ReleaseOutcome::Released => "released the lock",
        ReleaseOutcome::AlreadyExpired => "release: the lock had expired",
        ReleaseOutcome::TakenByOther => "release refused: another holder has the lock",
    }
}

/// Reads the demo row before the job's writes: fenced, claims it for `lease` in the same
/// statement (claim before read); unfenced, a plain `SELECT`.
async fn claim(stage: &Stage, actor: char, lease: &Lease) -> Result<DemoRow> {
    let key = BATCH.to_owned();
    let (row, claimed_with) = if let (true, Some(repo)) = (stage.fenced, &stage.repo) {
        let row: DemoRow = repo.claim(&stage.pool, lease, &key).await?;
        (row, Some(lease.token().get()))
    } else {
        let sql = format!(
            "SELECT batch, status, paid_by FROM {} WHERE batch = $1",
            stage.table.quoted()
        );
        let row: DemoRow = sqlx::query_as(AssertSqlSafe(sql))
            .bind(&key)
            .fetch_one(&stage.pool)
            .await?;
        (row, None)
    };
    stage.rec.record(
        actor,
        What::Read {
            claimed_with,
            status: row.status.clone(),
            paid_by: row.paid_by.clone(),
        },
    );
    Ok(row)
}

/// Writes step `step` of `actor`'s job into `row` and the table: step 1 marks the batch
/// `processing by <actor>`, step 2 marks it `paid` by `actor`. Fenced through the repository,
/// or a plain `UPDATE`. True if the write was applied, false if it was rejected as stale.
async fn write(
    stage: &Stage,
    actor: char,
    lease: &Lease,
    row: &mut DemoRow,
    step: u8,
) -> Result<bool> {
    let set = if step == 1 {
        row.status = format!("processing by {actor}");
        format!("status = {}", row.status)
    } else {
        row.status = "paid".into();
        row.paid_by = actor.to_string();
        format!("status = {}, paid_by = {}", row.status, row.paid_by)
    };
    let (token, applied, detail) = if let (true, Some(repo)) = (stage.fenced, &stage.repo) {
        match repo.update(&stage.pool, lease, &*row).await {
            Ok(()) if step == 1 => (Some(lease.token().get()), true, "applied".to_owned()),
            Ok(()) => (
                Some(lease.token().get()),
                true,
                "applied (same lease, second write)".to_owned(),
            ),
            Err(Error::StaleToken {
                presented, current, ..
            }) => (
                Some(presented),
                false,
                format!("REJECTED: stale token (presented {presented}, current {current})"),
            ),
            Err(e) => return Err(e.into()),
        }
    } else {
        let sql = format!(
            "UPDATE {} SET status = $1, paid_by = $2 WHERE batch = $3",
            stage.table.quoted()
        );
        sqlx::query(AssertSqlSafe(sql))
            .bind(&row.status)
            .bind(&row.paid_by)
            .bind(&row.batch)
            .execute(&stage.pool)
            .await?;
        (None, true, "applied (no fence to check)".to_owned())
    };
    stage.rec.record(
        actor,
        What::Write {
            step,
            set,
            token,
            applied,
            detail,
        },
    );
    Ok(applied)
}

/// The demo row once the race is over.
pub struct FinalRow {
    /// Its status.
    pub status: String,
    /// Who it says paid.
    pub paid_by: String,
    /// The token its fence was written with (0 when unfenced). A stored fence also packs the
    /// holder's tag and a write sequence; the story is told in tokens.
    pub token: i64,
}

/// The demo row once the race is over.
pub async fn final_row(stage: &Stage) -> Result<FinalRow> {
    let (status, paid_by, fence): (String, String, i64) = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT status, paid_by, {} FROM {} WHERE batch = $1",
        if stage.fenced { "fence" } else { "0::bigint" },
        stage.table.quoted()
    )))
    .bind(BATCH)
    .fetch_one(&stage.pool)
    .await?;
    Ok(FinalRow {
        status,
        paid_by,
        token: FenceToken::of_fence(fence),
    })
}
