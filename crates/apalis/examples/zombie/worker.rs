//! One apalis-postgres worker process of the zombie scenario (`main.rs`, the tests): it
//! charges an invoice — claim the row, record the charge in the effect ledger, call the
//! payment provider, mark the row paid — and stops after its first task.
//!
//! `fenced` runs the handler under [`FenceLayer`]; `plain` is the same job as most services
//! write it today: plain SQL and a provider call without an idempotency key.
//!
//! Right before its provider call the handler prints `PAUSE <task id>` and waits for a line
//! on stdin: the scenario stops the process there (`SIGSTOP`) before it lets it go on, so the
//! stop lands at that point however loaded the machine is (stdin at its end: no wait).
//! Each finished task prints `OUTCOME ok <result>` or `OUTCOME error <error>`; pgfence's and
//! apalis's log events go to stderr.
#![allow(dead_code)]
// A worker process reports to its parent on stdout.
#![allow(clippy::print_stdout)]

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use apalis_core::error::BoxDynError;
use apalis_core::task::data::Data;
use apalis_core::worker::builder::WorkerBuilder;
use apalis_core::worker::context::WorkerContext;
use apalis_core::worker::event::Event;
use apalis_core::worker::ext::event_listener::EventListenerExt;
use apalis_postgres::{Config, PostgresStorage};
use pgfence::Repository;
use pgfence::effect::EffectOutcome;
use pgfence::issuer::PgIssuer;
use pgfence_apalis::{FenceLayer, TaskLease};
use sqlx::PgPool;

/// apalis-postgres heartbeat interval: a worker silent for [`MISSED_HEARTBEATS`] of them is
/// dead and its tasks are re-enqueued (apalis-postgres counts that timeout in whole seconds).
pub const HEARTBEAT: Duration = Duration::from_millis(500);
/// Heartbeats a worker may miss.
pub const MISSED_HEARTBEATS: usize = 2;
/// The lease TTL: renewed every TTL/3 while the handler runs.
pub const TTL: Duration = Duration::from_millis(900);
/// The amount charged.
pub const AMOUNT: i64 = 4200;

/// The task: charge one invoice.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct ChargeInvoice {
    /// The invoice's id.
    pub invoice: i64,
}

/// The fenced handler's table, guarded by pgfence.
pub const FENCED: &str = "pgfence_apalis_demo.invoices";
/// The control's table: the same columns, not guarded.
pub const UNFENCED: &str = "pgfence_apalis_demo.invoices_unfenced";

/// A row of either table (the derive names the guarded one).
#[derive(Clone, Debug, sqlx::FromRow, pgfence::FencedTable)]
#[fenced(schema = "pgfence_apalis_demo", table = "invoices")]
pub struct Invoice {
    #[fenced(key)]
    pub id: i64,
    pub amount: i64,
    pub status: String,
    pub paid_by: Option<String>,
    pub charge_id: Option<String>,
    /// How many writes marked the invoice paid.
    pub paid_writes: i32,
}

/// The demo schema, its guarded table and both libraries' schemas (idempotent).
pub async fn setup(pool: &PgPool) -> Result<(), BoxDynError> {
    pgfence::admin::migrate(pool).await?;
    PostgresStorage::setup(pool).await?;
    sqlx::raw_sql(
        "CREATE SCHEMA IF NOT EXISTS pgfence_apalis_demo;
         CREATE TABLE IF NOT EXISTS pgfence_apalis_demo.invoices (
             id bigint PRIMARY KEY,
             amount bigint NOT NULL,
             status text NOT NULL,
             paid_by text,
             charge_id text,
             paid_writes int NOT NULL DEFAULT 0);
         CREATE TABLE IF NOT EXISTS pgfence_apalis_demo.invoices_unfenced
             (LIKE pgfence_apalis_demo.invoices INCLUDING ALL)",
    )
    .execute(pool)
    .await?;
    pgfence::guard::guard(
        pool,
        &pgfence::table::TableName::new("pgfence_apalis_demo", "invoices")?,
    )
    .await?;
    Ok(())
}

/// The queue's storage with the scenario's short heartbeats.
pub fn storage(pool: &PgPool, queue: &str) -> PostgresStorage<ChargeInvoice> {
    PostgresStorage::new(pool).with_config(
        Config::default()
            .queue(queue)
            .batch_size(1)
            .heartbeat_interval(HEARTBEAT)
            .missed_heartbeats(MISSED_HEARTBEATS),
    )
}

/// What the handlers share.
#[derive(Clone)]
struct App {
    pool: PgPool,
    repo: Repository<Invoice>,
    provider: String,
    me: String,
}

