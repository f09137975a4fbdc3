//! Section `idle` (opt-in: run when named, or when `PGFENCE_BENCH_IDLE_RESOURCES` is set): the
//! issuer state idle resources leave behind, before and after idle expiry (`docs/issuers.md`, "Idle expiry"). N resources
//! (`PGFENCE_BENCH_IDLE_RESOURCES`, 100,000) are each acquired and released once:
//!
//! - Redis, counters kept for ever (the default): keys of the run left (`SCAN`), and bytes
//!   (`INFO memory` `used_memory` after minus before); then the same with
//!   `with_idle_expiry(1 s)`, once Redis has expired them;
//! - the PostgreSQL issuer: rows of `pgfence.issuer_counter` / `issuer_lock` and their size
//!   (`pg_total_relation_size` after `VACUUM`), without idle expiry, and after
//!   `PgIssuer::expire_idle` (counters folded into `pgfence.issuer_floor`, counted too).
//!
//! Runs once, not per round: it measures state, not speed (the acquire rate of each pass is
//! printed for information). It fails when state it should have expired is still there.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use pgfence::issuer::PgIssuer;
use pgfence::{RedisIssuer, Resource, TokenIssuer};
use serde_json::{Value, json};

use crate::servers::Env;

/// Tasks acquiring at once.
const TASKS: usize = 32;

/// `PGFENCE_BENCH_IDLE_RESOURCES`, or 100,000.
fn resources() -> Result<usize> {
    match std::env::var("PGFENCE_BENCH_IDLE_RESOURCES") {
        Ok(v) if !v.trim().is_empty() => Ok(v.trim().parse()?),
        _ => Ok(100_000),
    }
}

/// Acquires and releases `n` resources `{name}:{i}` once each, `TASKS` at a time; the rate.
async fn lock_each_once(issuer: Arc<dyn TokenIssuer>, name: &str, n: usize) -> Result<f64> {
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..TASKS {
        let (issuer, name) = (issuer.clone(), name.to_owned());
        tasks.spawn(async move {
            for i in (t..n).step_by(TASKS) {
                let resource = Resource::new(format!("{name}:{i}"))?;
                let Some(lease) = issuer.acquire(&resource, Duration::from_secs(1)).await? else {
                    bail!("{resource} was busy");
                };
                issuer.release(&lease).await?;
            }
            Ok(())
        });
    }
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    #[allow(clippy::cast_precision_loss)]
    Ok(n as f64 / start.elapsed().as_secs_f64())
}

async fn redis_conn(env: &Env) -> Result<redis::aio::MultiplexedConnection> {
    Ok(redis::Client::open(env.redis_url.as_str())?
        .get_multiplexed_async_connection()
        .await?)
}

/// Keys matching `pattern`, counted with `SCAN`.
async fn count_keys(conn: &mut redis::aio::MultiplexedConnection, pattern: &str) -> Result<u64> {
    let (mut cursor, mut n) = (0u64, 0u64);
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(10_000)
            .query_async(conn)
            .await?;
        n += keys.len() as u64;
        if next == 0 {
            return Ok(n);
        }
        cursor = next;
    }
}

/// Deletes the keys matching `pattern`.
async fn delete_keys(conn: &mut redis::aio::MultiplexedConnection, pattern: &str) -> Result<()> {
    let mut cursor = 0u64;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(10_000)
            .query_async(conn)
            .await?;
        if !keys.is_empty() {
            redis::cmd("UNLINK")
                .arg(&keys)
                .query_async::<()>(conn)
                .await?;
        }
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}

/// `used_memory` of `INFO memory`.
async fn used_memory(conn: &mut redis::aio::MultiplexedConnection) -> Result<i64> {
    let info: String = redis::cmd("INFO").arg("memory").query_async(conn).await?;
    info.lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no used_memory in INFO memory"))
}

#[allow(clippy::cast_precision_loss)]
fn per(total: i64, n: usize) -> f64 {
    total as f64 / n as f64
}

