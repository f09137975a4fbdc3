//! The interview problem, solved: two instances of a payment reconciliation job race for the
//! same batch, and one of them pauses past its lock's TTL.
//!
//! Two layers keep the money right:
//! * **fencing** — each instance runs `pgfence.check` for the batch first in the transaction
//!   that writes its ledger rows, so the paused instance's transaction is rejected once a newer
//!   holder has checked;
//! * **idempotency keys** at the payment provider (a table with a unique key stands in for
//!   it) — the provider call is outside our database and cannot be fenced, so a duplicate call
//!   must be a no-op there.
//!
//! Uses `DATABASE_URL` / `REDIS_URL` when set, else throwaway servers. Exits non-zero unless
//! exactly one set of payments exists at the end.
//!
//! ```sh
//! cargo run --example payment_reconciliation
//! ```

// A command-line tool: printing to stdout is its job.
#![allow(clippy::print_stdout)]

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use pgfence::{Error, Fence, Issuer, Lease, Resource};
use pgfence_testkit::{Kind, url_or_start};
use sqlx::PgPool;

const TTL: Duration = Duration::from_millis(300);
const PAUSE: Duration = Duration::from_millis(800);

#[tokio::main]
async fn main() -> Result<()> {
    // The configured servers, or throwaway ones kept alive until the end of main.
    let (pg_url, _pg) = url_or_start(
        Kind::Postgres,
        std::env::var("DATABASE_URL").ok().as_deref(),
    )
    .await?;
    let (redis_url, _redis) =
        url_or_start(Kind::Redis, std::env::var("REDIS_URL").ok().as_deref()).await?;
    let pool = PgPool::connect(&pg_url).await?;
    pgfence::migrate(&pool).await?;
    let schema = format!("recon_{:08x}", rand::random::<u32>());
    setup(&pool, &schema).await?;
    let issuer = Issuer::connect(&redis_url).await?;
    let batch = Resource::new(format!("payments:batch:42:{schema}"))?;
    let fence = Fence::new(pool.clone());

    // Instance A takes the lock first, then stalls (GC, VM migration...) past its TTL.
    let a = {
        let (pool, issuer, batch, fence, schema) = (
            pool.clone(),
            issuer.clone(),
            batch.clone(),
            fence.clone(),
            schema.clone(),
        );
        tokio::spawn(
            async move { reconcile("A", &pool, &issuer, &fence, &batch, &schema, PAUSE).await },
        )
    };
    tokio::time::sleep(Duration::from_millis(30)).await;
    // Instance B queues for the lock and gets it when A's lease expires.
    let b = {
        let (pool, issuer, batch, fence, schema) = (
            pool.clone(),
            issuer.clone(),
            batch.clone(),
            fence.clone(),
            schema.clone(),
        );
        tokio::spawn(async move {
            reconcile("B", &pool, &issuer, &fence, &batch, &schema, Duration::ZERO).await
        })
    };
    let (a, b) = (a.await??, b.await??);

    let ledger: Vec<(i64, String)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT invoice, paid_by FROM {schema}.ledger ORDER BY invoice"
    )))
    .fetch_all(&pool)
    .await?;
    let charges: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {schema}.provider_charges"
    )))
    .fetch_one(&pool)
    .await?;
    let duplicate_calls: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT coalesce(sum(calls - 1), 0)::bigint FROM {schema}.provider_charges"
    )))
    .fetch_one(&pool)
    .await?;
    println!();
    println!("instance A: {a}");
    println!("instance B: {b}");
    println!(
        "ledger: {} payment(s), all by {:?}",
        ledger.len(),
        ledger
            .iter()
            .map(|l| l.1.as_str())
            .collect::<std::collections::BTreeSet<_>>()
    );
    println!(
        "provider: {charges} charge(s); {duplicate_calls} duplicate call(s) absorbed by idempotency keys"
    );

    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&pool)
        .await?;
    sqlx::query("DELETE FROM pgfence.audit WHERE resource = $1")
        .bind(batch.as_str())
        .execute(&pool)
        .await?;
    sqlx::query("DELETE FROM pgfence.resource_fence WHERE resource = $1")
        .bind(batch.as_str())
        .execute(&pool)
        .await?;

    ensure!(
        ledger.len() == 3,
        "expected exactly one set of 3 payments, found {}",
        ledger.len()
    );
    ensure!(
        ledger.iter().all(|l| l.1 == "B"),
        "the stale instance's payments must not be recorded"
    );
    ensure!(
        charges == 3,
        "the provider must have charged each invoice once, charged {charges}"
    );
    ensure!(
        duplicate_calls >= 1,
        "instance A's late provider calls should have been deduplicated"
    );
    println!("exactly one set of payments: fencing + idempotency keys held");
    Ok(())
}