/// Runs one worker until it has finished one task. `args`: database URL, provider URL, queue,
/// worker name, `fenced` or `plain`.
pub async fn run(args: &[String]) -> Result<(), BoxDynError> {
    let [db, provider, queue, me, mode] = args else {
        return Err("usage: DATABASE_URL PROVIDER_URL QUEUE WORKER_NAME fenced|plain".into());
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .init();
    let pool = PgPool::connect(db).await?;
    let app = App {
        repo: Repository::new(pool.clone())?,
        pool: pool.clone(),
        provider: provider.clone(),
        me: me.clone(),
    };
    let builder = WorkerBuilder::new(me.as_str())
        .backend(storage(&pool, queue))
        .data(app)
        .on_event(|worker: &WorkerContext, event: &Event| {
            let line = match event {
                Event::Success(answer) => match answer.downcast_ref::<String>() {
                    Some(answer) => format!("OUTCOME ok {answer}"),
                    None => "OUTCOME ok".to_owned(),
                },
                Event::Error(e) => format!("OUTCOME error {e}"),
                _ => return,
            };
            say(&line);
            let _ = worker.stop();
        });
    match mode.as_str() {
        "fenced" => {
            let issuer = Arc::new(PgIssuer::new(pool.clone()));
            builder
                .layer(FenceLayer::new(issuer, pool.clone()).ttl(TTL))
                .build(charge_fenced)
                .run()
                .await?;
        }
        "plain" => builder.build(charge_plain).run().await?,
        other => return Err(format!("mode {other:?}: fenced or plain").into()),
    }
    Ok(())
}

/// The fenced handler: every write carries the run's lease; the charge carries the task's
/// idempotency key (the same for every run of this task).
async fn charge_fenced(
    job: ChargeInvoice,
    app: Data<App>,
    lease: TaskLease,
) -> Result<String, BoxDynError> {
    let App { pool, repo, me, .. } = &*app;
    // Claim before reading: from now on older runs cannot write this row.
    let mut invoice: Invoice = repo.claim(pool, &lease, &job.invoice).await?;
    invoice.status = "processing".into();
    repo.update(pool, &lease, &invoice).await?;
    let effect = lease.begin_effect("charge").await?;
    if effect.is_done() {
        return Ok(format!("already charged; {me} did nothing"));
    }
    pause_point(lease.work_key()).await;
    let answer = call_provider(&app.provider, Some(effect.idempotency_key()), &invoice).await?;
    invoice.status = "paid".into();
    invoice.paid_by = Some(me.clone());
    invoice.charge_id = Some(answer.clone());
    invoice.paid_writes += 1;
    let mut tx = pool.begin().await?;
    repo.update(&mut *tx, &lease, &invoice).await?; // StaleToken for a zombie
    lease
        .finish_effect(
            &mut *tx,
            &effect,
            EffectOutcome::Succeeded(serde_json::json!({ "charge": answer })),
        )
        .await?;
    tx.commit().await?;
    Ok(format!("paid by {me}"))
}

/// The same job without pgfence (the control), as most services write it today: plain SQL
/// on a table that is not guarded, and a provider call without an idempotency key.
async fn charge_plain(
    job: ChargeInvoice,
    app: Data<App>,
    task: apalis_core::task::task_id::TaskId,
) -> Result<String, BoxDynError> {
    let App { pool, me, .. } = &*app;
    let invoice: Invoice =
        sqlx::query_as("SELECT * FROM pgfence_apalis_demo.invoices_unfenced WHERE id = $1")
            .bind(job.invoice)
            .fetch_one(pool)
            .await?;
    sqlx::query(
        "UPDATE pgfence_apalis_demo.invoices_unfenced SET status = 'processing' WHERE id = $1",
    )
    .bind(job.invoice)
    .execute(pool)
    .await?;
    pause_point(&task.to_string()).await;
    let answer = call_provider(&app.provider, None, &invoice).await?;
    sqlx::query(
        "UPDATE pgfence_apalis_demo.invoices_unfenced
         SET status = 'paid', paid_by = $2, charge_id = $3, paid_writes = paid_writes + 1
         WHERE id = $1",
    )
    .bind(job.invoice)
    .bind(me)
    .bind(&answer)
    .execute(pool)
    .await?;
    Ok(format!("paid by {me}"))
}

/// Announces the pause point and waits for the scenario's go-ahead (a line on stdin).
async fn pause_point(task: &str) {
    say(&format!("PAUSE {task}"));
    let _ = tokio::task::spawn_blocking(|| std::io::stdin().read_line(&mut String::new())).await;
}

/// Charges the invoice; the provider's charge id (or its replayed answer).
async fn call_provider(
    provider: &str,
    key: Option<&str>,
    invoice: &Invoice,
) -> Result<String, BoxDynError> {
    let (provider, key, item, amount) = (
        provider.to_owned(),
        key.map(str::to_owned),
        format!("invoice-{}", invoice.id),
        invoice.amount,
    );
    let answer = tokio::task::spawn_blocking(move || {
        pgfence_testkit::provider::charge(
            &provider,
            key.as_deref(),
            &item,
            amount,
            Duration::from_secs(5),
        )
    })
    .await??;
    if answer.status != 200 {
        return Err(format!("provider answered {}: {}", answer.status, answer.body).into());
    }
    Ok(answer.body)
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}
