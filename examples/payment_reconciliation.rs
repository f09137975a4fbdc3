//! The interview problem, solved: two instances of a payment reconciliation job race for the
//! same batch, and one of them pauses past its lock's TTL — right between recording its charges
//! and calling the payment provider, the worst moment.
//!
//! Two layers keep the money right:
//! * **fencing** — each instance runs `pgfence.check` for the batch first in the transaction
//!   that writes its ledger rows, so the paused instance's transaction is rejected once a newer
//!   holder has checked;
//! * **the effect ledger** ([`pgfence::Effects`]) — the provider call is outside our database
//!   and cannot be fenced, so each charge is recorded under the lease before the call and gets
//!   an idempotency key that is the same for every instance; the provider (a real HTTP server on
//!   loopback that honours `Idempotency-Key`) makes each charge once, and the paused
//!   instance's late calls are replays.
//!
//! Uses `DATABASE_URL` / `REDIS_URL` when set, else throwaway servers. Exits non-zero unless
//! each invoice was charged exactly once and exactly one set of payments exists at the end.
//!
//! ```sh
//! cargo run --example payment_reconciliation
//! ```

// A command-line tool: printing to stdout is its job.
#![allow(clippy::print_stdout)]

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use pgfence::{Effects, Error, Fence, Lease, RedisIssuer, Resource, effect::EffectOutcome};
use pgfence_testkit::provider::charge;
use pgfence_testkit::{Kind, Provider, url_or_start};
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
    pgfence::admin::migrate(&pool).await?;
    let schema = format!("recon_{:08x}", rand::random::<u32>());
    setup(&pool, &schema).await?;
    let issuer = RedisIssuer::connect(&redis_url).await?;
    let batch = Resource::new(format!("payments:batch:42:{schema}"))?;
    let fence = Fence::new(pool.clone());
    let job = Job {
        pool: pool.clone(),
        issuer: issuer.clone(),
        fence,
        effects: Effects::new(pool.clone()),
        batch: batch.clone(),
        schema: schema.clone(),
        // The payment provider: a real HTTP server on loopback that honours Idempotency-Key.
        provider: std::sync::Arc::new(Provider::start(Duration::from_millis(10))?),
    };

    // Instance A takes the lock first, then stalls (GC, VM migration...) past its TTL.
    let a = {
        let job = job.clone();
        tokio::spawn(async move { job.reconcile("A", PAUSE).await })
    };
    tokio::time::sleep(Duration::from_millis(30)).await;
    // Instance B queues for the lock and gets it when A's lease expires.
    let b = {
        let job = job.clone();
        tokio::spawn(async move { job.reconcile("B", Duration::ZERO).await })
    };
    let (a, b) = (a.await??, b.await??);

    let ledger: Vec<(i64, String)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT invoice, paid_by FROM {schema}.ledger ORDER BY invoice"
    )))
    .fetch_all(&pool)
    .await?;
    let charges = job.provider.all_charges();
    let (_, replays, conflicts) = job.provider.counts();
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
        "provider: {} charge(s) for {} invoice(s); {} late call(s) replayed, {} refused as in flight (idempotency keys)",
        charges.values().sum::<u64>(),
        charges.len(),
        replays,
        conflicts
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
    sqlx::query("DELETE FROM pgfence.effect WHERE scope = $1")
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
        charges.len() == 3 && charges.values().all(|n| *n == 1),
        "the provider must have charged each invoice once, charged {charges:?}"
    );
    ensure!(
        replays + conflicts >= 1,
        "instance A's late provider calls should have been deduplicated"
    );
    println!(
        "exactly one set of payments, one charge per invoice: fencing + the effect ledger held"
    );
    Ok(())
}

async fn setup(pool: &PgPool, schema: &str) -> Result<()> {
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE SCHEMA {schema};
         CREATE TABLE {schema}.invoices (id bigint PRIMARY KEY, batch int NOT NULL, amount bigint NOT NULL);
         INSERT INTO {schema}.invoices VALUES (1, 42, 1000), (2, 42, 2500), (3, 42, 400);
         CREATE TABLE {schema}.ledger (invoice bigint PRIMARY KEY, amount bigint NOT NULL, paid_by text NOT NULL);"
    )))
    .execute(pool)
    .await?;
    Ok(())
}

/// What one instance of the job works with.
#[derive(Clone)]
struct Job {
    pool: PgPool,
    issuer: RedisIssuer,
    fence: Fence,
    effects: Effects,
    batch: Resource,
    schema: String,
    provider: std::sync::Arc<Provider>,
}

impl Job {
    /// One run of the job for batch 42; returns what happened, in words.
    async fn reconcile(&self, me: &str, pause: Duration) -> Result<String> {
        let Job {
            pool,
            issuer,
            fence,
            effects,
            batch,
            schema,
            provider,
        } = self;
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

        // Record each charge before calling: committed at once, so an instance that takes
        // over finds the same idempotency key. A fenced-out lease is refused here.
        let mut calls = Vec::new();
        for (id, amount) in &invoices {
            let work = format!("invoice-{id}");
            match effects.begin(pool, &lease, &work, "charge").await {
                Ok(effect) if effect.is_done() => {
                    println!("{me}: {work} already charged by an earlier instance");
                }
                Ok(effect) => calls.push((work, *amount, effect)),
                Err(e @ Error::StaleToken { .. }) => {
                    println!("{me}: {work} refused before calling the provider: {e}");
                    return Ok("fenced out before calling the provider".into());
                }
                Err(e) => return Err(e.into()),
            }
        }
        if !pause.is_zero() {
            println!(
                "{me}: recorded {} charges, then stalls for {}ms before calling (lease TTL {}ms)",
                calls.len(),
                pause.as_millis(),
                TTL.as_millis()
            );
            tokio::time::sleep(pause).await;
            println!("{me}: resumes, unaware that its lease expired, and calls the provider");
        }

        // The provider call happens outside our database; the ledger's key protects it.
        let mut outcomes = Vec::new();
        for (work, amount, effect) in calls {
            let (url, key, item) = (
                provider.url(),
                effect.idempotency_key().to_owned(),
                work.clone(),
            );
            let answer = tokio::task::spawn_blocking(move || {
                charge(&url, Some(&key), &item, amount, Duration::from_secs(5))
            })
            .await??;
            println!(
                "{me}: {work}: provider answered {}{}",
                answer.status,
                if answer.replayed {
                    " (a replay: charged once already)"
                } else {
                    ""
                }
            );
            outcomes.push((effect, answer.body));
        }

        // The ledger is ours: fence the whole batch's transaction; the charges' outcomes
        // commit with it.
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
        for (effect, body) in &outcomes {
            let detail = serde_json::from_str(body).unwrap_or(serde_json::Value::Null);
            effects
                .finish(&mut *tx, &lease, effect, EffectOutcome::Succeeded(detail))
                .await?;
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
}