async fn setup(pool: &PgPool, schema: &str) -> Result<()> {
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE SCHEMA {schema};
         CREATE TABLE {schema}.invoices (id bigint PRIMARY KEY, batch int NOT NULL, amount bigint NOT NULL);
         INSERT INTO {schema}.invoices VALUES (1, 42, 1000), (2, 42, 2500), (3, 42, 400);
         CREATE TABLE {schema}.ledger (invoice bigint PRIMARY KEY, amount bigint NOT NULL, paid_by text NOT NULL);
         -- The payment provider, with its idempotency keys.
         CREATE TABLE {schema}.provider_charges (idempotency_key text PRIMARY KEY, amount bigint NOT NULL, calls int NOT NULL DEFAULT 1);"
    )))
    .execute(pool)
    .await?;
    Ok(())
}

/// One run of the job for batch 42; returns what happened, in words.
async fn reconcile(
    me: &str,
    pool: &PgPool,
    issuer: &Issuer,
    fence: &Fence,
    batch: &Resource,
    schema: &str,
    pause: Duration,
) -> Result<String> {
    let lease: Lease = issuer
        .acquire_wait(batch, TTL, Duration::from_secs(5))
        .await?
        .context("never got the lock")?;
    println!("{me}: acquired {batch} with token {}", lease.token());
    let invoices: Vec<(i64, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT id, amount FROM {schema}.invoices WHERE batch = 42 ORDER BY id"
    )))
    .fetch_all(pool)
    .await?;
    if !pause.is_zero() {
        println!(
            "{me}: computed {} payments, then stalls for {}ms (lease TTL {}ms)",
            invoices.len(),
            pause.as_millis(),
            TTL.as_millis()
        );
        tokio::time::sleep(pause).await;
        println!("{me}: resumes, unaware that its lease expired");
    }

    // The provider call happens outside our database; only its idempotency key protects it.
    for (id, amount) in &invoices {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {schema}.provider_charges (idempotency_key, amount) VALUES ($1, $2)
             ON CONFLICT (idempotency_key) DO UPDATE SET calls = provider_charges.calls + 1"
        )))
        .bind(format!("batch-42/invoice-{id}"))
        .bind(amount)
        .execute(pool)
        .await?;
    }

    // The ledger is ours: fence the whole batch's transaction.
    let mut tx = pool.begin().await?;
    match fence.check(&mut *tx, batch, &lease).await {
        Ok(()) => {}
        Err(Error::StaleToken {
            presented, current, ..
        }) => {
            tx.rollback().await?;
            let _ = issuer.release(&lease).await;
            println!(
                "{me}: ledger write REJECTED (token {presented}, batch already at {current}); rolled back"
            );
            return Ok(format!(
                "fenced out with token {presented} (newer token {current} had checked)"
            ));
        }
        Err(e) => return Err(e.into()),
    }
    for (id, amount) in &invoices {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {schema}.ledger (invoice, amount, paid_by) VALUES ($1, $2, $3)"
        )))
        .bind(id)
        .bind(amount)
        .bind(me)
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    issuer.release(&lease).await?;
    println!(
        "{me}: recorded {} payments with token {}",
        invoices.len(),
        lease.token()
    );
    Ok(format!(
        "recorded {} payments with token {}",
        invoices.len(),
        lease.token()
    ))
}