/// The Redis figures: (keys, bytes) per idle resource without and with idle expiry.
async fn redis_idle(env: &Env, n: usize) -> Result<Value> {
    let mut conn = redis_conn(env).await?;
    let mut out = serde_json::Map::new();
    for (label, idle) in [
        ("kept", None),
        ("idle_expiry_1s", Some(Duration::from_secs(1))),
    ] {
        let name = format!("{}:idle:{label}", env.run_id);
        let pattern = format!("pgfence:{{{name}:*");
        let before = used_memory(&mut conn).await?;
        let mut issuer = RedisIssuer::connect(&env.redis_url).await?;
        if let Some(idle) = idle {
            issuer = issuer.with_idle_expiry(idle)?;
        }
        let rate = lock_each_once(Arc::new(issuer), &name, n).await?;
        if idle.is_some() {
            // The last lease's TTL and the idle expiry, then Redis's expiry cycle.
            let until = Instant::now() + Duration::from_secs(120);
            while count_keys(&mut conn, &pattern).await? > 0 && Instant::now() < until {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
        let keys = count_keys(&mut conn, &pattern).await?;
        if idle.is_some() && keys > 0 {
            bail!("{keys} Redis keys of {n} idle resources did not expire within 120 s");
        }
        let bytes = used_memory(&mut conn).await? - before;
        println!(
            "idle: Redis, {label}: {n} resources locked once -> {keys} keys left ({:.2} per resource), {bytes} bytes ({:.1} per resource); {rate:.0} acquire+release/s",
            per(i64::try_from(keys)?, n),
            per(bytes, n)
        );
        out.insert(
            label.to_owned(),
            json!({"resources": n, "keys": keys, "bytes": bytes,
                   "keys_per_resource": per(i64::try_from(keys)?, n),
                   "bytes_per_resource": per(bytes, n), "acquire_release_per_s": rate}),
        );
        delete_keys(&mut conn, &pattern).await?;
    }
    Ok(Value::Object(out))
}

/// Rows of a PostgreSQL issuer table for `prefix`.
async fn pg_rows(env: &Env, table: &str, prefix: &str) -> Result<i64> {
    Ok(sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM pgfence.{table} WHERE prefix = $1"
    )))
    .bind(prefix)
    .fetch_one(&env.admin)
    .await?)
}

/// Bytes of the PostgreSQL issuer's tables (with indexes), after `VACUUM`.
async fn pg_bytes(env: &Env) -> Result<i64> {
    sqlx::raw_sql("VACUUM pgfence.issuer_counter, pgfence.issuer_lock, pgfence.issuer_floor")
        .execute(&env.admin)
        .await?;
    Ok(sqlx::query_scalar(
        "SELECT (pg_total_relation_size('pgfence.issuer_counter') \
          + pg_total_relation_size('pgfence.issuer_lock') \
          + pg_total_relation_size('pgfence.issuer_floor'))::int8",
    )
    .fetch_one(&env.admin)
    .await?)
}

/// The PostgreSQL issuer's figures: rows per idle resource without idle expiry and after
/// `expire_idle`.
async fn pg_idle(env: &Env, n: usize) -> Result<Value> {
    let prefix = "benchidle";
    let issuer = PgIssuer::connect(&env.db_url)
        .await?
        .with_key_prefix(prefix)?;
    let empty = pg_bytes(env).await?;
    let rate = lock_each_once(Arc::new(issuer.clone()), &format!("{}:pg", env.run_id), n).await?;
    let counters = pg_rows(env, "issuer_counter", prefix).await?;
    let locks = pg_rows(env, "issuer_lock", prefix).await?;
    let bytes = pg_bytes(env).await? - empty;
    println!(
        "idle: PostgreSQL issuer, kept: {n} resources locked once -> {counters} counter rows, {locks} lock rows ({:.2} rows per resource), {bytes} bytes of tables ({:.1} per resource); {rate:.0} acquire+release/s",
        per(counters + locks, n),
        per(bytes, n)
    );
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let start = Instant::now();
    let done = issuer.expire_idle(Duration::from_secs(1)).await?;
    let took = start.elapsed();
    let after = pg_rows(env, "issuer_counter", prefix).await?;
    if after > 0 {
        bail!("{after} PostgreSQL issuer counters of idle resources were not expired");
    }
    let floors = pg_rows(env, "issuer_floor", prefix).await?;
    let after_bytes = pg_bytes(env).await? - empty;
    println!(
        "idle: PostgreSQL issuer, expire_idle(1 s): {} counters deleted in {took:.2?} -> {after} counter rows and {floors} floor rows left ({:.4} rows per resource); tables {after_bytes} bytes after VACUUM (space reusable, not returned to the OS)",
        done.counters,
        per(after + floors, n)
    );
    Ok(json!({
        "kept": {"resources": n, "counter_rows": counters, "lock_rows": locks, "bytes": bytes,
                 "rows_per_resource": per(counters + locks, n), "acquire_release_per_s": rate},
        "expired": {"counters_deleted": done.counters, "seconds": took.as_secs_f64(),
                    "counter_rows": after, "floor_rows": floors, "bytes_after_vacuum": after_bytes,
                    "rows_per_resource": per(after + floors, n)},
    }))
}

/// Section `idle`: both issuers' figures, once.
pub(crate) async fn idle(env: &Env) -> Result<Value> {
    let n = resources()?;
    let redis = redis_idle(env, n).await?;
    let pg = pg_idle(env, n).await?;
    Ok(json!({"redis": redis, "pg": pg}))
}
